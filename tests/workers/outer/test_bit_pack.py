"""Codes of a few bits packed into bytes (workers/outer/bit_pack.py)."""

from __future__ import annotations

import pytest
import torch

from isoloco_ray.workers.outer.bit_pack import pack_bits, packed_bytes, unpack_bits


@pytest.mark.parametrize("bits", [1, 2, 3, 4, 7, 8, 12, 13, 16, 30])
@pytest.mark.parametrize("count", [0, 1, 5, 8, 4095, 4097])
def test_every_width_and_count_round_trips_in_the_fewest_bytes(bits, count):
    generator = torch.Generator().manual_seed(bits * 10_000 + count)
    codes = torch.randint(0, 1 << bits, (count,), generator=generator)
    if count:  # both ends of the range are there
        codes[0], codes[-1] = 0, (1 << bits) - 1
    packed = pack_bits(codes, bits)
    assert packed.dtype == torch.uint8 and packed.numel() == packed_bytes(count, bits)
    assert packed.numel() == -(-count * bits // 8)
    assert torch.equal(unpack_bits(packed, bits, count), codes)


def test_the_layout_is_least_significant_bit_first_with_no_gaps():
    # 2-bit codes 1, 2, 3, 0 -> bits 10 01 11 00 -> 0b00_11_10_01; then 3 -> 0b11.
    assert pack_bits(torch.tensor([1, 2, 3, 0, 3]), 2).tolist() == [0b00111001, 0b11]
    # 12-bit codes straddle bytes: 0xABC, 0x123 -> bytes BC, 3A, 12.
    assert pack_bits(torch.tensor([0xABC, 0x123]), 12).tolist() == [0xBC, 0x3A, 0x12]


def test_codes_out_of_range_and_bad_widths_are_refused():
    with pytest.raises(ValueError, match=r"codes must lie in \[0, 4\) for 2 bits; got \[0, 4\]"):
        pack_bits(torch.tensor([0, 4]), 2)
    with pytest.raises(ValueError, match="codes must lie in"):
        pack_bits(torch.tensor([-1]), 2)
    with pytest.raises(ValueError, match="bits must be between 1 and 30; got 0"):
        pack_bits(torch.tensor([0]), 0)
    with pytest.raises(ValueError, match="3 codes of 12 bits take 5 bytes, not 4"):
        unpack_bits(torch.zeros(4, dtype=torch.uint8), 12, 3)
