"""Local gloo groups (workers.local.in_gloo_group): kept processes behave as fresh spawns, and a
failing rank is reported with its traceback, its processes replaced."""

from __future__ import annotations

import os

import pytest
import torch
import torch.distributed as dist

from isoloco_ray.workers import local
from isoloco_ray.workers.local import GroupFailed, in_gloo_group, keep_processes


def what_a_rank_sees(rank: int, world: int) -> tuple:
    total = torch.tensor([float(rank + 1)])
    dist.all_reduce(total)
    return (rank, world, total.item(), os.environ.get("ISOLOCO_TEST_MARK"), os.getcwd(),
            torch.get_num_threads())


def rank_one_fails(rank: int, world: int) -> None:
    if rank == 1:
        raise ValueError("rank one's own error")
    dist.barrier()


def test_kept_processes_are_fresh_spawns_for_each_group(tmp_path, monkeypatch):
    """The parent's environment and directory of each call and the threads asked for: what
    processes spawned for the call see."""
    with keep_processes():  # (the session's, from conftest, where there are)
        first = in_gloo_group(what_a_rank_sees, 2)
        monkeypatch.setenv("ISOLOCO_TEST_MARK", "set after the processes started")
        monkeypatch.chdir(tmp_path)
        second = in_gloo_group(what_a_rank_sees, 2, threads=2)
    monkeypatch.setattr(local, "_kept", None)  # none kept: spawned for the call
    fresh = in_gloo_group(what_a_rank_sees, 2, threads=2)
    for rank in range(2):
        assert first[rank][:3] == (rank, 2, 3.0) and first[rank][3] is None
        assert second[rank][3:5] == ("set after the processes started", str(tmp_path))
        assert second[rank][5] == 2 and first[rank][5] == 1
        assert second[rank] == fresh[rank]


def test_a_failing_rank_is_reported_and_its_group_replaced():
    with keep_processes():
        with pytest.raises(GroupFailed, match=r"(?s)rank 1 of 2 failed:.*rank one's own error"):
            in_gloo_group(rank_one_fails, 2)
        assert [r[2] for r in in_gloo_group(what_a_rank_sees, 2)] == [3.0, 3.0]
