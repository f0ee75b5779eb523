"""The fault-tolerant outer sync's engine (workers/quorum/seat.py) on a real torchft lighthouse and
real Managers, one thread per worker in this process (as torchft's own integration tests):
the committed mean is the plain sum in rank order, a worker that leaves or dies costs one
attempt and no recomputation, and a replacement heals from a peer."""

from __future__ import annotations

import os
import shutil
import threading
import time
from collections.abc import Callable, Iterator
from datetime import timedelta
from typing import Any

import pytest
import torch

pytest.importorskip("torchft")  # RUST_LOG: tests/conftest.py

from torchft._torchft import LighthouseServer  # noqa: E402

from isoloco_ray import aggregators  # noqa: E402
from isoloco_ray.config import load_config  # noqa: E402
from isoloco_ray.fault_tolerance import min_quorum  # noqa: E402
from isoloco_ray.strategies import OuterMerge  # noqa: E402
from isoloco_ray.workers.outer.step import OuterSync  # noqa: E402
from isoloco_ray.workers.quorum.seat import CommittedSync, Contribution, QuorumSeat, WorkersDiffer  # noqa: E402
from isoloco_ray.workers.quorum.sync import QuorumSync, quorum_numel  # noqa: E402

# Torch on one thread, as the one-process references here and the local runs' ranks: three
# Trainers on threads calling MKL at once, or a reference on more threads than the run it is
# compared with, split float64 work otherwise on some CPUs (an AMD EPYC: tsv, isoloco).
pytestmark = pytest.mark.usefixtures("one_thread")

REPLICAS, HOSTED, NUMEL = 6, 2, 7  # 3 workers hosting 2 replicas each


def started_lighthouse(join_timeout_ms: int) -> Iterator[str]:
    # A quorum forms once every member of the previous one has asked (with whoever else has
    # asked by then), or join_timeout_ms after the first ask when one that still heartbeats
    # is missing. One silent for 300 ms is gone (torchft's managers beat every 100 ms, from
    # Rust, whatever Python's threads are doing): a seat shut down is not waited for.
    server = LighthouseServer(bind="127.0.0.1:0", min_replicas=2,
                              join_timeout_ms=join_timeout_ms, heartbeat_timeout_ms=300)
    yield "http://127.0.0.1:" + server.address().rsplit(":", 1)[1]
    server.shutdown()


@pytest.fixture
def lighthouse():
    yield from started_lighthouse(2000)


@pytest.fixture
def patient_lighthouse():
    """One that waits 20 s for a missing member: a slowed worker arrives seconds late and
    must still be in every quorum."""
    yield from started_lighthouse(20000)


class Worker:
    """A seat and the state a peer would heal it with (θ, and the committed rounds)."""

    def __init__(self, rank: int, lighthouse: str, fingerprint=None, workers: int = 3) -> None:
        self.rank = rank
        self.theta = torch.zeros(NUMEL)
        self.seat = QuorumSeat(rank, workers, HOSTED * workers, NUMEL, lighthouse,
                               self.state_dict, self.load_state_dict,
                               min_workers=min_quorum(workers),
                               # A dead peer fails a collective within this (at once, mostly).
                               timeout=timedelta(seconds=5),
                               quorum_timeout=timedelta(seconds=60), fingerprint=fingerprint)

    def state_dict(self) -> dict[str, Any]:
        return {"theta": self.theta}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.theta = state["theta"].clone()

    def contribution(self, round_index: int, good: list[int] | None = None) -> Contribution:
        """Seeded by (rank, round): the same tensor whenever it is asked for again."""
        generator = torch.Generator().manual_seed(1000 * round_index + self.rank)
        good = good if good is not None else [HOSTED * self.rank + i for i in range(HOSTED)]
        return Contribution(torch.randn(NUMEL, generator=generator), good,
                            loss_sum=float(len(good)) + self.rank / 8)

    def step(self, result: CommittedSync) -> None:
        self.theta -= plain_mean(*result.payloads, good=len(result.good))


def in_threads(*calls: Callable[[], Any], timeout: float = 60) -> list[Any]:
    """Run each call on its own thread; their results, in order (an exception is re-raised)."""
    results: list[Any] = [None] * len(calls)

    def run(index: int, call: Callable[[], Any]) -> None:
        try:
            results[index] = call()
        except BaseException as exc:  # noqa: BLE001 - re-raised in the test's thread
            results[index] = exc

    threads = [threading.Thread(target=run, args=(i, call), daemon=True)
               for i, call in enumerate(calls)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout)
        assert not thread.is_alive(), "a worker's sync did not end"
    for result in results:
        if isinstance(result, BaseException):
            raise result
    return results


def plain_mean(*payloads: torch.Tensor, good: int) -> torch.Tensor:
    total = payloads[0].clone()
    for payload in payloads[1:]:
        total += payload
    return total / good


def test_the_mean_is_the_plain_sum_in_rank_order_and_a_worker_that_left_is_not_waited_for(
        lighthouse):
    workers = [Worker(rank, lighthouse) for rank in range(3)]
    try:
        # Round 1: worker 1's second replica diverged: its Δ is not in worker 1's sum.
        given = [workers[0].contribution(1), workers[1].contribution(1, good=[2]),
                 workers[2].contribution(1)]
        results = in_threads(*[lambda w=w, c=c: w.seat.sync(c) for w, c in zip(workers, given)])
        expected = plain_mean(*(c.payload for c in given), good=5)
        for result in results:
            assert (result.participants, result.contributors) == ([0, 1, 2], [0, 1, 2])
            assert result.good == [0, 1, 2, 4, 5] and result.attempts == 1
            assert result.loss_sum == sum(c.loss_sum for c in given)
            # Every worker holds the payloads in rank order: the same mean, bit for bit.
            assert torch.equal(plain_mean(*result.payloads, good=len(result.good)), expected)
        # Round 2: worker 1 has left; the others commit without it.
        workers[1].seat.shutdown()
        survivors = [workers[0], workers[2]]
        given = [w.contribution(2) for w in survivors]
        results = in_threads(*[lambda w=w, c=c: w.seat.sync(c)
                               for w, c in zip(survivors, given)])
        for result in results:
            assert (result.participants, result.contributors) == ([0, 2], [0, 2])
            assert result.good == [0, 1, 4, 5]
            assert torch.equal(plain_mean(*result.payloads, good=len(result.good)),
                               plain_mean(*(c.payload for c in given), good=4))
    finally:
        for worker in workers:
            worker.seat.shutdown()


def test_a_worker_dying_inside_the_sync_costs_one_quorum_and_a_replacement_heals(lighthouse):
    workers = [Worker(rank, lighthouse) for rank in range(3)]
    replacement = None
    try:
        round_1 = in_threads(*[lambda w=w: w.seat.sync(w.contribution(1)) for w in workers])
        for worker, result in zip(workers, round_1):
            worker.step(result)

        def die_after_joining() -> None:  # in the quorum, then gone before the exchange
            workers[1].seat.manager.start_quorum()
            workers[1].seat.shutdown()  # its connections close, as a dead process's do

        survivors = [workers[0], workers[2]]
        given = [w.contribution(2) for w in survivors]
        held = [c.payload.clone() for c in given]
        *results, _ = in_threads(*[lambda w=w, c=c: w.seat.sync(c)
                                   for w, c in zip(survivors, given)], die_after_joining)
        for worker, result in zip(survivors, results):
            assert result.attempts == 2  # the first quorum held the dead worker
            assert (result.participants, result.contributors) == ([0, 2], [0, 2])
            assert torch.equal(plain_mean(*result.payloads, good=len(result.good)),
                               plain_mean(*held, good=4))  # Δ kept, not redone
            worker.step(result)
        assert torch.equal(workers[0].theta, workers[2].theta)

        # A replacement for worker 1 starts from nothing: it heals from a peer inside the next
        # quorum and brings no Δ to it (its Δ would come from another θ).
        replacement = Worker(1, lighthouse)

        def join() -> CommittedSync:
            return replacement.seat.sync(replacement.contribution(3))

        def survivor(worker: Worker) -> Callable[[], CommittedSync]:
            def sync() -> CommittedSync:
                # The replacement asks first, so the quorum that forms when both survivors
                # have asked holds it.
                time.sleep(0.5)
                return worker.seat.sync(worker.contribution(3))
            return sync

        joined, *results = in_threads(join, survivor(workers[0]), survivor(workers[2]))
        assert joined.healed and not results[0].healed
        for result in (joined, *results):
            assert (result.participants, result.contributors) == ([0, 1, 2], [0, 2])
            assert result.good == [0, 1, 4, 5]
        assert torch.equal(replacement.theta, workers[0].theta)  # healed before the step
    finally:
        for worker in workers + ([replacement] if replacement else []):
            worker.seat.shutdown()


def test_a_payload_missed_by_one_of_five_workers_commits_the_round_nowhere():
    """torchft decides should_commit per worker: here worker 3 alone misses a payload (its
    all-gather fails; the others' completed). The vote makes that one decision: no worker
    commits the first quorum, every one commits the second, with the same contributors and
    the same sum. Without it, workers 0, 1, 2 and 4 would go on while worker 3 waits, alone
    below the majority, for a quorum that never comes."""
    server = LighthouseServer(bind="127.0.0.1:0", min_replicas=min_quorum(5),
                              join_timeout_ms=2000)
    address = "http://127.0.0.1:" + server.address().rsplit(":", 1)[1]
    workers = [Worker(rank, address, workers=5) for rank in range(5)]
    seat = workers[3].seat
    gather, missed = seat._all_gather, []

    def gather_missing_a_payload(payload: torch.Tensor, size: int):
        gathered = gather(payload, size)  # completes on every worker
        if not missed:
            missed.append(True)
            seat.manager.report_error(ConnectionResetError("a peer's payload did not arrive"))
            return None
        return gathered

    seat._all_gather = gather_missing_a_payload
    try:
        given = [w.contribution(1) for w in workers]
        results = in_threads(*[lambda w=w, c=c: w.seat.sync(c)
                               for w, c in zip(workers, given)], timeout=40)
        for worker, result in zip(workers, results):
            assert result.attempts == 2, worker.rank
            assert result.participants == result.contributors == [0, 1, 2, 3, 4]
            worker.step(result)
        assert all(torch.equal(w.theta, workers[0].theta) for w in workers)
        assert torch.equal(workers[0].theta,
                           -plain_mean(*(c.payload for c in given), good=10))
        # The step each worker's torchft Manager counts is the same: nobody is ahead.
        assert {w.seat.manager.current_step() for w in workers} == {1}
    finally:
        for worker in workers:
            worker.seat.shutdown()
        server.shutdown()


SHAPES = {"w": (4, 3), "b": (5,)}


def seeded(seed: int) -> dict[str, torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    return {name: torch.randn(shape, generator=generator) for name, shape in SHAPES.items()}


class Peer:
    """A worker of the quorum-step tests: θ, its QuorumSync and seat; it hosts replicas
    2·rank and 2·rank+1, whose Δ_r in round j are seeded by (j, r)."""

    def __init__(self, rank: int, outer, lighthouse: str) -> None:
        self.rank, self.theta = rank, seeded(0)
        self.outer = QuorumSync(outer, REPLICAS, seed=0)
        # outer.error_feedback: each hosted replica's residual, as Replica.feedback holds it.
        self.feedback = ({r: {} for r in range(HOSTED * rank, HOSTED * rank + HOSTED)}
                         if outer.error_feedback else None)
        numel = quorum_numel(outer, [torch.Size(shape) for shape in SHAPES.values()], HOSTED)
        self.seat = QuorumSeat(rank, 3, REPLICAS, numel, lighthouse, self.state_dict,
                               self.load_state_dict, min_workers=2,
                               timeout=timedelta(seconds=10),
                               quorum_timeout=timedelta(seconds=60))

    def state_dict(self) -> dict[str, Any]:
        return {"theta": self.theta, "outer": self.outer.state_dict()}

    def load_state_dict(self, state: dict[str, Any]) -> None:  # not called here
        raise AssertionError("no worker is behind in this test")

    def step(self, round_index: int, diverged: set[int],
             shares: dict[int, float] | None = None) -> CommittedSync:
        _, committed = self.outer.quorum_step(self.theta, hosted_deltas(round_index, self.rank),
                                              round_index, self.seat, diverged, trained=shares,
                                              feedback=self.feedback)
        return committed


def hosted_deltas(round_index: int, rank: int) -> dict[int, dict[str, torch.Tensor]]:
    return {r: seeded(100 * round_index + r)
            for r in range(HOSTED * rank, HOSTED * rank + HOSTED)}


# An elementwise and a spectral merge; and sums sent in bfloat16 (the quorum gathers them).
@pytest.mark.parametrize("strategy, wire", [("diloco", "float32"), ("isoc", "float32"),
                                            ("diloco", "bfloat16")])
def test_the_outer_step_over_a_quorum_is_the_plain_step_over_its_contributors(lighthouse,
                                                                            strategy, wire):
    """QuorumSync.quorum_step on 3 workers (2 replicas each), one replica diverged in round 1
    and a worker gone in round 2: every survivor's θ is the plain outer step's, bit for bit,
    over the sums of the replicas that took part (each worker's in replica order, rounded to
    the wire's dtype, then the workers' in rank order)."""
    outer = load_config([f"--outer.strategy={strategy}", "--outer.lr=0.7",
                         f"--outer.comm_dtype={wire}",
                         "--scaling.replicas=6"]).outer.quorum_outer()
    assert OuterSync(outer, REPLICAS, seed=0).route.sums
    # The plain outer step, written out.
    theta, optimizer = seeded(0), aggregators.OuterOptimizer(
        lr=outer.lr, momentum=outer.momentum, nesterov=outer.nesterov)
    merge = OuterMerge.of(outer).merge

    def plain_step(round_index: int, workers: list[int], good: list[int]) -> None:
        means = {}
        for name in SHAPES:
            sums = []
            for worker in workers:
                total = torch.zeros(SHAPES[name])
                for r in range(HOSTED * worker, HOSTED * worker + HOSTED):
                    if r in good:
                        total += seeded(100 * round_index + r)[name]
                sums.append(total.to(getattr(torch, wire)).float())
            total = sums[0].clone()
            for part in sums[1:]:
                total += part
            means[name] = total / len(good)
        directions = means if merge == "mean" else aggregators.merge_all(
            merge, {name: [mean] for name, mean in means.items()})
        optimizer.apply(theta, {name: optimizer.update(name, g)
                                for name, g in directions.items()})

    lose_a_worker_after_round_1(outer, lighthouse, theta, plain_step)


def lose_a_worker_after_round_1(outer, lighthouse: str, theta: dict[str, torch.Tensor],
                                reference: Callable[[int, list[int], list[int]], None]
                                ) -> list[Peer]:
    """3 Peers: round 1 with replica 3 diverged, then worker 2 leaves and round 2 runs on the
    other two. `reference(round, contributing workers, good replicas)` takes the expected step
    on `theta`, which both survivors must then hold bit for bit."""
    peers = [Peer(rank, outer, lighthouse) for rank in range(3)]
    try:
        results = in_threads(*[lambda p=p: p.step(1, {3}) for p in peers])
        assert all(r.good == [0, 1, 2, 4, 5] and r.contributors == [0, 1, 2] for r in results)
        reference(1, [0, 1, 2], [0, 1, 2, 4, 5])
        peers[2].seat.shutdown()
        results = in_threads(*[lambda p=p: p.step(2, set()) for p in peers[:2]])
        assert all(r.good == [0, 1, 2, 3] and r.contributors == [0, 1] for r in results)
        reference(2, [0, 1], [0, 1, 2, 3])
        for peer in peers[:2]:
            for name in SHAPES:
                assert torch.equal(peer.theta[name], theta[name]), (peer.rank, name)
    finally:
        for peer in peers:
            peer.seat.shutdown()
    return peers


@pytest.mark.parametrize("args", [["--outer.strategy=tsv"], ["--outer.strategy=isocts"],
                                  ["--outer.strategy=ties"],
                                  ["--outer.strategy=ties", "--outer.prune=random"],
                                  ["--outer.strategy=dare", "--outer.disjoint=true"]],
                         ids=["tsv", "isocts", "ties", "ties-random", "dare-disjoint"])
def test_a_per_replica_merge_over_a_quorum_is_the_step_without_the_missing_replicas(lighthouse,
                                                                                   args):
    """The merges of every Δ_r over a quorum: 3 workers, replica 3 diverged in round 1, worker
    2 gone in round 2. Every survivor's θ is, bit for bit, that of the one-process outer step
    over all 6 replicas with the missing ones left out as diverged (docs/strategies.md, "Over
    a partial quorum"): a lost worker's replicas are dropped exactly like diverged ones."""
    outer = load_config([*args, "--outer.lr=0.7", "--scaling.replicas=6"]).outer.quorum_outer()
    reference, theta = OuterSync(outer, REPLICAS, seed=0), seeded(0)
    assert not reference.route.sums

    def one_process_step(round_index: int, workers: list[int], good: list[int]) -> None:
        reference.step(theta, {r: seeded(100 * round_index + r) for r in range(REPLICAS)},
                       round_index, diverged=set(range(REPLICAS)) - set(good))

    lose_a_worker_after_round_1(outer, lighthouse, theta, one_process_step)


@pytest.mark.parametrize("args", [["--outer.strategy=diloco"], ["--outer.strategy=tsv"],
                                  ["--outer.strategy=ties", "--outer.prune=random"]],
                         ids=["diloco", "tsv", "ties-random"])
def test_a_stragglers_partial_round_counts_by_its_share_over_the_quorum(lighthouse, args):
    """Worker 1's replicas took 1 and 2 of 3 inner steps (shares 1/3 and 2/3: a straggler's
    partial round): every worker's θ is, bit for bit, the one-process step with those shares
    (aggregators/weights.py): for the mean, Σ f_r·Δ_r per worker in replica order, added in
    rank order, over Σ f_r (written out); for a merge of every Δ_r, OuterSync.step with the
    shares. And it is not the step with equal shares."""
    outer = load_config([*args, "--outer.lr=0.7", "--outer.placement=replicated",
                         "--scaling.replicas=6"]).outer.quorum_outer()
    shares = {r: {2: 1 / 3, 3: 2 / 3}.get(r, 1.0) for r in range(REPLICAS)}
    peers = [Peer(rank, outer, lighthouse) for rank in range(3)]
    try:
        results = in_threads(*[lambda p=p: p.step(1, set(), shares) for p in peers])
    finally:
        for peer in peers:
            peer.seat.shutdown()
    assert all(r.shares == shares for r in results)
    reference, theta = OuterSync(outer, REPLICAS, seed=0), seeded(0)
    deltas = {r: seeded(100 + r) for r in range(REPLICAS)}
    if reference.route.sums:
        means = {}
        for name in SHAPES:
            sums = [sum((deltas[r][name] if shares[r] == 1.0 else deltas[r][name] * shares[r]
                         for r in (2 * w, 2 * w + 1)), torch.zeros(SHAPES[name]))
                    for w in range(3)]
            means[name] = (sums[0] + sums[1] + sums[2]) / sum(shares.values())
        reference.optimizer.apply(theta, {name: reference.optimizer.update(name, mean)
                                          for name, mean in means.items()})
    else:
        reference.step(theta, deltas, 1, trained=shares)
    unweighted = seeded(0)
    OuterSync(outer, REPLICAS, seed=0).step(unweighted, deltas, 1)
    for peer in peers:
        for name in SHAPES:
            assert torch.equal(peer.theta[name], theta[name]), (peer.rank, name)
    assert not torch.equal(unweighted["w"], theta["w"])


def test_a_slow_worker_stops_at_the_deadline_and_its_partial_rounds_count(patient_lighthouse,
                                                                        small_dataset,
                                                                        tmp_path):
    """Worker 2 of 3 turns thirty times slower from round 2 on (alive and heartbeating: a
    throttled machine; ray_entry's "slow" fault; ten times was too close to the deadline on a
    loaded machine, where the others' measured steps carry more overhead than its own): from
    then its inner steps stop at the
    straggler deadline (1.5 times the fastest worker's usual time) instead of holding the
    others, it contributes to every round, its replicas' steps are recorded (fewer than H), and
    every worker ends with plain_loop.run_over_quorums' θ over the recorded contributors and
    steps, bit for bit. Its replicas take one step each at least, 30 times as long as the
    others' (up to 3 s late on a loaded machine): the lighthouse waits for it (with the usual
    2 s join timeout it was left out of rounds there, and healed)."""
    lighthouse = patient_lighthouse
    from isoloco_ray.workers import plain_loop
    from isoloco_ray.workers.ray_entry import FaultHooks

    cfg = trainer_config(4, "--inner.steps=6")
    records: dict[int, dict] = {}
    slow = FaultHooks(f"0:5:slow=30/600:{tmp_path / 'slowed'}")  # after round 1's steps
    trainers = [seated_trainer(cfg, small_dataset, rank, lighthouse,
                               report=lambda m, _, writer: writer and records.update(
                                   {m["round"]: m}),
                               after_replica=slow if rank == 2 else None,
                               after_step=slow.after_step if rank == 2 else None)
                for rank in range(3)]
    run_seated(trainers)
    rounds = [records[j] for j in range(1, cfg.run.rounds + 1)]
    assert all(m["contributors"] == [0, 1, 2] for m in rounds)
    steps = [m["replica_steps"] for m in rounds]
    assert steps[0] == [6] * 6  # no measurement yet: no deadline
    assert all(0 < taken < 6 for later in steps[1:] for taken in later[4:]), steps
    expected = plain_loop.run_over_quorums(cfg, small_dataset, [[0, 1, 2]] * cfg.run.rounds,
                                           steps)
    for trainer in trainers:
        for name, value in expected.items():
            assert torch.equal(trainer.global_params[name], value), (trainer.env.rank, name)


@pytest.mark.parametrize("args", [
    ["--outer.strategy=sparseloco"],
    ["--outer.strategy=tsv", "--outer.comm_dtype=int8", "--outer.error_feedback=true"],
    ["--outer.strategy=diloco", "--outer.topk=0.25", "--outer.error_feedback=true",
     "--outer.error_decay=0.9"],
    ["--outer.strategy=isoc", "--outer.comm_dtype=float8"],
    ["--outer.strategy=ties", "--outer.prune=random", "--outer.comm_dtype=int4",
     "--outer.topk=0.25", "--outer.placement=replicated"],
], ids=["sparseloco", "tsv-int8-feedback", "diloco-topk-decay", "isoc-float8", "ties-int4"])
def test_a_compressed_wire_over_a_quorum_is_the_one_process_step_on_it(lighthouse, args):
    """Each worker's payload crosses as the codec's bytes (with its replicas' residuals where
    error feedback is on): 3 workers, replica 3 diverged in round 1, worker 2 gone in round 2.
    Every survivor's θ, and its replicas' residuals, are the one-process outer step's on the
    same wire (OuterSync.step with every replica's residual) with the missing replicas left
    out as diverged, bit for bit; and at a layer's size a worker's payload is fewer words
    than its float32 values."""
    outer = load_config([*args, "--outer.lr=0.7", "--scaling.replicas=6"]).outer.quorum_outer()
    assert outer.lossy_wire
    reference, theta = OuterSync(outer, REPLICAS, seed=0), seeded(0)
    residuals = {r: {} for r in range(REPLICAS)} if outer.error_feedback else None

    def one_process_step(round_index: int, workers: list[int], good: list[int]) -> None:
        reference.step(theta, {r: seeded(100 * round_index + r) for r in range(REPLICAS)},
                       round_index, diverged=set(range(REPLICAS)) - set(good),
                       feedback=residuals)

    peers = lose_a_worker_after_round_1(outer, lighthouse, theta, one_process_step)
    for peer in peers[:2]:
        if residuals is not None:
            for r, residual in (peer.feedback or {}).items():
                assert residual.keys() == residuals[r].keys() == set(SHAPES)
                for name in SHAPES:
                    assert torch.equal(residual[name], residuals[r][name]), (r, name)
    # At a layer's size (not these few entries, where codes' statistics weigh most).
    shapes = [torch.Size((256, 256)), torch.Size((256,))]
    dense = HOSTED * sum(shape.numel() for shape in shapes)
    assert quorum_numel(outer, shapes, HOSTED) < dense


def test_the_quorum_runs_every_placement_as_every_worker_merging():
    """A run's sharded or rank-0 placement means owners in a fixed group; over a quorum every
    worker merges what it gathered (its peers may be gone)."""
    for placement in ("sharded", "rank0"):
        outer = load_config(["--outer.strategy=isoc", "--scaling.replicas=6",
                             f"--outer.placement={placement}"]).outer
        sync = QuorumSync(outer, REPLICAS, seed=0)
        assert sync.outer.placement == "replicated" and sync.route.everyone_merges



def trainer_config(rounds: int, *args: str):
    """Tiny Trainers of 2 replicas each, 3 workers, whole batches (as the plain loop)."""
    return load_config(["--model.preset=tiny", "--inner.steps=3", f"--run.rounds={rounds}",
                        "--data.seq_len=64", "--data.batch_size=4", "--data.micro_batch_size=4",
                        "--run.eval_tokens=512", f"--run.eval_every={rounds}",
                        "--scaling.replicas=6", "--scaling.replicas_per_worker=2", *args])


def seated_trainer(cfg, data_dir, rank: int, lighthouse: str, report=None, after_replica=None,
                   read_rows=None, after_step=None):
    """Worker `rank`'s Trainer (no process group) with a quorum seat that heals through it."""
    from isoloco_ray.data.stream import read_with_pyarrow
    from isoloco_ray.workers.quorum.replica_mode import seated_trainer as seated
    from isoloco_ray.workers.worker_env import WorkerEnv

    env = WorkerEnv(rank=rank, world=3, device=torch.device("cpu"),
                    read_rows=read_rows or read_with_pyarrow,
                    report=report or (lambda metrics, _, writer: None), after_replica=after_replica,
                    after_step=after_step)
    return seated(cfg, data_dir, env, lighthouse, timeout=timedelta(seconds=30),
                  quorum_timeout=timedelta(seconds=60))


def test_trainers_syncing_over_a_quorum_train_as_the_plain_loop_over_quorums(lighthouse,
                                                                           small_dataset):
    """3 Trainers (2 replicas each), one per thread, each with a quorum seat and no process
    group: every round's outer step goes through the quorum, and each ends with the θ of
    plain_loop.run_over_quorums with every worker in every round, bit for bit; each worker
    scores the whole eval set and reports the quorum's loss."""
    from isoloco_ray.workers import plain_loop

    cfg = trainer_config(rounds=3)
    reports: list[list[dict]] = [[] for _ in range(3)]
    writers: list[set[int]] = [set() for _ in range(3)]  # the rounds each recorded

    def report(rank: int, metrics: dict, writer: bool) -> None:
        reports[rank].append(metrics)
        if writer:
            writers[rank].add(metrics["round"])

    trainers = [seated_trainer(cfg, small_dataset, rank, lighthouse,
                               report=lambda metrics, _, writer, rank=rank:
                               report(rank, metrics, writer))
                for rank in range(3)]
    summaries = run_seated(trainers)
    lines = sorted((m for m in reports[0] if m["round"] > 0), key=lambda m: m["round"])
    expected = plain_loop.run_over_quorums(cfg, small_dataset, [[0, 1, 2]] * cfg.run.rounds,
                                           [m["replica_steps"] for m in lines])
    for trainer in trainers:
        for name, value in expected.items():
            assert torch.equal(trainer.global_params[name], value), name
    assert len({s["final_eval_loss"] for s in summaries}) == 1  # the whole set, everywhere
    for round_index in (1, 2, 3):
        lines = [next(m for m in mine if m["round"] == round_index) for mine in reports]
        assert len({m["loss"] for m in lines}) == 1 and lines[0]["dropped_replicas"] == []
        assert (lines[0]["quorum"], lines[0]["contributors"], lines[0]["sync_attempts"]) == \
            ([0, 1, 2], [0, 1, 2], 1)
    # One worker records each round's progress: the lowest in its quorum.
    assert writers == [{0, 1, 2, 3}, set(), set()]


class Lost(Exception):
    """A worker's death, in a test."""


def replaced(lost, died: threading.Event, build: Callable[[], Any],
             built: threading.Event | None = None):
    """(run `lost` until it dies, build its replacement once `died` is set, setting `built`,
    and run it, the replacement once built: a list): the threads of a lost worker."""
    replacement: list[Any] = []

    def lost_worker() -> None:
        with pytest.raises(Lost):
            lost.run()

    def replace() -> dict:
        assert died.wait(60)
        replacement.append(build())
        if built is not None:
            built.set()
        return replacement[0].run()

    return lost_worker, replace, replacement


# float32 sums; and SparseLoCo's wire (each replica's 2-bit payload and residual; a quarter of
# each chunk, as a few rounds of a tiny model need to move).
@pytest.mark.parametrize("wire", [[], ["--outer.strategy=sparseloco", "--outer.topk=0.25"]],
                         ids=["float32", "sparseloco"])
def test_a_lost_trainer_is_replaced_and_the_run_goes_on_as_the_plain_loop_over_its_quorums(
        lighthouse, small_dataset, wire):
    """Worker 1 of 3 dies mid-round 2 (after one of its replicas' inner steps): the others'
    sync goes on without it, a fresh Trainer for rank 1 joins a later sync, is healed there
    (θ, outer momentum, counters) and its replicas rejoin (with SparseLoCo's wire: from zero
    residuals). Every worker, the replacement too, ends with the θ of
    plain_loop.run_over_quorums over the quorums that happened (worker 0's round metrics;
    which round the replacement joins depends on timing), bit for bit."""
    from isoloco_ray.workers import plain_loop
    from isoloco_ray.workers.loop import Trainer

    cfg = trainer_config(4, *wire)
    died = threading.Event()

    reports: list[dict] = []

    def worker(rank: int, after_replica=None) -> Trainer:
        report = (lambda metrics, _, writer: reports.append(metrics)) if rank == 0 else None
        return seated_trainer(cfg, small_dataset, rank, lighthouse, report=report,
                              after_replica=after_replica)

    def die(round_index: int, replica: int) -> None:
        if (round_index, replica) == (1, 2):  # mid-round 2 (0-based 1)
            trainers[1].env.seat.shutdown()
            died.set()
            raise Lost

    trainers = [worker(0), worker(1, after_replica=die), worker(2)]
    lost_worker, replace, replacement = replaced(trainers[1], died, lambda: worker(1))
    try:
        summary_0, _, summary_2, summary_1 = in_threads(
            trainers[0].run, lost_worker, trainers[2].run, replace, timeout=120)
    finally:
        for trainer in trainers + replacement:
            trainer.env.seat.shutdown()
    rounds = [m["contributors"] for m in reports if m["round"] > 0]
    assert len(rounds) == cfg.run.rounds and rounds[0] == [0, 1, 2] and rounds[1] == [0, 2]
    assert rounds[-1] == [0, 1, 2]  # the replacement took part before the end
    expected = plain_loop.run_over_quorums(cfg, small_dataset, rounds,
                                           [m["replica_steps"] for m in reports if m["round"] > 0])
    for trainer in (trainers[0], trainers[2], replacement[0]):
        for name, value in expected.items():
            assert torch.equal(trainer.global_params[name], value), (trainer.env.rank, name)
    assert summary_0["rounds"] == summary_1["rounds"] == summary_2["rounds"] == cfg.run.rounds


def test_rank_0_lost_in_the_last_round_loses_no_record_and_a_random_mask_merge_survives(
        lighthouse, small_dataset, tmp_path):
    """TIES with random masks (keyed by round), 3 workers: worker 0, the lowest rank, dies in
    the last round and its replacement joins that round's sync (the survivors hold their sync
    until it is there). The replacement is healed and merges with the sync's round, not the
    round it started at, so every worker ends with plain_loop.run_over_quorums' θ, bit for bit.
    Every round is recorded exactly once, the last by survivor 1 (the replacement only joined
    it) naming worker 0 as missing; the last checkpoint is complete (the replacement adds its
    replicas' files: those it rejoins with)."""
    from isoloco_ray.workers import plain_loop
    from isoloco_ray.workers.loop import Trainer
    from isoloco_ray.workers.state import checkpoint

    cfg = trainer_config(3, "--outer.strategy=ties", "--outer.prune=random",
                         "--run.checkpoint_every=3")
    last = cfg.run.rounds - 1
    replacement_built, died = threading.Event(), threading.Event()
    recorded: list[tuple[str, int]] = []  # (worker, round) of every writer's report
    steps: dict[int, list[int]] = {}  # each round's replica_steps
    last_record: list[dict] = []

    def report(name: str, metrics: dict, directory, writer: bool) -> None:
        if writer:
            recorded.append((name, metrics["round"]))
            steps[metrics["round"]] = metrics.get("replica_steps")
            if metrics["round"] == cfg.run.rounds:
                last_record.append(metrics)
        if directory is not None:
            shutil.copytree(directory, tmp_path / f"round_{metrics['round']}",
                            dirs_exist_ok=True)

    def worker(rank: int, name: str, after_replica=None) -> Trainer:
        return seated_trainer(cfg, small_dataset, rank, lighthouse,
                              report=lambda m, d, w: report(name, m, d, w),
                              after_replica=after_replica)

    def die(round_index: int, replica: int) -> None:
        if (round_index, replica) == (last, 0):
            trainers[0].env.seat.shutdown()
            died.set()
            raise Lost

    def wait_for_replacement(round_index: int, replica: int) -> None:
        if round_index == last and replica % 2 == 1:  # before the last sync
            assert replacement_built.wait(60)
            time.sleep(0.5)  # it asks for its quorum first

    trainers = [worker(0, "0", die), worker(1, "1", wait_for_replacement),
                worker(2, "2", wait_for_replacement)]
    lost_worker, replace, replacement = replaced(trainers[0], died, lambda: worker(0, "0 again"),
                                                 built=replacement_built)
    try:
        _, summary_1, summary_2, summary_0 = in_threads(
            lost_worker, trainers[1].run, trainers[2].run, replace, timeout=120)
    finally:
        for trainer in trainers + replacement:
            trainer.env.seat.shutdown()
    assert sorted(r for _, r in recorded) == list(range(cfg.run.rounds + 1)), recorded
    assert ("1", cfg.run.rounds) in recorded
    (record,) = last_record
    assert (record["quorum"], record["contributors"], record["missing_workers"]) == \
        ([0, 1, 2], [1, 2], [0])
    expected = plain_loop.run_over_quorums(cfg, small_dataset, [[0, 1, 2], [0, 1, 2], [1, 2]],
                                           [steps[j] for j in (1, 2, 3)])
    for trainer in (trainers[1], trainers[2], replacement[0]):
        for name, value in expected.items():
            assert torch.equal(trainer.global_params[name], value), (trainer.env.rank, name)
    assert "error" not in summary_1 and summary_1["rounds"] == cfg.run.rounds
    assert summary_0["rounds"] == summary_2["rounds"] == cfg.run.rounds
    assert checkpoint.checkpoint_problems(tmp_path / f"round_{cfg.run.rounds}") == []


def test_a_replica_run_resumes_from_its_newest_stored_checkpoint_as_if_never_stopped(
        lighthouse, small_dataset, tmp_path):
    """A replica run's checkpoints (ftcheckpoint_<round>/ in its run directory, each worker
    adding its files through QuorumReports, as under Ray Train) resume it: three fresh
    workers, whose first sync finds nobody under way, restore the newest intact one from
    storage (not from a peer), take the rounds after it, and end with the θ of the run never
    stopped, bit for bit (every worker in every round). The Ray path to the same functions:
    workers/quorum/replica_mode.py's train_replica_worker."""
    from isoloco_ray import run_files
    from isoloco_ray.workers.quorum.replica_mode import QuorumReports, restore_newest
    from isoloco_ray.workers.state import checkpoint

    # Whole rounds only (no straggler deadline): the uninterrupted run is then one θ.
    cfg = trainer_config(4, "--run.checkpoint_every=2", "--run.keep_checkpoints=4",
                         "--scaling.straggler_deadline=null")
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    recorded: dict[int, dict] = {}  # each round's record, by its writer

    def attempt() -> tuple[list, list[int]]:
        """Three workers, each joining, restoring if the run starts with them, and training:
        the trainers, and the round each started after."""
        reports = QuorumReports(run_dir, None, cfg.run.keep_checkpoints)

        def report(metrics: dict, directory, writer: bool) -> None:
            if writer and metrics["round"] > 0:
                recorded[metrics["round"]] = metrics
            reports(metrics, directory, writer)

        trainers = [seated_trainer(cfg, small_dataset, rank, lighthouse, report=report)
                    for rank in range(3)]
        started = [0] * 3

        def start(rank: int) -> dict:
            trainer = trainers[rank]
            if trainer.join():
                error, warning = restore_newest(trainer, run_dir)
                assert error is None and warning is None
            started[rank] = trainer.round
            return trainer.run()

        try:
            summaries = in_threads(*[lambda rank=rank: start(rank) for rank in range(3)],
                                   timeout=120)
        finally:
            for trainer in trainers:
                trainer.env.seat.shutdown()
        assert all("error" not in summary for summary in summaries)
        return trainers, started

    whole, started = attempt()
    assert started == [0, 0, 0]
    stored = sorted(path.name for path in run_dir.iterdir())
    assert stored == [run_files.FT_CHECKPOINT.format(round=r) for r in (2, 4)]
    # As after a stop in round 3: the round-4 checkpoint was never written.
    shutil.rmtree(run_dir / run_files.FT_CHECKPOINT.format(round=4))
    assert checkpoint.checkpoint_problems(
        run_dir / run_files.FT_CHECKPOINT.format(round=2)) == []
    resumed, started = attempt()
    assert started == [2, 2, 2]
    assert all((m["contributors"], m["replica_steps"]) == ([0, 1, 2], [3] * 6)
               for m in recorded.values())  # every worker, whole rounds: the plain run
    assert {parameters_sha256(trainer) for trainer in resumed} == {parameters_sha256(whole[0])}


def test_a_worker_that_falls_behind_alive_is_healed_and_rejoins_where_the_round_puts_it(
        lighthouse, small_dataset):
    """Worker 2 stalls in round 2 (alive, heartbeating) for longer than the lighthouse waits:
    the others sync without it and go on; when it reaches a sync it is behind, is healed there
    and its replicas rejoin as a replacement's do (LR schedule and data stream where the round
    puts them, not where it stopped). Every worker ends with plain_loop.run_over_quorums' θ
    over the contributors recorded, bit for bit, and worker 2 contributes again."""
    from isoloco_ray.workers import plain_loop

    cfg = trainer_config(6)
    records: list[dict] = []

    def stall(round_index: int, replica: int) -> None:
        if (round_index, replica) == (1, 5):
            time.sleep(3)  # the fixture's lighthouse waits 2 s for a member still missing

    def pace(round_index: int, replica: int) -> None:
        if replica % 2:  # rounds of 0.7 s: the others are still under way when it comes
            time.sleep(0.7)

    trainers = [seated_trainer(cfg, small_dataset, rank, lighthouse,
                               report=lambda m, _, writer: writer and records.append(m),
                               after_replica=stall if rank == 2 else pace)
                for rank in range(3)]
    run_seated(trainers)
    rounds = sorted((m for m in records if m["round"] > 0), key=lambda m: m["round"])
    assert [m["round"] for m in rounds] == [1, 2, 3, 4, 5, 6]
    contributors = [m["contributors"] for m in rounds]
    assert contributors[1] == [0, 1] and contributors[-1] == [0, 1, 2], contributors
    expected = plain_loop.run_over_quorums(cfg, small_dataset, contributors,
                                           [m["replica_steps"] for m in rounds])
    for trainer in trainers:
        for name, value in expected.items():
            assert torch.equal(trainer.global_params[name], value), (trainer.env.rank, name)


def test_a_data_error_on_one_worker_stops_every_worker_with_its_message(lighthouse,
                                                                        small_dataset):
    """Worker 2's data fails after round 1 (as a bad shard would): its sync carries the reason
    to the others', and every worker stops with the same message, naming worker 2 and the
    round, as the workers of restart mode do; nothing of that round is applied."""
    from isoloco_ray.data.format import DataError
    from isoloco_ray.data.stream import read_with_pyarrow

    cfg = trainer_config(4)
    broken = threading.Event()

    def read_rows(ranges):
        for blocks in read_with_pyarrow(ranges):  # a shard's rows at a time, as they are read
            if broken.is_set():
                raise DataError("train/part-00001.parquet: token id 99999 >= vocabulary 384")
            yield blocks

    def after_round_1(round_index: int, replica: int) -> None:
        if (round_index, replica) == (0, 5):
            broken.set()

    trainers = [seated_trainer(cfg, small_dataset, rank, lighthouse,
                               after_replica=after_round_1 if rank == 2 else None,
                               read_rows=read_rows if rank == 2 else None)
                for rank in range(3)]
    summaries = run_seated(trainers)
    errors = {summary.get("error") for summary in summaries}
    assert len(errors) == 1, summaries
    (error,) = errors
    assert error.startswith("worker 2 in round ") and error.endswith(
        ": train/part-00001.parquet: token id 99999 >= vocabulary 384"), error
    assert len({summary["rounds"] for summary in summaries}) == 1
    assert len({parameters_sha256(trainer) for trainer in trainers}) == 1


def test_a_seat_listens_outside_loopback_only_where_torchft_gives_no_choice(lighthouse,
                                                                           monkeypatch):
    """Two seats that have synced (their store, process group and Manager all up): the one
    listener outside loopback per seat is torchft 0.2.0's manager server, which binds
    [::]:<port> with no option for the address (docs/fault_tolerance.md, "Sockets")."""
    from isoloco_ray import local_ray

    monkeypatch.setenv("GLOO_SOCKET_IFNAME", "lo")  # as local_ray sets it for Ray's workers
    workers = [Worker(rank, lighthouse) for rank in range(2)]
    try:
        in_threads(*[lambda w=w: w.seat.sync(w.contribution(1)) for w in workers])
        outside = sorted(local_ray.non_loopback_listeners([os.getpid()]))
        servers = sorted(int(w.seat.manager._manager.address().rsplit(":", 1)[1])
                         for w in workers)
        assert [entry.split()[:2] for entry in outside] == [["tcp", f"[::]:{port}"]
                                                            for port in servers], outside
    finally:
        for worker in workers:
            worker.seat.shutdown()


def test_workers_whose_parameters_differ_all_stop_at_the_sync(lighthouse):
    """Each sync compares the participants' fingerprints (taken after healing): a worker whose
    global parameters differ from the others' would merge into another model, so every
    participant stops, naming each rank's fingerprint."""
    digests = ["ab" * 32, "ab" * 32, "cd" * 32]
    workers = [Worker(rank, lighthouse, fingerprint=lambda rank=rank: digests[rank])
               for rank in range(3)]
    try:
        for (outcome,) in in_threads(*[lambda w=w: _raised(lambda: w.seat.sync(
                w.contribution(1))) for w in workers]):
            assert isinstance(outcome, WorkersDiffer)
            assert f"2: {'cd' * 12}" in str(outcome) and f"0: {'ab' * 12}" in str(outcome)
    finally:
        for worker in workers:
            worker.seat.shutdown()


def test_workers_at_different_rounds_all_stop_at_the_sync(lighthouse):
    """The round each participant is at (read after healing, so a healed worker is at its
    peer's) keys the merge's random masks: participants at different rounds stop, all of them,
    naming each rank's round; at the same round the sync commits with that round."""
    rounds = [4, 4, 5]
    workers = [Worker(rank, lighthouse) for rank in range(3)]
    for worker, value in zip(workers, rounds):
        worker.seat.current_round = lambda value=value: value
    try:
        for (outcome,) in in_threads(*[lambda w=w: _raised(lambda: w.seat.sync(
                w.contribution(1), round_index=9)) for w in workers]):
            assert isinstance(outcome, WorkersDiffer)
            assert "different rounds (by rank: 0: 4, 1: 4, 2: 5)" in str(outcome)
        workers[2].seat.current_round = lambda: 4
        for result in in_threads(*[lambda w=w: w.seat.sync(w.contribution(2), round_index=9)
                                   for w in workers]):
            assert result.round == 4 and result.writer == 0 and result.round_taken
    finally:
        for worker in workers:
            worker.seat.shutdown()


def _raised(call: Callable[[], Any]) -> tuple[BaseException | None]:
    """(what `call` raised,) or (None,): a result in_threads does not re-raise."""
    try:
        call()
    except BaseException as exc:  # noqa: BLE001 - what the test inspects
        return (exc,)
    return (None,)


def test_trainers_merging_every_replica_over_a_quorum_end_as_one_process_hosting_them_all(
        lighthouse, small_dataset):
    """TSV (a merge of every Δ_r) on 3 seated Trainers: each worker's 2 Δ_r travel through
    the quorum and every worker merges all 6 in replica order, so each ends, bit for bit,
    where one process hosting all 6 replicas (restart mode's layout V = 6) ends."""
    from isoloco_ray.workers.local import run_local

    cfg = trainer_config(2, "--outer.strategy=tsv", "--scaling.straggler_deadline=null")
    alone = cfg.model_copy(update={"scaling": cfg.scaling.model_copy(
        update={"replicas_per_worker": 6})})
    expected = run_local(alone, small_dataset)[0]["model_sha256"]
    assert seated_run(cfg, small_dataset, lighthouse) == [expected] * 3


def test_a_replica_run_without_failures_is_the_restart_run_of_its_layout(lighthouse,
                                                                         small_dataset):
    """isoloco on 3 seated Trainers, nobody lost, against restart mode's 3 gloo processes
    (its route for a spectral merge: each rank's sum to the tensor's owner, added in rank
    order, as the quorum adds them): the same parameters, bit for bit (no straggler deadline:
    its cuts depend on timing, restart mode has none)."""
    from isoloco_ray.workers.local import run_local

    cfg = trainer_config(2, "--outer.strategy=isoloco", "--scaling.straggler_deadline=null")
    restart = run_local(cfg, small_dataset)[0]["model_sha256"]
    assert seated_run(cfg, small_dataset, lighthouse) == [restart] * 3


def seated_run(cfg, data_dir, lighthouse: str) -> list[str]:
    """Each worker's final parameters' sha256 after 3 seated Trainers ran `cfg`, nobody lost."""
    trainers = [seated_trainer(cfg, data_dir, rank, lighthouse) for rank in range(3)]
    run_seated(trainers)
    return [parameters_sha256(trainer) for trainer in trainers]


def run_seated(trainers: list) -> list[dict]:
    """Each Trainer's `run` on a thread of its own; their summaries. Their seats are shut
    down afterwards, however the runs ended."""
    try:
        return in_threads(*[trainer.run for trainer in trainers], timeout=120)
    finally:
        for trainer in trainers:
            trainer.env.seat.shutdown()


def parameters_sha256(trainer) -> str:
    """The sha256 of a Trainer's global parameters."""
    from isoloco_ray.workers.state import checkpoint

    return checkpoint.parameters_sha256(trainer.global_params)


def test_a_seat_goes_with_a_seated_trainer_only(small_dataset):
    """The plain Trainer has no quorum code: given a seat it refuses it rather than ignore it,
    and a SeatedTrainer without one is refused too, before anything is built."""
    from dataclasses import replace

    from isoloco_ray.workers.local import local_env
    from isoloco_ray.workers.loop import Trainer
    from isoloco_ray.workers.quorum.seated_trainer import SeatedTrainer

    cfg = load_config(["--model.preset=tiny", "--scaling.replicas_per_worker=4"])
    with pytest.raises(ValueError, match=r"^a Trainer takes no quorum seat \(WorkerEnv.seat\): "
                                         r"a worker with a seat runs a SeatedTrainer"):
        Trainer(cfg, small_dataset, replace(local_env(), seat=object()))
    with pytest.raises(ValueError, match=r"^a SeatedTrainer needs a quorum seat"):
        SeatedTrainer(cfg, small_dataset, local_env())
