"""Validation loss of the global model: token-weighted mean NLL over a fixed set of sequences.

Every worker takes part: rank w scores sequences w, w+W, ...; the NLL sums and token counts are
all-reduced, so the result does not depend on the number of workers.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from upath import UPath

from isoloco_ray.data.format import read_blocks
from isoloco_ray.workers.model import Runtime
from isoloco_ray.workers.parallel.collectives import all_reduce_scalars


def eval_sequences(valid_files: Sequence[Path | UPath], seq_len: int, max_tokens: int
                   ) -> torch.Tensor:
    """The first sequences of the valid split covering at most `max_tokens` (at least one)."""
    wanted = max(1, max_tokens // seq_len)
    sequences: list[np.ndarray] = []
    for path in valid_files:
        blocks = read_blocks(path)
        per_block = blocks.shape[1] // seq_len
        sequences.extend(blocks[:, : per_block * seq_len].reshape(-1, seq_len))
        if len(sequences) >= wanted:
            break
    if not sequences:
        raise ValueError("the valid split holds no sequence of data.seq_len tokens")
    return torch.from_numpy(np.stack(sequences[:wanted]).astype(np.int64))


@torch.no_grad()
def evaluate(runtime: Runtime, sequences: torch.Tensor, rank: int, world: int,
             batch_size: int) -> float:
    """Mean next-token NLL (nats/token) of the runtime's model over `sequences`, shared among
    the ranks."""
    model = runtime.forward
    model.eval()
    nll_sum = torch.zeros((), dtype=torch.float64, device=runtime.device)
    tokens = 0
    for batch in sequences[rank::world].split(batch_size):
        batch = runtime.to_device(batch)
        with runtime.autocast():
            logits = model(input_ids=batch).logits[:, :-1]
        targets = batch[:, 1:]
        nll_sum += F.cross_entropy(logits.float().reshape(-1, logits.size(-1)),
                                   targets.reshape(-1), reduction="sum")
        tokens += targets.numel()
    nll_total, token_total = all_reduce_scalars([nll_sum.item(), tokens], runtime.device)
    model.train()
    return nll_total / token_total


def perplexity(loss: float) -> float:
    """exp(loss), capped so a diverged run prints inf rather than overflowing."""
    return math.exp(loss) if loss < 700 else math.inf
