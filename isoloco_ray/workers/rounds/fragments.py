"""Streaming outer sync (`outer.fragments`, `outer.delay`): which parameters each fragment
holds, and when, within a round, each fragment's sync starts and when its update lands.

The semantics (docs/strategies.md, "Streaming fragments"): with H inner steps per round and P
fragments, fragment p's sync starts after the global inner steps t with (t − p·H/P) % H == 0,
and its update lands `delay` inner steps later. Round r holds the inner steps rH+1 … rH+H.
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import torch

_LAYER = re.compile(r"(?:^|\.)layers\.(\d+)\.")


def split_fragments(shapes: Mapping[str, torch.Size], fragments: int
                    ) -> list[tuple[str, ...]]:
    """The tensors of `shapes` (model order) in `fragments` runs of whole transformer layers,
    balanced by size (the largest fragment as small as possible): the tensors before the first
    layer (the embedding) go with the first layer, those after the last (final norm, head)
    with the last. Raises ValueError when the model has fewer layers than fragments."""
    units: list[list[str]] = []
    lead: list[str] = []
    current = None
    for name in shapes:
        found = _LAYER.search(name)
        if found is not None and found.group(1) != current:
            current = found.group(1)
            units.append([])
        (units[-1] if units else lead).append(name)
    if fragments == 1:
        return [tuple(shapes)]
    if len(units) < fragments:
        raise ValueError(f"outer.fragments ({fragments}) exceeds the model's {len(units)} "
                         "transformer layers (a fragment is whole layers): lower "
                         "outer.fragments")
    units[0][:0] = lead  # everything after the last layer is in units[-1] already
    sizes = [sum(shapes[name].numel() for name in unit) for unit in units]
    cuts = _balanced_cuts(sizes, fragments)
    return [tuple(name for unit in units[start:end] for name in unit)
            for start, end in zip([0, *cuts], [*cuts, len(units)])]


def _balanced_cuts(sizes: Sequence[int], parts: int) -> list[int]:
    """The parts−1 cut points splitting `sizes` into contiguous non-empty runs whose largest
    sum is the smallest possible (dynamic programming; ties: the earliest cuts)."""
    n = len(sizes)
    prefix = [0]
    for size in sizes:
        prefix.append(prefix[-1] + size)
    # best[k][i]: the smallest largest-run sum of sizes[:i] in k runs; cut[k][i]: its last cut.
    best = [[float("inf")] * (n + 1) for _ in range(parts + 1)]
    cut = [[0] * (n + 1) for _ in range(parts + 1)]
    best[0][0] = 0
    for k in range(1, parts + 1):
        for i in range(k, n + 1):
            for j in range(k - 1, i):
                cost = max(best[k - 1][j], prefix[i] - prefix[j])
                if cost < best[k][i]:
                    best[k][i], cut[k][i] = cost, j
    cuts, i = [], n
    for k in range(parts, 1, -1):
        i = cut[k][i]
        cuts.append(i)
    return cuts[::-1]


@dataclass(frozen=True)
class SyncEvent:
    """One moment of a fragment's sync within a round."""

    step: int  # after this many of the round's inner steps (0: before its first)
    fragment: int
    starts: bool  # True: the pseudo-gradients are taken and sent; False: the update lands
    sync_round: int  # the round whose steps end where the sync starts (keys its random streams)


def round_events(round_index: int, rounds: int, steps: int, fragments: int, delay: int
                 ) -> list[SyncEvent]:
    """The sync events of round `round_index` (0-based) of `rounds`, in the order they happen.

    Fragment 0's sync starts after the round's last step. With delay > 0 it lands `delay`
    steps into the next round, so it is listed there, at step 0 (same moment: nothing runs in
    between), except after the last round, where it starts and lands at once. That leaves
    every round's end with no sync in flight: evaluations and checkpoints are taken there.
    """
    offset = steps // fragments
    events = []
    if delay and round_index > 0:
        events += [SyncEvent(0, 0, True, round_index - 1),
                   SyncEvent(delay, 0, False, round_index - 1)]
    for p in range(1, fragments):
        events += [SyncEvent(p * offset, p, True, round_index),
                   SyncEvent(p * offset + delay, p, False, round_index)]
    if not delay or round_index == rounds - 1:
        events += [SyncEvent(steps, 0, True, round_index),
                   SyncEvent(steps, 0, False, round_index)]
    return events
