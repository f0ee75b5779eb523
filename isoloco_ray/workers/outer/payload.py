"""What a rank of the outer group sends of its hosted replicas' Δ_r in one outer step.

Per tensor: [Σ of its good replicas' Δ_r] when the route sends sums (strategies.Route), or every
hosted Δ_r in replica order. Pruned where hosted when the merge is a mean of sparsified Δ_r
(TIES/DARE without the disjoint step), and corrected by error feedback when that is on.
"""

from __future__ import annotations

import zlib
from collections.abc import Callable, Iterable, Mapping, Sequence

import torch

from isoloco_ray import aggregators
from isoloco_ray.config import OuterConfig
from isoloco_ray.strategies import OuterMerge, Route
from isoloco_ray.workers.outer.codec import Codec


CPU = torch.device("cpu")


def pruning_generator(seed: int, round_index: int, replica: int, tensor: str,
                      device: torch.device = CPU) -> torch.Generator:
    """The random-pruning stream of one replica's tensor in one round, on `device` (the
    tensor's: the mask is drawn where the Δ is, never copied over from the host).

    Keyed by all four, so the mask depends neither on the layout, nor on which rank merges
    the tensor, nor on the order tensors are visited in, and shares nothing with the other
    random streams (data order, init): switching strategies changes nothing else. A CUDA
    stream of the same key draws other numbers than a CPU one (and may on another GPU model):
    the same masks on every rank and across a resume hold on one kind of device, which is what
    a run uses.
    """
    key = zlib.crc32(f"prune/{seed}/{round_index}/{replica}/{tensor}".encode())
    return torch.Generator(device=device).manual_seed(key)


class Payloads:
    """Makes this rank's payload each outer step (stateless: error-feedback residuals are the
    replicas' own, passed in)."""

    def __init__(self, outer: OuterConfig, merge: OuterMerge, route: Route, codec: Codec,
                 seed: int) -> None:
        self.outer, self.merge, self.route, self.codec, self.seed = (outer, merge, route,
                                                                     codec, seed)

    def make(self, hosted: Mapping[int, Mapping[str, torch.Tensor]], good: Sequence[int],
             round_index: int, feedback: Mapping[int, dict[str, torch.Tensor]] | None = None,
             trained: Mapping[int, float] | None = None) -> dict[str, list[torch.Tensor]]:
        """Per tensor, what this rank sends: [Σ of its good replicas' Δ_r] (the route sends
        sums), or every hosted Δ_r in replica order (bad ones too; the merge leaves them out).
        With `feedback`, replica r sends x = Δ_r + β·e_r (β: outer.error_decay; pruned first
        where the mean of pruned Δ_r is merged); once x is encoded, `settle` keeps
        e_r ← x − decode(encode(x)): what the wire lost this round is sent with the next
        round's. `trained`, the share f_r of the round each replica trained (partial rounds:
        aggregators/weights.py): the sum is Σ f_r·Δ_r, the mean then divides by Σ f_r (a
        share of 1, or none given: Δ_r as it is); each Δ_r is sent as it is, the merge
        weights it."""
        order = sorted(hosted)
        names = list(hosted[order[0]])
        if not self.route.sums:
            sent = {r: dict(hosted[r]) for r in order}
            for r in order:
                if feedback is not None and r in good:
                    residuals = feedback[r]  # of every tensor; `hosted` may be one fragment
                    for name in sent[r]:
                        if name in residuals:
                            sent[r][name] = sent[r][name] + self.decayed(residuals[name])
                if self.merge.prune_where_hosted and r in good:
                    sent[r] = {name: self.pruned(delta, round_index, r, name)
                               for name, delta in sent[r].items()}
            return {name: [sent[r][name] for r in order] for name in names}
        payload = {}
        for name in names:
            total = torch.zeros_like(hosted[order[0]][name])
            for replica in order:
                if replica not in good:
                    continue
                delta = hosted[replica][name]
                if self.merge.prune_where_hosted:
                    # A mean of sparsified Δ_r needs only their sum: prune where hosted.
                    delta = self.pruned(delta, round_index, replica, name)
                share = 1.0 if trained is None else trained.get(replica, 1.0)
                total += delta if share == 1.0 else delta * share
            payload[name] = [total]
        return payload

    def settle(self, feedback: Mapping[int, dict[str, torch.Tensor]] | None,
               sent: Mapping[str, Sequence[torch.Tensor]],
               decoded: Callable[[], Mapping[str, Sequence[torch.Tensor]]],
               hosted: Iterable[int], good: Sequence[int]) -> None:
        """Keep each good hosted replica's residual e_r ← x − decode(encode(x)) of the payload
        `make` gave (`sent`: name -> the copies of the hosted replicas, in order), from
        `decoded()`, the same copies as the wire delivers them: taken from what the transport
        decoded already where it did (each payload is encoded once), and asked for only when
        needed. Nothing without feedback, or when the route sends sums (which carry none); a
        dropped replica's residual is kept as it was."""
        if feedback is None or self.route.sums:
            return
        delivered = decoded()
        for copy, replica in enumerate(sorted(hosted)):
            if replica in good:
                feedback[replica].update({name: x[copy] - delivered[name][copy]
                                          for name, x in sent.items()})

    def decayed(self, residual: torch.Tensor) -> torch.Tensor:
        """β·e_r (outer.error_decay; β = 1: e_r itself, not a product)."""
        decay = self.outer.error_decay
        return residual if decay == 1.0 else decay * residual

    def pruned(self, delta: torch.Tensor, round_index: int, replica: int, name: str
               ) -> torch.Tensor:
        """Replica `replica`'s Δ of tensor `name` sparsified as the merge prescribes (matrices
        only; other tensors as they are)."""
        if delta.dim() != 2:
            return delta
        options = self.outer.strategy_options
        return aggregators.sparsify(
            delta, options["sparsity"], prune=options["prune"], prune_dim=options["prune_dim"],
            rescale=options["rescale"],
            generator=self.generators(round_index, [replica], name, delta.device)[0])

    def generators(self, round_index: int, replicas: Sequence[int], tensor: str,
                   device: torch.device) -> list[torch.Generator | None]:
        """The random-pruning stream of each of `replicas` for `tensor` this round on `device`
        (None when pruning is by magnitude), wherever the mask is drawn: on the replica's host
        or at the tensor's owner."""
        if self.outer.strategy_options.get("prune") != "random":
            return [None] * len(replicas)
        return [pruning_generator(self.seed, round_index, r, tensor, device) for r in replicas]
