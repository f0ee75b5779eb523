"""The exchange of an outer step (workers/outer/exchange.py): chosen once from the route, and
the quorum's flat wire, which must carry exactly what the codec carries."""

from __future__ import annotations

import pytest
import torch

from isoloco_ray.config import load_config
from isoloco_ray.strategies import OuterMerge, Route
from isoloco_ray.workers.outer.exchange import EveryoneMerges, Exchange, OwnersMerge

SHAPES = {"w": torch.Size([70, 96]), "norm": torch.Size([96]), "odd": torch.Size([5, 3])}


def exchange_of(flags: list[str]) -> Exchange:
    outer = load_config(flags + ["--scaling.replicas=4"]).outer
    merge = OuterMerge.of(outer)
    return Exchange.choose(outer, merge, Route.choose(outer, merge), seed=0)


@pytest.mark.parametrize("flags, kind", [
    (["--outer.strategy=diloco"], EveryoneMerges),  # float32 sums: all-reduced
    (["--outer.strategy=tsv", "--outer.placement=replicated"], EveryoneMerges),
    (["--outer.strategy=isoc"], OwnersMerge),
    (["--outer.strategy=tsv", "--outer.placement=rank0"], OwnersMerge),
    (["--outer.strategy=sparseloco"], EveryoneMerges),
])
def test_the_exchange_is_the_routes(flags, kind):
    assert type(exchange_of(flags)) is kind


@pytest.mark.parametrize("flags", [
    ["--outer.strategy=diloco"],
    ["--outer.strategy=tsv", "--outer.comm_dtype=bfloat16"],
    ["--outer.strategy=tsv", "--outer.comm_dtype=int8"],
    ["--outer.strategy=isoc", "--outer.comm_dtype=float8", "--outer.topk=0.3"],
    ["--outer.strategy=sparseloco"],
    ["--outer.strategy=ties", "--outer.comm_dtype=int4", "--outer.topk=0.1",
     "--outer.placement=replicated"],
])
def test_the_quorum_wire_carries_what_the_codec_carries(flags):
    """Every copy (each hosted Δ_r) of every tensor, through one flat float32 tensor and back:
    equal to the codec's own roundtrip bit for bit (the values themselves on float32)."""
    exchange = exchange_of(flags)
    generator = torch.Generator().manual_seed(0)
    payload = {name: [torch.randn(shape, generator=generator) for _ in range(2)]
               for name, shape in SHAPES.items()}
    names = ["odd", "w", "norm"]  # the order of the caller's parameters, not the payload's
    flat = exchange.to_quorum_wire(payload, names)
    assert flat.dtype == torch.float32 and flat.dim() == 1
    back = exchange.from_quorum_wire(flat, [SHAPES[name] for name in names] * 2)
    sent = [payload[name][copy] for copy in range(2) for name in names]
    codec = exchange.codec
    expected = codec.decode(codec.encode(sent, torch.device("cpu")), [t.shape for t in sent])
    for got, want, original in zip(back, expected, sent, strict=True):
        assert torch.equal(got, want.float())
        if not exchange.outer.lossy_wire:
            assert torch.equal(got, original)
