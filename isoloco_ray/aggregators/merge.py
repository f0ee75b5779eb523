"""`merge` / `merge_all`: one strategy name and its options in, merged update direction out.

The direction is what the outer optimizer then applies (docs/strategies.md): before outer
momentum and the outer learning rate.
"""

from __future__ import annotations

import functools
import importlib
import inspect
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch
from torch import Tensor

from isoloco_ray.aggregators.checks import check_choice, check_generator
from isoloco_ray.aggregators.isoc import isoc64
from isoloco_ray.aggregators.isocts import isocts64
from isoloco_ray.aggregators.linalg import mean64
from isoloco_ray.aggregators.sparsify import sparse_merge
from isoloco_ray.aggregators.tsv import tsv64
from isoloco_ray.strategies import MERGES, options_error, tsv_keep_fraction

# Inputs stacked per batched call of a spectral merge (the float64 work needs a few times more).
_BATCH_BYTES = 256 << 20

Generators = torch.Generator | Sequence[torch.Generator] | None

# The implementations the registry (strategies.MERGES) names. Spectral: the batched float64
# computation, R tensors (b, m, n) and the options in, (b, m, n) out. Elementwise: one tensor's
# R pseudo-gradients, the options and the replicas' generators in, the merged tensor out.
SpectralMerge = Callable[[Sequence[Tensor], Mapping[str, Any]], Tensor]
ElementwiseMerge = Callable[[list[Tensor], Mapping[str, Any], list[torch.Generator | None]],
                            Tensor]


def mean_merge(deltas: list[Tensor], opts: Mapping[str, Any],
               generators: list[torch.Generator | None]) -> Tensor:
    """The plain mean, in float64."""
    return mean64(deltas).to(deltas[0].dtype)


def isoc_merge(deltas: Sequence[Tensor], opts: Mapping[str, Any]) -> Tensor:
    """ISO-C of the mean."""
    return isoc64(mean64(deltas))


def isocts_merge(deltas: Sequence[Tensor], opts: Mapping[str, Any]) -> Tensor:
    """ISO-CTS of every Δ_r."""
    return isocts64(deltas, opts["common_fraction"])


def tsv_merge(deltas: Sequence[Tensor], opts: Mapping[str, Any]) -> Tensor:
    """TSV-Merge of every Δ_r."""
    return tsv64(deltas, tsv_keep_fraction(opts["keep_fraction"], len(deltas)),
                 opts["decorrelate"])


def sparse_merge_of(deltas: list[Tensor], opts: Mapping[str, Any],
                    generators: list[torch.Generator | None]) -> Tensor:
    """TIES and DARE: each Δ_r pruned, then the disjoint merge or the mean."""
    return sparse_merge(deltas, sparsity=opts["sparsity"], prune=opts["prune"],
                        prune_dim=opts["prune_dim"], rescale=opts["rescale"],
                        disjoint=opts["disjoint"], generators=generators)


@functools.cache
def implementation(strategy: str) -> Callable[..., Tensor]:
    """The function the registry names for merge `strategy` ("module:function"), imported once.
    ValueError naming the merge when it cannot be found."""
    path = MERGES[strategy].implementation
    module, _, name = path.partition(":")
    try:
        function = getattr(importlib.import_module(module), name)
    except (ImportError, AttributeError) as exc:
        raise ValueError(f"merge {strategy!r}: its implementation {path!r} (strategies.MERGES) "
                         f"cannot be loaded: {exc}") from None
    if not callable(function):
        raise ValueError(f"merge {strategy!r}: {path!r} is not a function")
    # Spectral: (stacks, options); elementwise: (deltas, options, generators).
    kind, arguments = ("spectral", 2) if MERGES[strategy].spectral else ("elementwise", 3)
    if len(inspect.signature(function).parameters) != arguments:
        raise ValueError(f"merge {strategy!r}: {path!r} must take {arguments} arguments, as a "
                         f"{kind} merge does (strategies.MergeSpec.implementation)")
    return function


def _spectral(strategy: str, opts: Mapping[str, Any]) -> Callable[[Sequence[Tensor]], Tensor]:
    """The batched float64 implementation of `strategy` with its options bound."""
    function: SpectralMerge = implementation(strategy)
    return lambda deltas: function(deltas, opts)


def resolve_options(strategy: str, options: Mapping[str, Any]) -> dict[str, Any]:
    """Check `strategy` and its `options` (its options model in strategies.MERGES, strictly:
    no strings for numbers or booleans); return every option of the strategy with defaults
    filled in (an option given as None takes its default), and `generator` for the merges that
    draw at random. Raises ValueError on an unknown strategy, an option the strategy does not
    take, or a value out of range."""
    from pydantic import ValidationError

    check_choice("strategy", strategy, tuple(MERGES))
    model = MERGES[strategy].options
    given = {key: value for key, value in options.items() if value is not None}
    generator = given.pop("generator", None) if model.draws_at_random else None
    unknown = sorted(set(given) - set(model.model_fields))
    if unknown:
        takes = ", ".join(model.model_fields) if model.model_fields else "no options"
        raise ValueError(f"option(s) {', '.join(unknown)} do not apply to strategy "
                         f"{strategy!r} (it takes: {takes})")
    try:
        opts = model.model_validate(given, strict=True).model_dump()
    except ValidationError as exc:
        raise options_error(exc) from None
    if model.draws_at_random:
        if opts["prune"] == "random" and generator is None:
            raise ValueError(f"strategy {strategy!r} with prune 'random' needs a generator "
                             "(a seeded torch.Generator, or one per replica)")
        if generator is not None:
            if not isinstance(generator, torch.Generator | Sequence):
                check_generator("generator", generator)
            for g in [generator] if isinstance(generator, torch.Generator) else generator:
                check_generator("generator", g)
        opts["generator"] = generator
    return opts


def _replica_generators(generator: Generators, replicas: int) -> list[torch.Generator | None]:
    if generator is None or isinstance(generator, torch.Generator):
        return [generator] * replicas
    gens: list[torch.Generator | None] = list(generator)
    if len(gens) != replicas:
        raise ValueError(f"generator: a sequence needs one generator per replica ({replicas}); "
                         f"got {len(gens)}")
    return gens


def _check_deltas(deltas: Sequence[Tensor] | Tensor, name: str = "") -> list[Tensor]:
    """The replicas' tensors as a list, all of one shape, dtype and device."""
    where = f" for {name!r}" if name else ""
    items = list(deltas.unbind(0)) if isinstance(deltas, Tensor) else list(deltas)
    if not items:
        raise ValueError(f"deltas{where}: need at least one replica's tensor; got none")
    if not all(isinstance(d, Tensor) for d in items):
        raise ValueError(f"deltas{where}: every entry must be a torch.Tensor")
    first = items[0]
    for d in items[1:]:
        if d.shape != first.shape:
            raise ValueError(f"deltas{where}: shapes differ: {tuple(first.shape)} and "
                             f"{tuple(d.shape)}")
        if d.dtype != first.dtype or d.device != first.device:
            raise ValueError(f"deltas{where}: dtypes/devices differ: {first.dtype} on "
                             f"{first.device} and {d.dtype} on {d.device}")
    if not first.is_floating_point():
        raise ValueError(f"deltas{where}: need floating-point tensors; got {first.dtype}")
    return items


def _merge_one(strategy: str, deltas: list[Tensor], opts: Mapping[str, Any],
               generators: list[torch.Generator | None]) -> Tensor:
    """One tensor, unbatched: the plain mean for non-2-D tensors and for "mean"."""
    if deltas[0].dim() != 2:
        return mean64(deltas).to(deltas[0].dtype)
    if not MERGES[strategy].spectral:
        elementwise: ElementwiseMerge = implementation(strategy)
        return elementwise(deltas, opts, generators)
    merged = _spectral(strategy, opts)([d.unsqueeze(0) for d in deltas])
    return merged[0].to(deltas[0].dtype)


def merge(strategy: str, deltas: Sequence[Tensor] | Tensor, **options: Any) -> Tensor:
    """Merged update direction of ONE parameter tensor from its R pseudo-gradients Δ_r.

    strategy (docs/strategies.md; tensors that are not exactly 2-D always get the mean):
      "mean"    (1/R) Σ Δ_r.
      "isoc"    ISO-C(mean(Δ)).
      "isocts"  ISO-CTS({Δ_r}); option common_fraction in [0, 1] (default 0.8).
      "tsv"     TSV-Merge({Δ_r}); keep_fraction in (0, 1] (default 1/R), decorrelate (True).
      "ties"    sparsify each Δ_r, then the TIES disjoint merge; sparsity in [0, 1) (0.1),
                prune "magnitude" (default) | "random", prune_dim "all" (default) | "row" |
                "column", rescale (False), disjoint (True), generator (for random pruning).
      "dare"    the same with prune "random" (the only choice), rescale True and disjoint
                False by default; generator required.
    `deltas` is a sequence of R tensors of one shape (or one tensor stacked on dim 0).
    `generator` is a torch.Generator shared by all replicas (used in replica order) or a
    sequence of R generators, replica r drawing from the r-th. Options given as None take
    their defaults. Returns a tensor of the inputs' shape and dtype; the spectral merges are
    computed in float64. Raises ValueError on bad strategies, options or inputs.
    """
    opts = resolve_options(strategy, options)
    items = _check_deltas(deltas)
    return _merge_one(strategy, items, opts, _replica_generators(opts.get("generator"),
                                                                  len(items)))


def merge_all(strategy: str, deltas_by_name: Mapping[str, Sequence[Tensor] | Tensor],
              **options: Any) -> dict[str, Tensor]:
    """`merge` applied to every tensor of a model; the same result as calling it per tensor.

    Spectral merges (isoc, isocts, tsv) of same-shape 2-D tensors run as batches (torch's
    batched linalg). Random pruning draws from the generator(s) tensor by tensor in the
    iteration order of `deltas_by_name` (replica by replica within a tensor; 2-D tensors only,
    since the others get the plain mean), exactly as a loop of `merge` calls would. Returns a
    dict in the mapping's order.
    """
    opts = resolve_options(strategy, options)
    checked = {name: _check_deltas(ds, name) for name, ds in deltas_by_name.items()}
    if not MERGES[strategy].spectral:  # elementwise: tensor by tensor
        merged: dict[str, Tensor] = {}
        gens: dict[int, list[torch.Generator | None]] = {}
        for name, items in checked.items():
            replicas = len(items)
            if replicas not in gens:
                gens[replicas] = _replica_generators(opts.get("generator"), replicas)
            merged[name] = _merge_one(strategy, items, opts, gens[replicas])
        return merged

    merged = {}
    groups: dict[tuple[torch.Size, torch.dtype, torch.device, int], list[str]] = {}
    for name, items in checked.items():
        if items[0].dim() != 2:
            merged[name] = mean64(items).to(items[0].dtype)
        else:
            first = items[0]
            groups.setdefault((first.shape, first.dtype, first.device, len(items)),
                              []).append(name)
    compute = _spectral(strategy, opts)
    for (shape, dtype, _, replicas), names in groups.items():
        per_matrix = replicas * shape.numel() * dtype.itemsize
        size = max(1, _BATCH_BYTES // max(per_matrix, 1))
        for start in range(0, len(names), size):
            chunk = names[start:start + size]
            stacked = [torch.stack([checked[name][r] for name in chunk])
                       for r in range(replicas)]
            result = compute(stacked)
            del stacked
            for i, name in enumerate(chunk):
                merged[name] = result[i].to(dtype)
    return {name: merged[name] for name in checked}
