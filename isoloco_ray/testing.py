"""Generated inputs shared by the tests and the benchmarks (no data download, seeded), and the
benchmarks' time bound.

Sentence-like text from a fixed vocabulary: `synthetic_documents` (a list, for small prepared
datasets) and `streamed_documents` (a generator of about N words, for corpora too large to
hold in memory). `exit_after`: a hung Ray, gloo or training call ends a benchmark with its
stacks instead of stalling it.
"""

from __future__ import annotations

import faulthandler
import random
import sys
from collections.abc import Iterator

WORDS = ("the of and to in a is that for it as was with be by on not he this are or his "
         "from at which but have an they you were her she there been one all we their has "
         "would when if so no what up out said who will more some into time could them "
         "river stone light house garden winter letter morning window silver").split()


def synthetic_documents(count: int, seed: int = 0) -> list[str]:
    """`count` documents of 3-12 sentences of 4-14 words, different for every seed."""
    rng = random.Random(seed)
    documents = []
    for _ in range(count):
        sentences = []
        for _ in range(rng.randint(3, 12)):
            words = rng.choices(WORDS, k=rng.randint(4, 14))
            sentences.append(" ".join(words).capitalize() + ".")
        documents.append(" ".join(sentences))
    return documents


def streamed_documents(words: int, seed: int = 0) -> Iterator[str]:
    """Documents of 50-350 words until about `words` words (about as many tokens for a BPE
    trained on them), made on the fly so the corpus never sits in memory."""
    import numpy as np

    rng = np.random.default_rng(seed)
    vocabulary = np.array(WORDS)
    made = 0
    while made < words:
        n = int(rng.integers(50, 350))
        yield " ".join(vocabulary[rng.integers(0, len(vocabulary), n)]) + "."
        made += n + 1


def exit_after(seconds: float) -> None:
    """Ends this process with every thread's stack on stderr and exit status 1 once `seconds`
    have passed (a watchdog thread: it fires also while Python is blocked in C code, where a
    signal handler would wait). Subprocesses need a timeout of their own."""
    if not seconds > 0:
        raise ValueError(f"a time bound must be a positive number of seconds, got {seconds}")
    faulthandler.dump_traceback_later(seconds, exit=True, file=sys.stderr)
