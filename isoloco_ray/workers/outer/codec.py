"""How the outer sync's tensors are written on the wire (`outer.comm_dtype`), and read back.

- `float32`, `bfloat16`: a cast (`CastCodec`); what arrives is the cast values.
- `int8`, `float8`: row-wise quantisation to one byte per entry plus one float32 scale per
  row (`RowQuantCodec`). A tensor's rows are its first dimension (a vector is one row). Per
  row, with a = max |x| (scale s = 1 for an all-zero row):
    int8:   s = a / 127, q = round(x / s) in [-127, 127],  x̂ = q · s
    float8: s = a / 448, q = float8_e4m3fn(x / s) (round to nearest even; 448 is e4m3's
            largest finite value), x̂ = float32(q) · s
  so the largest entry of a row is exact up to float32 rounding and every row keeps its own
  range. float8 is a cast in torch on every device (on CPU it is done in software). What
  arrives is x̂ in float32: merges run on dequantised values, as they run on cast ones.
- `outer.topk = f` (pseudo-gradients only; updates stay dense): each row keeps its
  ceil(f · columns) entries of largest magnitude, as values (in comm_dtype) and int32 column
  indices (`TopKCodec`); the rest arrive as zeros.
- `int2`, `int4` (with `outer.topk = f`): SparseLoCo's wire (chunk_topk_codec.py): the
  largest f of each 64 x 64 chunk's entries, 12-bit positions and 2- or 4-bit statistical
  value codes, for payloads gathered by every worker (outer.placement=replicated: no update
  travels).

A codec is pure tensor math (no collectives): `roundtrip(x)` is exactly what the receiver
decodes, which error feedback (payload.py) needs to know what was lost.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from isoloco_ray.strategies import WIRE_FORMATS
from isoloco_ray.workers.outer.chunk_topk_codec import ChunkTopKCodec
from isoloco_ray.workers.parallel.collectives import flatten, unflatten

# Each of strategies.WIRE_FORMATS, by kind: a cast to a torch dtype, or row-wise codes whose
# largest value a row's max maps to (checked below: one implementation per format).
CAST_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}
QUANTIZED = {"int8": 127.0, "float8": 448.0}
CHUNKED_BITS = {"int2": 2, "int4": 4}
if ({name for name, spec in WIRE_FORMATS.items() if spec.per_replica and not spec.chunked}
        != set(QUANTIZED)
        or {name for name, spec in WIRE_FORMATS.items() if spec.chunked} != set(CHUNKED_BITS)
        or {name for name, spec in WIRE_FORMATS.items() if not spec.per_replica}
        != set(CAST_DTYPES)):
    raise ImportError("workers/outer/codec.py implements other wire formats than "
                      f"strategies.WIRE_FORMATS lists ({', '.join(WIRE_FORMATS)})")
_SCALE = torch.float32
_INDEX = torch.int32


@dataclass(frozen=True)
class CastCodec:
    """Tensors travel cast to `dtype`."""

    dtype: torch.dtype

    @property
    def wire_dtype(self) -> torch.dtype:
        return self.dtype

    def elements(self, shape: torch.Size) -> int:
        """Elements of `wire_dtype` one tensor of `shape` takes on the wire."""
        return shape.numel()

    def encode(self, tensors: Sequence[torch.Tensor], device: torch.device) -> torch.Tensor:
        """The tensors, one after another, as one 1-D wire tensor."""
        return flatten(tensors, self.dtype, device)

    def decode(self, flat: torch.Tensor, shapes: Sequence[torch.Size]) -> list[torch.Tensor]:
        """Views of `flat` with the given shapes, in the wire dtype (the inverse of encode)."""
        return unflatten(flat, shapes)

    def roundtrip(self, tensor: torch.Tensor) -> torch.Tensor:
        """What a receiver decodes of `tensor`, in float32."""
        return tensor.to(self.dtype).float()


@dataclass(frozen=True)
class RowQuantCodec:
    """Tensors travel as one byte per entry plus one float32 scale per row (bytes on the
    wire: the codes, then the scales)."""

    kind: str  # "int8" or "float8"

    @property
    def wire_dtype(self) -> torch.dtype:
        return torch.uint8

    def elements(self, shape: torch.Size) -> int:
        return shape.numel() + _rows(shape) * _SCALE.itemsize

    def encode(self, tensors: Sequence[torch.Tensor], device: torch.device) -> torch.Tensor:
        return _concat_bytes([part for t in tensors for part in self.quantize(t)], device)

    def decode(self, flat: torch.Tensor, shapes: Sequence[torch.Size]) -> list[torch.Tensor]:
        out, offset = [], 0
        for shape in shapes:
            count, rows = shape.numel(), _rows(shape)
            codes = flat[offset: offset + count]
            scales = flat[offset + count: offset + count + rows * _SCALE.itemsize]
            # A copy: float32 views need 4-byte-aligned offsets, which codes of odd sizes break.
            out.append(self.dequantize(codes.view(self._code_dtype).view(rows, -1),
                                       scales.clone().view(_SCALE)).view(shape))
            offset += count + rows * _SCALE.itemsize
        return out

    def roundtrip(self, tensor: torch.Tensor) -> torch.Tensor:
        codes, scales = self.quantize(tensor)
        return self.dequantize(codes, scales).view(tensor.shape)

    def quantize(self, tensor: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(codes of shape (rows, columns), float32 scale per row)."""
        rows = tensor.detach().reshape(_rows(tensor.shape), -1).float()
        top = rows.abs().amax(dim=1)
        scales = torch.where(top > 0, top / QUANTIZED[self.kind], torch.ones_like(top))
        scaled = rows / scales[:, None]
        if self.kind == "int8":
            codes = scaled.round_().clamp_(-127, 127).to(torch.int8)
        else:
            codes = scaled.clamp_(-448, 448).to(torch.float8_e4m3fn)
        return codes, scales

    def dequantize(self, codes: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
        """float32 rows of `codes` (rows, columns) times their scales."""
        return codes.float() * scales[:, None]

    @property
    def _code_dtype(self) -> torch.dtype:
        return torch.int8 if self.kind == "int8" else torch.float8_e4m3fn


@dataclass(frozen=True)
class TopKCodec:
    """Each row keeps only its k = ceil(fraction · columns) entries of largest magnitude: their
    values (written by `values`, another codec, as a (rows, k) tensor) and their int32
    column indices; decoding puts them back among zeros. Ties go to the lower index."""

    fraction: float
    values: CastCodec | RowQuantCodec

    @property
    def wire_dtype(self) -> torch.dtype:
        return torch.uint8

    def kept(self, shape: torch.Size) -> int:
        """Entries each row keeps."""
        columns = shape.numel() // _rows(shape)
        return max(1, min(columns, math.ceil(self.fraction * columns)))

    def elements(self, shape: torch.Size) -> int:
        rows, k = _rows(shape), self.kept(shape)
        values = self.values.elements(torch.Size((rows, k))) * self.values.wire_dtype.itemsize
        return values + rows * k * _INDEX.itemsize

    def encode(self, tensors: Sequence[torch.Tensor], device: torch.device) -> torch.Tensor:
        parts = []
        for tensor in tensors:
            values, indices = self.select(tensor)
            parts += [self.values.encode([values], device), indices]
        return _concat_bytes(parts, device)

    def decode(self, flat: torch.Tensor, shapes: Sequence[torch.Size]) -> list[torch.Tensor]:
        out, offset = [], 0
        for shape in shapes:
            rows, k = _rows(shape), self.kept(shape)
            kept = torch.Size((rows, k))
            size = self.values.elements(kept) * self.values.wire_dtype.itemsize
            # Copies: views of another dtype need aligned offsets.
            wire = flat[offset: offset + size].clone().view(self.values.wire_dtype)
            values = self.values.decode(wire, [kept])[0].float()
            offset += size
            indices = flat[offset: offset + rows * k * _INDEX.itemsize].clone().view(_INDEX)
            offset += rows * k * _INDEX.itemsize
            dense = torch.zeros(rows, shape.numel() // rows, device=flat.device)
            dense.scatter_(1, indices.view(rows, k).long(), values)
            out.append(dense.view(shape))
        return out

    def roundtrip(self, tensor: torch.Tensor) -> torch.Tensor:
        values, indices = self.select(tensor)
        dense = torch.zeros(indices.shape[0], tensor.numel() // indices.shape[0],
                            device=tensor.device)
        dense.scatter_(1, indices.long(), self.values.roundtrip(values))
        return dense.view(tensor.shape)

    def select(self, tensor: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(the kept values, (rows, k) float32, and their int32 column indices, ascending)."""
        rows = tensor.detach().reshape(_rows(tensor.shape), -1).float()
        # A stable sort by magnitude, largest first: equal magnitudes keep the lower index.
        order = rows.abs().argsort(dim=1, descending=True, stable=True)
        indices = order[:, :self.kept(tensor.shape)].sort(dim=1).values
        return rows.gather(1, indices), indices.to(_INDEX)


Codec = CastCodec | RowQuantCodec | TopKCodec | ChunkTopKCodec


def codec_for(comm_dtype: str, topk: float | None = None) -> Codec:
    """The codec of an `outer.comm_dtype` (and `outer.topk`: sparse rows of it, or for int2
    and int4 the share of each chunk kept)."""
    if comm_dtype not in WIRE_FORMATS:
        raise ValueError(f"outer.comm_dtype {comm_dtype!r}: use one of "
                         f"{', '.join(WIRE_FORMATS)}")
    if WIRE_FORMATS[comm_dtype].chunked:
        if topk is None:
            raise ValueError(f"outer.comm_dtype={comm_dtype} sends the largest entries of each "
                             "chunk: set outer.topk, the share kept (SparseLoCo: 0.01-0.03)")
        return ChunkTopKCodec(topk, CHUNKED_BITS[comm_dtype])
    codec: CastCodec | RowQuantCodec = (RowQuantCodec(comm_dtype)
                                        if WIRE_FORMATS[comm_dtype].per_replica
                                        else CastCodec(CAST_DTYPES[comm_dtype]))
    return codec if topk is None else TopKCodec(topk, codec)


def wire_bytes(codec: Codec, shapes: Sequence[torch.Size]) -> int:
    """Bytes of tensors of `shapes`, one after another, on `codec`'s wire."""
    return sum(codec.elements(shape) for shape in shapes) * codec.wire_dtype.itemsize


def _concat_bytes(parts: Sequence[torch.Tensor], device: torch.device) -> torch.Tensor:
    """The bytes of `parts`, one after another, as a 1-D uint8 tensor."""
    if not parts:
        return torch.empty(0, dtype=torch.uint8, device=device)
    return torch.cat([part.reshape(-1).view(torch.uint8) for part in parts])


def _rows(shape: torch.Size) -> int:
    """Rows of a tensor of `shape`: its first dimension; a vector or a scalar is one row."""
    return shape[0] if len(shape) >= 2 else 1
