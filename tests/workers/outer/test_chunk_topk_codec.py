"""SparseLoCo's wire format (workers/outer/chunk_topk_codec.py): chunks, top-k, statistical
2- and 4-bit codes, packed positions; each part against a plain reference."""

from __future__ import annotations

import math

import pytest
import torch

from isoloco_ray.workers.outer.chunk_topk_codec import ChunkTopKCodec, chunk_side

SHAPES = [(128, 192), (96, 100), (130,), (7,), (4, 5, 6), (1, 64), (3, 1), ()]


def sample(shape, seed=0):
    generator = torch.Generator().manual_seed(seed)
    return torch.randn(shape, generator=generator) * torch.rand(shape, generator=generator)


@pytest.mark.parametrize(("shape", "tile", "chunks", "kept"), [
    ((128, 192), (64, 64), 6, 128), ((96, 100), (48, 50), 4, 75), ((130,), (1, 26), 5, 1),
    ((7,), (1, 7), 1, 1), ((4, 5, 6), (4, 30), 1, 4), ((3, 1), (3, 1), 1, 1)])
def test_chunks_are_tiles_of_the_largest_divisors_up_to_64(shape, tile, chunks, kept):
    layout = ChunkTopKCodec(1 / 32).layout(torch.Size(shape))
    assert (layout.tile, layout.chunks, layout.kept) == (tile, chunks, kept)
    assert chunk_side(4096) == 64 and chunk_side(97) == 1 and chunk_side(63) == 63


@pytest.mark.parametrize("shape", SHAPES)
def test_split_cuts_row_major_tiles_in_order_and_join_undoes_it(shape):
    codec = ChunkTopKCodec(0.1)
    x = sample(shape)
    layout = codec.layout(x.shape)
    chunks = layout.split(x)
    h, w = layout.tile
    matrix = x.reshape(layout.rows, layout.columns)
    expected = [matrix[i:i + h, j:j + w].reshape(-1)
                for i in range(0, layout.rows, h) for j in range(0, layout.columns, w)]
    assert torch.equal(chunks, torch.stack(expected))
    assert torch.equal(layout.join(chunks, x.shape), x)


@pytest.mark.parametrize("density", [0.03, 1 / 32, 0.5, 1.0])
def test_each_chunk_keeps_its_largest_entries_ties_to_the_lower_position(density):
    codec = ChunkTopKCodec(density)
    x = sample((96, 100), seed=1)
    x[:48, :50] = 0.5  # one chunk of ties
    layout = codec.layout(x.shape)
    positions, values = codec.select(x, layout)
    for chunk, (kept, got) in enumerate(zip(positions.tolist(), values, strict=True)):
        row = layout.split(x)[chunk].tolist()
        best = sorted(range(len(row)), key=lambda i: (-abs(row[i]), i))[:layout.kept]
        assert kept == sorted(best)
        assert got.tolist() == [row[i] for i in sorted(best)]


@pytest.mark.parametrize("bits", [2, 4])
def test_values_take_the_mean_of_their_bin_around_the_shift(bits):
    codec = ChunkTopKCodec(0.1, bits)
    values = sample((400,), seed=2) + 0.3
    codes, table = codec.quantize(values)
    v = values.tolist()
    shift = sum(v) / len(v)
    centred = [x - shift for x in v]
    sigma = math.sqrt(sum(c * c for c in centred) / (len(v) - 1))
    scale = 6 * sigma / 2**bits
    expected = [min(2**bits - 1, max(0, round(c / scale + 2**bits // 2))) for c in centred]
    assert codes.tolist() == expected
    for b in range(2**bits):
        members = [c for c, code in zip(centred, expected, strict=True) if code == b]
        assert table[1 + b].item() == pytest.approx(sum(members) / len(members) if members
                                                    else 0.0, rel=1e-5, abs=1e-7)
    assert table[0].item() == pytest.approx(shift, rel=1e-5)
    assert torch.equal(codec.dequantize(codes, table), table[1:][codes] + table[0])


def test_a_non_finite_tensor_encodes_and_decodes_as_not_finite():
    # A diverged replica's Δ_r travels too (the merge leaves it out): no crash, no finite lie.
    codec = ChunkTopKCodec(0.25, 2)
    x = sample((8, 8))
    x[2, 3] = float("nan")
    x[5, 5] = float("inf")
    wire = codec.encode([x], torch.device("cpu"))
    got = codec.decode(wire, [x.shape])[0]
    assert not torch.isfinite(got).all()
    assert torch.equal(got.isnan(), codec.roundtrip(x).isnan())


def test_kept_values_of_one_magnitude_come_back_exactly():
    # Kept values of one magnitude: sigma 0, one bin, its mean the shift: exact.
    codec = ChunkTopKCodec(1.0, 2)
    x = torch.full((8, 8), -0.375)
    assert torch.equal(codec.roundtrip(x), x)
    zero = torch.zeros(5, 3)
    assert torch.equal(codec.roundtrip(zero), zero)


@pytest.mark.parametrize("bits", [2, 4])
@pytest.mark.parametrize("density", [0.01, 0.03, 0.25])
def test_the_wire_decodes_to_the_roundtrip_bit_for_bit_in_the_bytes_elements_says(bits,
                                                                                   density):
    codec = ChunkTopKCodec(density, bits)
    tensors = [sample(shape, seed=i) for i, shape in enumerate(SHAPES)]
    wire = codec.encode(tensors, torch.device("cpu"))
    assert wire.dtype == torch.uint8
    assert wire.numel() == sum(codec.elements(t.shape) for t in tensors)
    decoded = codec.decode(wire, [t.shape for t in tensors])
    for tensor, got in zip(tensors, decoded, strict=True):
        assert got.shape == tensor.shape and got.dtype == torch.float32
        assert torch.equal(got, codec.roundtrip(tensor))
        layout = codec.layout(tensor.shape)
        # Zeros wherever nothing was kept: at most `kept` entries of each chunk are set.
        assert ((layout.split(got) != 0).sum(dim=1) <= layout.kept).all()


def test_a_kept_entry_takes_14_bits_73x_fewer_bytes_than_float32_at_1_in_32():
    shape = torch.Size((4096, 4096))
    dense = shape.numel() * 4
    assert dense / ChunkTopKCodec(128 / 4096, 2).elements(shape) == pytest.approx(73.1, abs=0.1)
    assert dense / ChunkTopKCodec(64 / 4096, 2).elements(shape) == pytest.approx(146.3, abs=0.1)
    assert dense / ChunkTopKCodec(128 / 4096, 4).elements(shape) == pytest.approx(64.0, abs=0.1)


@pytest.mark.parametrize(("density", "bits", "message"), [
    (0.0, 2, r"density must be in \(0, 1\].*got 0.0"),
    (1.5, 2, r"density must be in \(0, 1\].*got 1.5"),
    (float("nan"), 2, r"density must be in \(0, 1\].*got nan"),
    (0.03, 3, "bits must be one of 2, 4; got 3")])
def test_impossible_settings_are_refused(density, bits, message):
    with pytest.raises(ValueError, match=message):
        ChunkTopKCodec(density, bits)
    with pytest.raises(ValueError, match="no entries"):
        ChunkTopKCodec(0.03).layout(torch.Size((0, 4)))
