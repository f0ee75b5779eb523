"""DiLoCo written plainly, in one process: the algorithm of docs/strategies.md on a page.

Every replica is a model of its own with its inner optimizer (AdamW, or Muon and AdamW), LR
schedule and data stream; each takes H inner steps on whole batches; then one outer step of
the package's OuterSync (its merges, codecs and error feedback are checked against plain
references of their own in the tests) turns every Δ_r = θ − θ_r into the update of θ, and
every replica starts again from θ. `streaming_run` is the same with the streaming settings
(outer.fragments, delay, mix) written straight from their definition.

Not how a run trains (workers/loop.py's Trainer: replicas taking turns in one scratch model,
micro-batches, process groups, checkpoints, a background sync), but what it computes: the
tests hold the Trainer, in every layout, to these loops, bit for bit where the arithmetic is
the same.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import torch
from torch.optim.lr_scheduler import LambdaLR
from transformers import LlamaForCausalLM

from isoloco_ray import aggregators
from isoloco_ray.config import TrainConfig
from isoloco_ray.data.format import DataDir, Dataset
from isoloco_ray.data.stream import ReplicaStream, read_with_pyarrow, replica_share
from isoloco_ray.strategies import OuterMerge
from isoloco_ray.workers.model import build_model
from isoloco_ray.workers.outer.step import OuterSync, outer_optimizer
from isoloco_ray.workers.inner_optimizer import make_inner_optimizer, schedule_at
from isoloco_ray.workers.rounds.fragments import split_fragments

# A reference loop's replica: its model, its inner optimizer with its LR schedule, its data stream.
ReferenceReplica = tuple[LlamaForCausalLM, tuple[torch.optim.Optimizer, LambdaLR], ReplicaStream]


def make_replicas(cfg: TrainConfig, data_dir: DataDir) -> list[ReferenceReplica]:
    """Every replica of a reference loop: (its model, inner optimizer with its LR schedule, its data
    stream), the model starting from the run's seed."""
    replicas, total = cfg.scaling.replicas, cfg.resolved.rounds * cfg.inner.steps
    dataset = Dataset.open(data_dir)
    vocab = dataset.meta.vocab_size
    out = []
    for r in range(replicas):
        model = build_model(cfg.model, vocab, cfg.run.seed)
        out.append((model, make_inner_optimizer(model, cfg.inner, total),
                    ReplicaStream(replica_share(dataset, r, replicas), read_with_pyarrow,
                                  cfg.data.seq_len, cfg.data.batch_size, vocab_size=vocab)))
    return out


def inner_step(cfg: TrainConfig, model: LlamaForCausalLM,
               optimizer_and_schedule: tuple[torch.optim.Optimizer, LambdaLR],
               stream: ReplicaStream) -> None:
    """One inner optimizer step on a whole batch, the gradient clipped as the loop clips it."""
    optimizer, schedule = optimizer_and_schedule
    optimizer.zero_grad(set_to_none=True)
    batch = stream.next_batch()
    model(input_ids=batch, labels=batch).loss.backward()
    if cfg.inner.clip is not None:  # null: no clipping
        torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.inner.clip)
    optimizer.step()
    schedule.step()


def run_over_quorums(cfg: TrainConfig, data_dir: DataDir,
                     contributors: Sequence[Sequence[int]],
                     replica_steps: Sequence[Sequence[int]] | None = None
                     ) -> dict[str, torch.Tensor]:
    """DiLoCo when workers miss rounds (the quorum's outer step, QuorumSync.quorum_step),
    plainly: W = R/V workers, worker w hosting replicas wV … wV+V−1. In round j only the
    workers in `contributors[j]` take their inner steps. For a merge of the mean each sends
    the sum of its replicas' Δ_r (in replica order); the mean is those sums added in rank
    order, over the number of replicas in them (each Δ_r pruned first where the merge is the
    mean of pruned Δ_r: dare, ties without disjoint), merged and applied by the outer
    optimizer. A merge of every Δ_r (tsv, isocts, ties) is OuterSync's step over the
    replicas present, in replica order, keyed by round j (random masks); on a lossy wire
    (outer.comm_dtype, outer.topk) what crosses is what the codec keeps of each, with each
    replica's error-feedback residual, and a sum crosses as its cast. A worker absent from
    round j has its replicas start round j+1 from θ with fresh AdamW moments, their LR
    schedule and stream where (j+1)·H steps leave them (Replica.rejoin). No streaming
    settings. `replica_steps[j][r]` (metrics' `replica_steps`; default H): the inner steps
    replica r of a present worker took in round j (a straggler's partial round); its Δ_r then
    counts by its share f_r = h_r/H (aggregators/weights.py): the sums are of f_r·Δ_r over
    Σ f_r, a merge of every Δ_r weights them."""
    replicas = make_replicas(cfg, data_dir)
    hosted = cfg.scaling.replicas_per_worker
    theta = {n: p.detach().clone() for n, p in replicas[0][0].named_parameters()}
    resolved = OuterMerge.of(cfg.outer)
    every_delta = OuterSync(cfg.outer.quorum_outer(), len(replicas), cfg.run.seed)
    wire = every_delta.exchange.codec  # what a worker's sum crosses as (a cast)
    feedback: dict[int, dict[str, torch.Tensor]] | None = (
        {r: {} for r in range(len(replicas))} if cfg.outer.error_feedback else None)
    optimizer = outer_optimizer(cfg.outer)
    steps = cfg.inner.steps
    for round_index, present in enumerate(contributors):
        present = sorted(present)
        sums, deltas = [], {}
        taken = (replica_steps[round_index] if replica_steps is not None
                 else [steps] * len(replicas))
        shares = {r: taken[r] / steps for r in range(len(replicas))}
        for worker in present:
            mine = range(worker * hosted, worker * hosted + hosted)
            for r in mine:
                for _ in range(taken[r]):
                    inner_step(cfg, *replicas[r])
            with torch.no_grad():
                mine_deltas = {r: {n: theta[n] - p for n, p in replicas[r][0].named_parameters()}
                               for r in mine}
                deltas.update(mine_deltas)
                if resolved.prune_where_hosted:  # a mean of pruned Δ_r: pruned where hosted
                    mine_deltas = {r: {n: every_delta.exchange.payloads.pruned(d, round_index, r, n)
                                       for n, d in delta.items()}
                                   for r, delta in mine_deltas.items()}
                # Σ_r f_r·Δ_r from zero in replica order, as Payloads.make (f_r = 1: Δ_r)
                sums.append({n: wire.roundtrip(sum((mine_deltas[r][n] if shares[r] == 1.0
                                                    else mine_deltas[r][n] * shares[r]
                                                    for r in mine), torch.zeros_like(t)))
                             for n, t in theta.items()})
        with torch.no_grad():
            if not every_delta.route.sums:  # the absent replicas' Δ_r left out as diverged
                absent = {r for r in range(len(replicas)) if r not in deltas}
                every_delta.step(theta, {r: deltas.get(r) or {n: torch.zeros_like(t)
                                                              for n, t in theta.items()}
                                         for r in range(len(replicas))},
                                 round_index, diverged=absent, feedback=feedback,
                                 trained=shares)
            else:
                divisor = sum(shares[r] for worker in present
                              for r in range(worker * hosted, worker * hosted + hosted))
                means = {}
                for name in theta:
                    total = sums[0][name].clone()
                    for part in sums[1:]:
                        total += part[name]
                    means[name] = total / divisor
                directions = means if resolved.merge == "mean" else aggregators.merge_all(
                    resolved.merge, {name: [mean] for name, mean in means.items()})
                optimizer.apply(theta, {name: optimizer.update(name, direction)
                                        for name, direction in directions.items()})
            done = (round_index + 1) * steps
            for r, (model, (adamw, schedule), stream) in enumerate(replicas):
                for n, p in model.named_parameters():
                    p.copy_(theta[n])
                if r // hosted not in present:  # rejoins: Replica.rejoin, written out
                    if feedback is not None:
                        feedback[r] = {}
                    adamw.state.clear()
                    schedule_at(adamw, schedule, done)
                    stream.seek(stream.position_after(done))
    return theta


def streaming_run(cfg: TrainConfig, data_dir: DataDir) -> dict[str, torch.Tensor]:
    """The streaming semantics written straight from docs/strategies.md, one process: every
    replica a model of its own stepping in lockstep; after global inner step t, fragment p's
    pseudo-gradients are taken when (t − p·H/P) % H == 0, and `delay` steps later (or after
    the last step) their merge moves the global fragment by the outer optimizer and each
    replica's fragment becomes mix·local + (1 − mix)·global."""
    outer, steps = cfg.outer, cfg.inner.steps
    fragments, delay, mix = outer.fragments, outer.delay, outer.mix
    total = cfg.resolved.rounds * steps
    replicas = make_replicas(cfg, data_dir)
    models = [model for model, _, _ in replicas]
    theta = {n: p.detach().clone() for n, p in models[0].named_parameters()}
    parts = split_fragments({n: t.shape for n, t in theta.items()}, fragments)
    resolved = OuterMerge.of(outer)
    options = {key: outer.strategy_options[key] for key in resolved.options}
    outer_opt = outer_optimizer(outer, resolved.orthogonalize_update)
    local = [dict(m.named_parameters()) for m in models]

    @torch.no_grad()
    def land(part: Sequence[str], deltas: Sequence[Mapping[str, torch.Tensor]]) -> None:
        merged = aggregators.merge_all(resolved.merge, {n: [d[n] for d in deltas]
                                                        for n in part}, **options)
        outer_opt.step({n: theta[n] for n in part}, merged)
        for params in local:
            for n in part:
                params[n].copy_(mix * params[n] + (1 - mix) * theta[n])

    pending = []  # (lands after step, fragment, Δ_r of every replica)
    for t in range(1, total + 1):
        for replica in replicas:
            inner_step(cfg, *replica)
        for p in range(fragments):
            if (t - p * steps // fragments) % steps == 0:
                deltas = [{n: (theta[n] - params[n]).detach() for n in parts[p]}
                          for params in local]
                pending.append((t + delay, p, deltas))
        for due in [item for item in pending if item[0] == t]:
            pending.remove(due)
            land(parts[due[1]], due[2])
    for _, p, deltas in pending:  # after the last step, what is in flight lands
        land(parts[p], deltas)
    return theta


def run(cfg: TrainConfig, data_dir: DataDir) -> dict[str, torch.Tensor]:
    """DiLoCo without streaming, written plainly in one process: every replica a model of its
    own taking H inner steps on whole batches, then one outer step of the package's OuterSync
    (its merges, codecs and error feedback are checked against plain references of their own
    in tests/aggregators and tests/workers/outer) on every Δ_r, and every replica
    starting again from θ. The same arithmetic as the training loop with its streaming
    settings off, so the two agree bit for bit on any CPU."""
    replicas = make_replicas(cfg, data_dir)
    models = [model for model, _, _ in replicas]
    theta = {n: p.detach().clone() for n, p in models[0].named_parameters()}
    outer = OuterSync(cfg.outer, len(replicas), cfg.run.seed)
    feedback: dict[int, dict[str, torch.Tensor]] | None = (
        {r: {} for r in range(len(replicas))} if cfg.outer.error_feedback else None)
    for round_index in range(cfg.resolved.rounds):
        for replica in replicas:
            for _ in range(cfg.inner.steps):
                inner_step(cfg, *replica)
        with torch.no_grad():
            deltas = {r: {n: theta[n] - p for n, p in model.named_parameters()}
                      for r, model in enumerate(models)}
            outer.step(theta, deltas, round_index, feedback=feedback)
            for model in models:
                for n, p in model.named_parameters():
                    p.copy_(theta[n])
    return theta
