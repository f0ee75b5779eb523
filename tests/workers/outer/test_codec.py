"""The wire codecs of outer.comm_dtype: casts, and row-wise int8 / float8 quantisation."""

from __future__ import annotations

import pytest
import torch

from isoloco_ray.workers.outer.codec import CastCodec, RowQuantCodec, codec_for


def sample(shape: tuple[int, ...], seed: int = 0) -> torch.Tensor:
    """Rows of very different ranges, one all-zero row: what row-wise scales are for."""
    generator = torch.Generator().manual_seed(seed)
    x = torch.randn(shape, generator=generator)
    if len(shape) >= 2:
        x = x * torch.logspace(-4, 2, shape[0]).view(-1, *[1] * (len(shape) - 1))
        x[1] = 0.0
    return x


@pytest.mark.parametrize("shape", [(16, 40), (7,), (3, 4, 5)])
def test_int8_rounds_each_row_to_its_own_scale(shape):
    codec = RowQuantCodec("int8")
    x = sample(shape)
    rows = x.reshape(shape[0] if len(shape) > 1 else 1, -1)
    scale = rows.abs().amax(dim=1, keepdim=True) / 127
    got = codec.roundtrip(x).reshape(rows.shape)
    # Round to the nearest of 255 levels: at most half a step off, the row's maximum kept.
    assert ((got - rows).abs() <= scale / 2 * (1 + 1e-6) + 1e-30).all()
    top = rows.abs().argmax(dim=1)
    torch.testing.assert_close(got.gather(1, top[:, None]), rows.gather(1, top[:, None]))
    if len(shape) >= 2:
        assert torch.equal(got[1], torch.zeros_like(got[1]))  # an all-zero row stays zero


def test_float8_keeps_about_four_significant_bits_per_entry():
    codec = RowQuantCodec("float8")
    x = sample((16, 40))
    got = codec.roundtrip(x)
    scale = x.abs().amax(dim=1, keepdim=True) / 448
    # e4m3: 3 stored mantissa bits (relative error <= 2^-4); below 2^-6 of the scale it is
    # subnormal, in steps of 2^-9 of the scale.
    bound = torch.maximum(x.abs() * 2.0**-4, scale * 2.0**-10)
    assert ((got - x).abs() <= bound * (1 + 1e-6)).all()
    assert torch.equal(got[1], torch.zeros_like(got[1]))


@pytest.mark.parametrize("kind", ["int8", "float8"])
def test_encoded_tensors_decode_to_their_roundtrip_and_take_a_byte_per_entry(kind):
    codec = codec_for(kind)
    tensors = [sample((16, 40), 1), sample((7,), 2), sample((3, 4, 5), 3)]
    flat = codec.encode(tensors, torch.device("cpu"))
    assert flat.dtype == torch.uint8
    assert flat.numel() == sum(codec.elements(t.shape) for t in tensors) == \
        (16 * 40 + 16 * 4) + (7 + 4) + (60 + 3 * 4)
    for decoded, tensor in zip(codec.decode(flat, [t.shape for t in tensors]), tensors):
        assert decoded.dtype == torch.float32 and decoded.shape == tensor.shape
        assert torch.equal(decoded, codec.roundtrip(tensor))  # what error feedback assumes


def test_cast_codecs_are_the_cast():
    x = sample((16, 40))
    assert codec_for("float32") == CastCodec(torch.float32)
    assert torch.equal(codec_for("float32").roundtrip(x), x)
    assert torch.equal(codec_for("bfloat16").roundtrip(x), x.bfloat16().float())
    with pytest.raises(ValueError, match="use one of float32, bfloat16, int8, float8, int2, int4"):
        codec_for("int3")


def test_sparselocos_wire_needs_topk_and_every_worker_merging_a_mean():
    from isoloco_ray.config import load_config
    from isoloco_ray.workers.outer.chunk_topk_codec import ChunkTopKCodec

    assert codec_for("int2", 0.03) == ChunkTopKCodec(0.03, 2)
    assert codec_for("int4", 0.01) == ChunkTopKCodec(0.01, 4)
    with pytest.raises(ValueError, match="int2 sends the largest entries of each chunk: set "
                                         "outer.topk"):
        codec_for("int2")
    with pytest.raises(Exception, match="outer.comm_dtype=int2 sends the largest entries of "
                                        "each 64x64 chunk: set outer.topk"):
        load_config(["--outer.comm_dtype=int2", "--outer.placement=replicated"])
    with pytest.raises(Exception, match="diloco merges the mean, which every worker merges "
                                        "for less .SparseLoCo.: set outer.placement=replicated"):
        load_config(["--outer.comm_dtype=int4", "--outer.topk=0.03"])
    # The merges of every Δ_r may have owners merge (exchange.OwnersMerge).
    assert load_config(["--outer.strategy=isocts", "--outer.comm_dtype=int4",
                        "--outer.topk=0.03"]).outer.placement == "sharded"
    # Over a quorum too (tests/workers/test_quorum.py).
    assert load_config(["--outer.comm_dtype=int2", "--outer.topk=0.03",
                        "--outer.placement=replicated", "--scaling.fault_tolerance=replica",
                        "--scaling.replicas=3", "--scaling.replicas_per_worker=1"]).outer.topk
    cfg = load_config(["--outer.strategy=diloco_sgd", "--outer.lr=1", "--outer.comm_dtype=int2",
                       "--outer.topk=0.03", "--outer.placement=replicated",
                       "--outer.error_feedback=true", "--outer.error_decay=0.95"])
    assert cfg.outer.lossy_wire


def test_error_feedback_needs_a_lossy_dtype():
    from isoloco_ray.config import load_config

    with pytest.raises(Exception, match="without outer.topk loses nothing"):
        load_config(["--outer.error_feedback=true"])
    with pytest.raises(Exception, match="no effect with adamw_ddp"):
        load_config(["--outer.strategy=adamw_ddp", "--outer.comm_dtype=int8",
                     "--outer.error_feedback=true"])
    assert load_config(["--outer.comm_dtype=float8", "--outer.error_feedback=true"])
    with pytest.raises(Exception, match=r"outer.error_decay \(0.9\) decays error feedback's "
                       "residuals: set outer.error_feedback=true"):
        load_config(["--outer.comm_dtype=int8", "--outer.error_decay=0.9"])
    for bad in ("0", "1.5", "nan", "inf"):
        with pytest.raises(Exception, match="error_decay"):
            load_config(["--outer.comm_dtype=int8", "--outer.error_feedback=true",
                         f"--outer.error_decay={bad}"])
    assert load_config(["--outer.comm_dtype=int8", "--outer.error_feedback=true",
                        "--outer.error_decay=0.95"]).outer.error_decay == 0.95


@pytest.mark.parametrize("values", ["float32", "int8"])
def test_topk_keeps_each_rows_largest_entries(values):
    codec = codec_for(values, topk=0.25)
    x = sample((16, 40))
    x[3, :] = 1.0  # all tied: the lowest indices are kept
    kept_values, indices = codec.select(x)
    assert indices.shape == (16, 10)  # ceil(0.25 * 40) per row
    for row in range(16):
        threshold = x[row].abs().sort(descending=True).values[9]
        assert (x[row, indices[row].long()].abs() >= threshold).all()  # the 10 largest
    assert indices[3].tolist() == list(range(10))
    got = codec.roundtrip(x)
    dropped = torch.ones_like(x, dtype=torch.bool).scatter_(1, indices.long(), False)
    assert (got[dropped] == 0).all()
    want = codec_for(values).roundtrip(kept_values)  # the kept values through comm_dtype
    assert torch.equal(got.gather(1, indices.long()), want)
    value_bytes, row_bytes = (4, 0) if values == "float32" else (1, 4)
    flat = codec.encode([x, sample((7,))], torch.device("cpu"))
    assert flat.numel() == (16 * (10 * (value_bytes + 4) + row_bytes)
                            + 1 * (2 * (value_bytes + 4) + row_bytes))  # (7,): one row, k = 2
    decoded = codec.decode(flat, [x.shape, torch.Size((7,))])
    assert torch.equal(decoded[0], got) and torch.equal(decoded[1], codec.roundtrip(sample((7,))))
