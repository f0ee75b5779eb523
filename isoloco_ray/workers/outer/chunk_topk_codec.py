"""SparseLoCo's wire (Sarfi et al., arXiv 2508.15706; issue 49, stage 1): each tensor as the
largest entries of each chunk, their positions in the chunk in 12 bits and their values in 2
(or 4) bits: `outer.comm_dtype` int2 / int4 with `outer.topk` the density (codec.py).

- **Chunks.** A matrix is cut into tiles of h x w, h the largest divisor of its rows that is at
  most 64 and w the same of its columns (64 x 64 = 4096 entries for the usual shapes); a vector
  into runs of the largest divisor of its length at most 64; nothing is padded. (A tensor of
  more dimensions is read as a matrix of its first dimension by the rest.)
- **Top-k.** Each chunk keeps its k = max(1, round(density x chunk size)) entries of largest
  magnitude (ties: the lower position), at most the chunk's size; the rest decode as zeros.
- **Statistical quantisation, per tensor** (of the kept values v, n of them): shift = mean(v),
  c = v - shift, sigma = the unbiased standard deviation of c, scale = 6 sigma / B for B = 2**bits
  bins (1.0 where that is 0 or not finite); each value's code is round(c / scale + B // 2)
  clamped to [0, B), and it decodes as the mean of the c in its bin (0 for an empty bin) plus
  shift. So the bins are 1.5 sigma wide for 2 bits, and a tensor sends B + 1 float32 numbers.
- **On the wire**, per tensor: the shift and the B bin means (float32), then every kept
  position (ceil(log2 chunk size) bits each: 12 for 4096) and every code (`bits` each), packed
  (bit_pack.py); chunks in order, each chunk's positions ascending. The size depends only on
  the shape, so every replica's payload of a tensor is as long as every other's.

At density 1/32 (128 of 4096) and 2 bits a kept entry takes 14 bits: 73x fewer bytes than
float32 (146x at 64 of 4096), as in the paper. `roundtrip(x)` is exactly what a receiver
decodes, which error feedback needs to know what was lost.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from isoloco_ray.workers.outer.bit_pack import pack_bits, packed_bytes, unpack_bits

CHUNK_SIDE = 64  # the largest side of a chunk
RANGE_SIGMAS = 6.0  # the B bins span this many standard deviations of the kept values
BITS = (2, 4)  # the value codes offered
_STATS = torch.float32


def chunk_side(size: int, side: int = CHUNK_SIDE) -> int:
    """The largest divisor of `size` that is at most `side`."""
    return next(d for d in range(min(size, side), 0, -1) if size % d == 0)


@dataclass(frozen=True)
class ChunkLayout:
    """How one shape is cut into chunks: `chunks` of `size` entries each, `kept` kept each."""

    rows: int
    columns: int
    tile: tuple[int, int]  # (h, w): a vector's runs are 1 x w
    kept: int

    @property
    def size(self) -> int:
        return self.tile[0] * self.tile[1]

    @property
    def chunks(self) -> int:
        return (self.rows // self.tile[0]) * (self.columns // self.tile[1])

    @property
    def position_bits(self) -> int:
        """Bits of a position within a chunk."""
        return max(1, math.ceil(math.log2(self.size)))

    def split(self, tensor: torch.Tensor) -> torch.Tensor:
        """`tensor` as (chunks, size): chunk by chunk, each row-major."""
        h, w = self.tile
        grid = tensor.reshape(self.rows // h, h, self.columns // w, w)
        return grid.permute(0, 2, 1, 3).reshape(self.chunks, self.size)

    def join(self, chunks: torch.Tensor, shape: torch.Size) -> torch.Tensor:
        """The inverse of `split`, shaped `shape`."""
        h, w = self.tile
        grid = chunks.reshape(self.rows // h, self.columns // w, h, w)
        return grid.permute(0, 2, 1, 3).reshape(shape)


@dataclass(frozen=True)
class ChunkTopKCodec:
    """Chunk-wise top-k with `bits`-bit statistical value codes (see the module's docstring).
    ValueError for a density outside (0, 1] or bits other than 2 and 4."""

    density: float
    bits: int = 2

    def __post_init__(self) -> None:
        if not (isinstance(self.density, int | float) and math.isfinite(self.density)
                and 0 < self.density <= 1):
            raise ValueError(f"density must be in (0, 1] (the share of each chunk's entries "
                             f"sent: SparseLoCo uses 0.01-0.03); got {self.density!r}")
        if self.bits not in BITS:
            raise ValueError(f"bits must be one of {', '.join(map(str, BITS))}; got "
                             f"{self.bits!r}")

    @property
    def wire_dtype(self) -> torch.dtype:
        return torch.uint8

    @property
    def bins(self) -> int:
        return 1 << self.bits

    def layout(self, shape: torch.Size) -> ChunkLayout:
        """The chunks of a tensor of `shape`."""
        numel = shape.numel()
        if numel == 0:
            raise ValueError("a tensor with no entries has nothing to send")
        rows = shape[0] if len(shape) >= 2 else 1
        columns = numel // rows
        tile = (chunk_side(rows), chunk_side(columns))
        size = tile[0] * tile[1]
        return ChunkLayout(rows, columns, tile,
                           kept=min(size, max(1, round(self.density * size))))

    def elements(self, shape: torch.Size) -> int:
        """Bytes a tensor of `shape` takes on the wire."""
        layout = self.layout(shape)
        count = layout.chunks * layout.kept
        return ((self.bins + 1) * _STATS.itemsize + packed_bytes(count, layout.position_bits)
                + packed_bytes(count, self.bits))

    def encode(self, tensors: Sequence[torch.Tensor], device: torch.device) -> torch.Tensor:
        """The tensors, one after another, as one 1-D uint8 wire tensor on `device`."""
        parts = []
        for tensor in tensors:
            layout = self.layout(tensor.shape)
            positions, values = self.select(tensor, layout)
            codes, table = self.quantize(values)
            parts += [table.to(device).view(torch.uint8),
                      pack_bits(positions.reshape(-1), layout.position_bits).to(device),
                      pack_bits(codes, self.bits).to(device)]
        if not parts:
            return torch.empty(0, dtype=torch.uint8, device=device)
        return torch.cat(parts)

    def decode(self, flat: torch.Tensor, shapes: Sequence[torch.Size]) -> list[torch.Tensor]:
        """float32 tensors of `shapes` from `flat` (the inverse of encode; zeros where nothing
        was kept)."""
        out, offset = [], 0
        for shape in shapes:
            layout = self.layout(shape)
            count = layout.chunks * layout.kept
            stats = (self.bins + 1) * _STATS.itemsize
            # A copy: a float32 view needs a 4-byte-aligned offset.
            table = flat[offset: offset + stats].clone().view(_STATS)
            offset += stats
            size = packed_bytes(count, layout.position_bits)
            positions = unpack_bits(flat[offset: offset + size], layout.position_bits, count)
            offset += size
            size = packed_bytes(count, self.bits)
            codes = unpack_bits(flat[offset: offset + size], self.bits, count)
            offset += size
            values = self.dequantize(codes, table)
            out.append(self._scatter(positions.view(layout.chunks, layout.kept),
                                     values.view(layout.chunks, layout.kept), layout, shape))
        return out

    def roundtrip(self, tensor: torch.Tensor) -> torch.Tensor:
        """What a receiver decodes of `tensor`, in float32."""
        layout = self.layout(tensor.shape)
        positions, values = self.select(tensor, layout)
        codes, table = self.quantize(values)
        return self._scatter(positions, self.dequantize(codes, table).view(values.shape),
                             layout, tensor.shape)

    def select(self, tensor: torch.Tensor, layout: ChunkLayout
               ) -> tuple[torch.Tensor, torch.Tensor]:
        """(each chunk's kept positions, ascending, (chunks, kept) int64, and their float32
        values)."""
        chunks = layout.split(tensor.detach().float())
        # A stable sort by magnitude, largest first: equal magnitudes keep the lower position,
        # so every device and every run keeps the same entries.
        order = chunks.abs().argsort(dim=1, descending=True, stable=True)
        positions = order[:, :layout.kept].sort(dim=1).values
        return positions, chunks.gather(1, positions)

    def quantize(self, values: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(each value's code in [0, bins), int64, flat; the table: shift, then each bin's
        mean of the centred values, float32)."""
        flat = values.reshape(-1).float()
        shift = flat.mean()
        centred = flat - shift
        sigma = (centred.norm() / math.sqrt(flat.numel() - 1) if flat.numel() > 1
                 else torch.zeros((), device=flat.device))
        scale = RANGE_SIGMAS * sigma / self.bins
        # 1.0 where the spread is 0 or not finite, chosen on the device (no host sync per
        # tensor on a GPU).
        scale = torch.where(torch.isfinite(scale) & (scale > 0), scale,
                            torch.ones((), device=flat.device))
        # A non-finite value (a diverged replica's Δ_r, which the merge leaves out) takes the
        # middle code; its table is not finite, and neither is what it decodes to.
        position = torch.nan_to_num(centred / scale + self.bins // 2, nan=self.bins // 2)
        codes = position.round().clamp(0, self.bins - 1).long()
        sums = torch.zeros(self.bins, device=flat.device).index_add_(0, codes, centred)
        counts = torch.bincount(codes, minlength=self.bins).float()
        means = sums / counts.clamp(min=1)  # an empty bin's sum is 0
        return codes, torch.cat([shift.reshape(1), means]).to(_STATS)

    def dequantize(self, codes: torch.Tensor, table: torch.Tensor) -> torch.Tensor:
        """float32 values of `codes` under `table` (quantize's)."""
        return table[1:][codes] + table[0]

    def _scatter(self, positions: torch.Tensor, values: torch.Tensor, layout: ChunkLayout,
                 shape: torch.Size) -> torch.Tensor:
        dense = torch.zeros(layout.chunks, layout.size, device=values.device)
        dense.scatter_(1, positions, values)
        return layout.join(dense, shape)
