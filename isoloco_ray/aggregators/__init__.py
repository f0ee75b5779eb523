"""Outer aggregation: pure tensor math, no Ray and no torch.distributed (docs/strategies.md).

Modules, one idea each:

- ``merge``: ``merge(strategy, deltas, **options)`` for one parameter tensor and
  ``merge_all(strategy, deltas_by_name, **options)`` for a model (same-shape matrices batched);
  the merges of the registry (isoloco_ray.strategies.MERGES: "mean", "isoc", "isocts", "tsv",
  "ties", "dare"), each option checked by the merge's options model; their implementations.
- ``isoc``: ISO-C of one matrix, from its polar factor.
- ``isocts``: ISO-CTS (common + task-specific subspaces).
- ``tsv``: TSV-Merge (task singular vectors).
- ``sparsify``: TIES / DARE pruning and the TIES disjoint merge.
- ``linalg``: polar factors (Gram + eigh on CPU, QDWH on CUDA), top-q SVD from Gram matrices,
  with an SVD fallback wherever a Gram matrix would be too ill-conditioned to be exact.
- ``outer``: ``OuterOptimizer``, SGD momentum / Nesterov then optional ISO-C of the update.
- ``weights``: partial rounds, each Δ_r weighted by the share of the round it trained.

Every spectral merge computes exactly the function docs/strategies.md defines, checked against a
plain float64 SVD version in aggregators/reference.py. Tensors that are not exactly 2-D always
get the plain mean. Random pruning draws only from the generator(s) passed in: one torch.Generator
shared by the replicas, or one per replica; `merge_all` uses them tensor by tensor in the
mapping's order, replica by replica within a tensor, 2-D tensors only.
"""

from isoloco_ray.aggregators.isoc import isoc
from isoloco_ray.aggregators.isocts import isocts_sizes
from isoloco_ray.aggregators.linalg import polar
from isoloco_ray.aggregators.merge import merge, merge_all
from isoloco_ray.aggregators.outer import OuterOptimizer
from isoloco_ray.aggregators.sparsify import disjoint_merge, sparsify
from isoloco_ray.aggregators.tsv import tsv_rank
from isoloco_ray.aggregators.weights import share_factors, weighted

__all__ = [
    "OuterOptimizer",
    "disjoint_merge",
    "isoc",
    "isocts_sizes",
    "merge",
    "merge_all",
    "polar",
    "share_factors",
    "sparsify",
    "tsv_rank",
    "weighted",
]
