"""Integers of a few bits each, packed into bytes and back: the index and value codes of a
sparse wire (2-bit values, 12-bit positions in a chunk of 4096) take their bits on the wire,
not a byte or an int32 each.

Codes are packed least significant bit first, one code after another with no padding between
them; the last byte is padded with zero bits. Pure tensor math on the codes' device: no Python
loop over entries.
"""

from __future__ import annotations

import math

import torch

# The widest code packed: int32 intermediates hold it.
MAX_BITS = 30


def packed_bytes(count: int, bits: int) -> int:
    """Bytes that `count` codes of `bits` bits take."""
    return math.ceil(count * bits / 8)


def pack_bits(codes: torch.Tensor, bits: int) -> torch.Tensor:
    """The 1-D integer tensor `codes` (each in [0, 2**bits)) as packed_bytes(len, bits) bytes,
    a 1-D uint8 tensor on its device. ValueError for a code out of range."""
    _check_bits(bits)
    codes = codes.reshape(-1).to(torch.int32)
    if bool(((codes < 0) | (codes >= 1 << bits)).any()):  # one host sync, not two
        raise ValueError(f"pack_bits: codes must lie in [0, {1 << bits}) for {bits} bits; got "
                         f"[{int(codes.min())}, {int(codes.max())}]")
    shifts = torch.arange(bits, dtype=torch.int32, device=codes.device)
    stream = ((codes[:, None] >> shifts) & 1).to(torch.uint8).reshape(-1)
    stream = torch.nn.functional.pad(stream, (0, (-stream.numel()) % 8))
    weights = torch.tensor([1 << i for i in range(8)], dtype=torch.int32, device=codes.device)
    return (stream.view(-1, 8).to(torch.int32) * weights).sum(dim=1).to(torch.uint8)


def unpack_bits(packed: torch.Tensor, bits: int, count: int) -> torch.Tensor:
    """The `count` codes of `bits` bits that pack_bits wrote into `packed`, as int64."""
    _check_bits(bits)
    if packed.numel() != packed_bytes(count, bits):
        raise ValueError(f"unpack_bits: {count} codes of {bits} bits take "
                         f"{packed_bytes(count, bits)} bytes, not {packed.numel()}")
    shifts = torch.arange(8, dtype=torch.int32, device=packed.device)
    stream = ((packed.reshape(-1).to(torch.int32)[:, None] >> shifts) & 1).reshape(-1)
    stream = stream[:count * bits].view(count, bits)
    weights = torch.tensor([1 << i for i in range(bits)], dtype=torch.int64,
                           device=packed.device)
    return (stream.to(torch.int64) * weights).sum(dim=1)


def _check_bits(bits: int) -> None:
    if not 1 <= bits <= MAX_BITS:
        raise ValueError(f"bits must be between 1 and {MAX_BITS}; got {bits}")
