"""Gradients averaged over a group while backward runs (workers/parallel/gradient_average.py): the
plain all-reduce after backward, bit for bit, with the buckets started during backward."""

from __future__ import annotations

import torch
from torch import nn

from isoloco_ray.workers.local import in_gloo_group
from isoloco_ray.workers.parallel.collectives import TrafficCounter, all_reduce_sum
from isoloco_ray.workers.parallel.gradient_average import GradientAverage

BUCKET_BYTES = 4 * 300  # a few tensors per bucket: several buckets for a small model


def small_model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Embedding(20, 8), nn.Linear(8, 16), nn.GELU(), nn.Linear(16, 8),
                         nn.LayerNorm(8), nn.Linear(8, 20))


def backward(model: nn.Module, rank: int, micro_batches: int,
             average: GradientAverage | None) -> None:
    """Gradients of this rank's rows, accumulated over micro-batches (the last one armed)."""
    tokens = torch.randint(0, 20, (4 * micro_batches, 6),
                           generator=torch.Generator().manual_seed(rank))
    for index, micro in enumerate(tokens.split(4)):
        loss = model(micro).logsumexp(-1).mean() / micro_batches
        if average is not None and index == micro_batches - 1:
            average.arm()
        loss.backward()


def averaged(rank: int, world: int, micro_batches: int) -> dict:
    """This rank's averaged gradients, by GradientAverage and by all-reduce after backward;
    how many buckets started during backward, and the bytes counted."""
    results = {}
    for overlapped in (True, False):
        model = small_model()
        traffic = TrafficCounter()
        average = GradientAverage(list(model.parameters()), None, world, traffic,
                                  bucket_bytes=BUCKET_BYTES)
        backward(model, rank, micro_batches, average if overlapped else None)
        if overlapped:
            average.finish()
        else:
            grads = [p.grad for p in model.parameters()]
            all_reduce_sum(grads, traffic, bucket_bytes=BUCKET_BYTES)  # the same buckets
            for grad in grads:
                grad /= world
        results[overlapped] = {"grads": [p.grad.clone() for p in model.parameters()],
                               "bytes": traffic.take(),
                               "buckets": len(average.buckets),
                               "in_backward": average.started_in_backward}
    return results


def test_overlapped_average_is_the_all_reduce_after_backward_bit_for_bit():
    """3 ranks (a sum whose order depends on the buckets), 2 micro-batches: the same bits as
    all-reducing the same buckets after backward, every bucket started during backward,
    the same bytes counted, and the mean of the ranks' gradients."""
    ranks = in_gloo_group(averaged, 3, 2)
    for result in ranks:
        overlapped, plain = result[True], result[False]
        assert overlapped["buckets"] >= 3
        assert overlapped["in_backward"] == overlapped["buckets"]
        assert overlapped["bytes"] == plain["bytes"] > 0
        for got, want in zip(overlapped["grads"], plain["grads"]):
            assert torch.equal(got, want)
    # The mean of what each rank computed alone.
    alone = []
    for rank in range(3):
        model = small_model()
        backward(model, rank, 2, None)
        alone.append([p.grad for p in model.parameters()])
    for index, got in enumerate(ranks[0][True]["grads"]):
        mean = sum(grads[index] for grads in alone) / 3
        torch.testing.assert_close(got, mean, rtol=0, atol=1e-7)


def test_one_rank_only_divides_and_zero_missing_fills_gradients():
    model = small_model()
    average = GradientAverage(list(model.parameters()), None, 4, zero_missing=True)
    average.arm()
    average.finish()  # no backward ran (a data error): zeros join the sum
    assert all(torch.equal(p.grad, torch.zeros_like(p)) for p in model.parameters())
    backward(model, 0, 1, None)
    want = [p.grad.clone() / 4 for p in model.parameters()]
    average.arm()
    average.finish()
    for p, expected in zip(model.parameters(), want):
        assert torch.equal(p.grad, expected)


def average_without_backward_on_rank_1(rank: int, world: int) -> list[list[torch.Tensor]]:
    """Two steps in which rank 1 reads no batch (adamw_ddp after a data error): rank 0's
    gradients before and after each average."""
    model = small_model()
    average = GradientAverage(list(model.parameters()), None, world, zero_missing=True,
                              bucket_bytes=BUCKET_BYTES)
    seen = []
    for _ in range(2):  # the second step starts from the state the first left
        model.zero_grad(set_to_none=True)
        if rank == 0:
            backward(model, rank, 1, average)
            seen.append([p.grad.clone() for p in model.parameters()])
        average.finish()
        seen.append([p.grad.clone() for p in model.parameters()])
    return seen


def test_a_rank_without_backward_joins_the_sum_with_zeros():
    rank0, rank1 = in_gloo_group(average_without_backward_on_rank_1, 2)
    for step in range(2):
        before, after = rank0[2 * step], rank0[2 * step + 1]
        for own, mean, other in zip(before, after, rank1[step]):
            assert torch.equal(mean, own / 2) and torch.equal(other, mean)
