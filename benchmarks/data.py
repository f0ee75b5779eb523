"""Data path throughput and memory: prepare (tokens/s, by --workers) against the tokenizer's
own ceiling, and the replica stream (tokens/s into one worker), with the peak RSS of each for
synthetic corpora of growing size.

    python benchmarks/data.py --tokens 10e6 100e6 --workers 1 2

One BPE tokenizer (4,096 tokens) is trained first on the corpus text and used by every row,
so the rows compare the same text and tokenizer. The ceiling is the tokenizer's own
`encode_batch_fast` on that text in batches of prepare's size, on 1 thread and on every core
(RAYON_NUM_THREADS), with nothing else: no text generation, no packing, no writing. prepare's
rows are end to end (documents made on the fly, tokenized, packed, shards written).

Each measurement runs in a fresh subprocess so its peak RSS (its own plus its tokenizing
processes') is its own. Training consumption to compare against: the demo model on 2 CPU cores
takes ~5.6 k tokens/s (measured on a 2-core CPU); a 178M model on one H100 at ~40% MFU of 989 bf16
TFLOP/s takes ~370 k tokens/s (6 * 178e6 FLOP per token).
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

TRAINING_TOKENS_PER_S = {"demo (2.9M, 2 CPU cores)": 5.6e3, "178M (1 H100, 40% MFU)": 3.7e5}
def _peak_rss_mb() -> float:
    own = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    children = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss
    return max(own, children) / 1024


def child_tokenizer(out: str) -> dict:
    from isoloco_ray.data import encoding
    from isoloco_ray.testing import streamed_documents

    start = time.perf_counter()
    tokenizer = encoding.train_bpe_tokenizer(streamed_documents(1_000_000), 4096)
    encoding.save_tokenizer(tokenizer, Path(out))
    return {"seconds": time.perf_counter() - start}


def child_ceiling(tokens: int, tokenizer_dir: str) -> dict:
    import itertools

    from transformers import AutoTokenizer

    from isoloco_ray.data import corpus, encoding
    from isoloco_ray.testing import streamed_documents

    encoder = encoding.encoder(AutoTokenizer.from_pretrained(tokenizer_dir))
    documents = list(streamed_documents(tokens))
    batches = [documents[i:i + corpus.CORPUS_BATCH]
               for i in range(0, len(documents), corpus.CORPUS_BATCH)]
    start = time.perf_counter()
    total = sum(len(encoded.ids) + 1 for encoded in itertools.chain.from_iterable(
        encoder.encode_batch_fast(batch, add_special_tokens=False) for batch in batches))
    seconds = time.perf_counter() - start
    return {"tokens": total, "seconds": seconds, "tokens_per_s": total / seconds,
            "peak_rss_mb": _peak_rss_mb()}


def child_prepare(tokens: int, workers: int, out: str, tokenizer_dir: str) -> dict:
    from isoloco_ray.data import corpus
    from isoloco_ray.data.sources import TextSource
    from isoloco_ray.testing import streamed_documents

    source = TextSource(f"synthetic {tokens}", lambda: streamed_documents(tokens))
    settings = corpus.CorpusSettings(source=source.name, tokenizer=tokenizer_dir,
                                      block_len=2048, shard_blocks=(1 << 22) // 2048)
    start = time.perf_counter()
    meta = corpus.prepare_corpus(source, out, settings, workers=workers)
    seconds = time.perf_counter() - start
    total = sum(meta.split(s).tokens for s in ("train", "valid", "test"))
    return {"tokens": total, "seconds": seconds, "tokens_per_s": total / seconds,
            "peak_rss_mb": _peak_rss_mb()}


def child_stream(data_dir: str) -> dict:
    from isoloco_ray.data.stream import ReplicaStream, read_with_pyarrow, replica_share

    share = replica_share(Path(data_dir), 0, 1)
    stream = ReplicaStream(share, read_with_pyarrow, seq_len=2048, batch_size=8)
    batches = max(1, share.rows // 8)  # one epoch
    start = time.perf_counter()
    n = 0
    for _ in range(batches):
        n += stream.next_batch().numel()
    seconds = time.perf_counter() - start
    return {"tokens": n, "seconds": seconds, "tokens_per_s": n / seconds,
            "peak_rss_mb": _peak_rss_mb()}


def run_child(*args: str, threads: int | None = None) -> dict:
    env = dict(os.environ)
    if threads is not None:  # the tokenizers crate's thread pool
        env["RAYON_NUM_THREADS"] = str(threads)
    out = subprocess.run([sys.executable, __file__, "--child", *args], check=True,
                         capture_output=True, text=True, env=env)
    return json.loads(out.stdout.strip().splitlines()[-1])


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--tokens", type=float, nargs="+", default=[10e6])
    p.add_argument("--workers", type=int, nargs="+", default=sorted({1, 2, os.cpu_count() or 1}))
    p.add_argument("--child", nargs="+", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.child:
        kind, *rest = args.child
        children = {"tokenizer": lambda: child_tokenizer(rest[0]),
                    "ceiling": lambda: child_ceiling(int(rest[0]), rest[1]),
                    "prepare": lambda: child_prepare(int(rest[0]), int(rest[1]), rest[2],
                                                     rest[3]),
                    "stream": lambda: child_stream(rest[0])}
        print(json.dumps(children[kind]()))
        return
    cores = os.cpu_count() or 1
    print("| what | corpus tokens | workers | tokens/s | x ceiling | seconds | peak RSS MB |")
    print("|---|---|---|---|---|---|---|")
    with tempfile.TemporaryDirectory() as tmp:
        tokenizer_dir = str(Path(tmp) / "tokenizer")
        run_child("tokenizer", tokenizer_dir)
        for tokens in args.tokens:
            ceilings = {}
            for threads in sorted({min(workers, cores) for workers in args.workers}):
                r = run_child("ceiling", str(int(tokens)), tokenizer_dir, threads=threads)
                ceilings[threads] = r["tokens_per_s"]
                print(f"| ceiling: encode_batch, {threads} thread{'s' * (threads > 1)} | "
                      f"{tokens:.0e} | - | {r['tokens_per_s']:,.0f} | 1.00 | "
                      f"{r['seconds']:.1f} | {r['peak_rss_mb']:.0f} |", flush=True)
            for workers in args.workers:
                out = str(Path(tmp) / f"ds-{int(tokens)}-{workers}")
                # One tokenizer thread per worker process: W workers use W cores.
                r = run_child("prepare", str(int(tokens)), str(workers), out, tokenizer_dir,
                              threads=1)
                ceiling = ceilings[min(workers, cores)]
                print(f"| prepare | {tokens:.0e} | {workers} | {r['tokens_per_s']:,.0f} | "
                      f"{r['tokens_per_s'] / ceiling:.2f} | {r['seconds']:.1f} | "
                      f"{r['peak_rss_mb']:.0f} |", flush=True)
            r = run_child("stream", out)
            print(f"| stream (pyarrow, 1 replica) | {tokens:.0e} | - | {r['tokens_per_s']:,.0f} "
                  f"| - | {r['seconds']:.1f} | {r['peak_rss_mb']:.0f} |", flush=True)
    for name, rate in TRAINING_TOKENS_PER_S.items():
        print(f"training consumes: {name}: {rate:,.0f} tokens/s")


if __name__ == "__main__":
    main()
