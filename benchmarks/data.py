"""Data path throughput and memory: prepare (tokens/s, by engine and --workers) against the
tokenizer's own ceiling, and the replica stream (tokens/s into one worker), with the peak RSS
of each, for synthetic corpora of growing size.

    python benchmarks/data.py --tokens 10e6 100e6 --workers 1 2

Untimed set-up: the corpus is written as parquet source files (about 2 M words each, as
`prepare --source DIR` reads them), and one BPE tokenizer (4,096 tokens) is trained on its
text, used by every row, so the rows compare the same text and tokenizer.

- ceiling: the tokenizer's own `encode_batch_fast` on that text in batches of prepare's size,
  on 1 thread and on W threads (RAYON_NUM_THREADS); only the encode calls are timed (the text
  is read from the same files between them).
- prepare local / ray: end to end, from reading the source files to the last shard and
  meta.json, with W tokenizer processes / Ray actors of one tokenizer thread each. The Ray
  engine's local cluster is started first and its start-up time shown apart ("ray start").
- driver alone: what the driver does for both engines (route, pack, write shards), timed on
  batches tokenized beforehand: the bound of the Ray engine however many actors tokenize.

Each measurement runs in a fresh subprocess; "peak RSS" is the largest resident set of any one
of its processes (the driver, or a tokenizing process). Training consumption to compare
against: the demo model on 2 CPU cores takes ~5.6 k tokens/s (measured on a 2-core CPU); a 178M
model on one H100 at ~40% MFU of 989 bf16 TFLOP/s takes ~370 k tokens/s (6 * 178e6 FLOP per
token).
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from isoloco_ray.testing import exit_after

TRAINING_TOKENS_PER_S = {"demo (2.9M, 2 CPU cores)": 5.6e3, "178M (1 H100, 40% MFU)": 3.7e5}
WORDS_PER_FILE = 2_000_000


def _peak_rss_mb() -> float:
    own = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    children = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss
    return max(own, children) / 1024


def child_corpus(words: int, out: str) -> dict:
    """Synthetic documents of about `words` words as parquet files of WORDS_PER_FILE words."""
    import itertools

    import pyarrow as pa
    import pyarrow.parquet as pq

    from isoloco_ray.testing import streamed_documents

    documents = streamed_documents(words)
    Path(out).mkdir(parents=True)
    for number in itertools.count():
        batch, made = [], 0
        for text in documents:
            batch.append(text)
            made += text.count(" ") + 1
            if made >= WORDS_PER_FILE:
                break
        if not batch:
            break
        pq.write_table(pa.table({"text": batch}), Path(out) / f"part-{number:04d}.parquet")
    return {}


def child_tokenizer(source_dir: str, out: str) -> dict:
    import itertools

    from isoloco_ray.data.prepare import encoding
    from isoloco_ray.data.prepare.sources import open_source

    documents = open_source(source_dir).documents()
    sample = itertools.islice(documents, 4000)  # about 1 M words
    encoding.save_tokenizer(encoding.train_bpe_tokenizer(sample, 4096), Path(out))
    return {}


def child_ceiling(source_dir: str, tokenizer_dir: str) -> dict:
    from transformers import AutoTokenizer

    from isoloco_ray.data.prepare import encoding, tokenizing
    from isoloco_ray.data.prepare.sources import open_source

    encoder = encoding.encoder(AutoTokenizer.from_pretrained(tokenizer_dir))
    documents = open_source(source_dir).documents()
    tokens, seconds = 0, 0.0
    while batch := [text for _, text in zip(range(tokenizing.CORPUS_BATCH), documents)]:
        start = time.perf_counter()
        encoded = encoder.encode_batch_fast(batch, add_special_tokens=False)
        seconds += time.perf_counter() - start
        tokens += sum(len(e.ids) + 1 for e in encoded)  # + EOS, as prepare counts
    return {"tokens": tokens, "seconds": seconds, "tokens_per_s": tokens / seconds,
            "peak_rss_mb": _peak_rss_mb()}


def child_prepare(source_dir: str, engine: str, workers: int, out: str,
                  tokenizer_dir: str) -> dict:
    from isoloco_ray.data.prepare import corpus
    from isoloco_ray.data.prepare.sources import open_source

    ray_start = 0.0
    if engine == "ray":
        from isoloco_ray.local_ray import start_local_cluster

        start = time.perf_counter()
        start_local_cluster(workers)
        ray_start = time.perf_counter() - start
    source = open_source(source_dir)
    settings = corpus.CorpusSettings(source=source.name, tokenizer=tokenizer_dir,
                                      block_len=2048, shard_blocks=(1 << 22) // 2048)
    start = time.perf_counter()
    meta = corpus.prepare_corpus(source, out, settings, workers=workers, engine=engine)
    seconds = time.perf_counter() - start
    if engine == "ray":
        import ray

        ray.shutdown()  # its processes' peak RSS then counts among the children's
    total = sum(meta.split(s).tokens + meta.split(s).dropped_tokens
                for s in ("train", "valid", "test"))
    return {"tokens": total, "seconds": seconds, "tokens_per_s": total / seconds,
            "ray_start": ray_start, "peak_rss_mb": _peak_rss_mb()}


def child_driver(source_dir: str, out: str, tokenizer_dir: str) -> dict:
    """The driver's share alone (route, pack, write the shards) on batches tokenized
    beforehand: the throughput no number of tokenizing actors can exceed."""
    from transformers import AutoTokenizer

    from isoloco_ray.data.prepare import corpus, encoding, tokenizing
    from isoloco_ray.data.prepare.sources import open_source

    tokenizer = AutoTokenizer.from_pretrained(tokenizer_dir)
    source = open_source(source_dir)
    batches = list(tokenizing.local_tokenized_batches(source.documents_from(0, 0),
                                                      encoding.backend_json(tokenizer),
                                                      tokenizer.eos_token_id, None, 1))
    settings = corpus.CorpusSettings(source=source.name, tokenizer=tokenizer_dir,
                                      block_len=2048, shard_blocks=(1 << 22) // 2048)
    Path(out).mkdir()
    start = time.perf_counter()
    run = corpus._Run(Path(out), settings)
    for batch in batches:
        run.add_batch(batch)
    meta = run.finish(tokenizer, None)
    seconds = time.perf_counter() - start
    total = sum(meta.split(s).tokens + meta.split(s).dropped_tokens
                for s in ("train", "valid", "test"))
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


CHILD_TIMEOUT = 3600.0  # seconds: main() sets it from --timeout


def run_child(*args: str, threads: int | None = None) -> dict:
    env = dict(os.environ)
    if threads is not None:  # the tokenizers crate's thread pool
        env["RAYON_NUM_THREADS"] = str(threads)
    out = subprocess.run([sys.executable, __file__, "--child", *args], check=True,
                         capture_output=True, text=True, env=env,
                         timeout=CHILD_TIMEOUT)
    return json.loads(out.stdout.strip().splitlines()[-1])


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--tokens", type=float, nargs="+", default=[10e6])
    p.add_argument("--workers", type=int, nargs="+", default=sorted({1, 2, os.cpu_count() or 1}))
    p.add_argument("--engines", nargs="+", default=["local", "ray"], choices=["local", "ray"])
    p.add_argument("--child", nargs="+", help=argparse.SUPPRESS)
    p.add_argument("--timeout", type=float, default=3600,
                   help="seconds before the benchmark stops with its stacks (a hang)")
    args = p.parse_args()
    global CHILD_TIMEOUT
    CHILD_TIMEOUT = args.timeout
    exit_after(args.timeout)
    if args.child:
        kind, *rest = args.child
        children = {"corpus": lambda: child_corpus(int(rest[0]), rest[1]),
                    "tokenizer": lambda: child_tokenizer(rest[0], rest[1]),
                    "ceiling": lambda: child_ceiling(rest[0], rest[1]),
                    "prepare": lambda: child_prepare(rest[0], rest[1], int(rest[2]), rest[3],
                                                     rest[4]),
                    "driver": lambda: child_driver(rest[0], rest[1], rest[2]),
                    "stream": lambda: child_stream(rest[0])}
        print(json.dumps(children[kind]()))
        return
    cores = os.cpu_count() or 1
    print("| what | corpus tokens | workers | tokens/s | x ceiling | seconds | ray start s "
          "| peak RSS MB |")
    print("|---|---|---|--:|--:|--:|--:|--:|")
    with tempfile.TemporaryDirectory() as tmp:
        tokenizer_dir = str(Path(tmp) / "tokenizer")
        for tokens in args.tokens:
            source_dir = str(Path(tmp) / f"source-{int(tokens)}")
            run_child("corpus", str(int(tokens)), source_dir)
            if not Path(tokenizer_dir).exists():
                run_child("tokenizer", source_dir, tokenizer_dir)
            ceilings = {}
            for threads in sorted({min(workers, cores) for workers in args.workers}):
                r = run_child("ceiling", source_dir, tokenizer_dir, threads=threads)
                ceilings[threads] = r["tokens_per_s"]
                print(f"| ceiling: encode_batch, {threads} thread{'s' * (threads > 1)} | "
                      f"{tokens:.0e} | - | {r['tokens_per_s']:,.0f} | 1.00 | "
                      f"{r['seconds']:.1f} | - | {r['peak_rss_mb']:.0f} |", flush=True)
            for engine in args.engines:
                for workers in args.workers:
                    out = str(Path(tmp) / f"ds-{int(tokens)}-{engine}-{workers}")
                    # One tokenizer thread per worker: W workers use W cores.
                    r = run_child("prepare", source_dir, engine, str(workers), out,
                                  tokenizer_dir, threads=1)
                    ceiling = ceilings[min(workers, cores)]
                    start = f"{r['ray_start']:.1f}" if engine == "ray" else "-"
                    print(f"| prepare, {engine} | {tokens:.0e} | {workers} | "
                          f"{r['tokens_per_s']:,.0f} | {r['tokens_per_s'] / ceiling:.2f} | "
                          f"{r['seconds']:.1f} | {start} | {r['peak_rss_mb']:.0f} |", flush=True)
            r = run_child("driver", source_dir, str(Path(tmp) / f"ds-{int(tokens)}-driver"),
                          tokenizer_dir)
            print(f"| driver alone: route, pack, write | {tokens:.0e} | - | "
                  f"{r['tokens_per_s']:,.0f} | - | {r['seconds']:.1f} | - | "
                  f"{r['peak_rss_mb']:.0f} |", flush=True)
            r = run_child("stream", out)
            print(f"| stream (pyarrow, 1 replica) | {tokens:.0e} | - | {r['tokens_per_s']:,.0f} "
                  f"| - | {r['seconds']:.1f} | - | {r['peak_rss_mb']:.0f} |", flush=True)
            for kept in [source_dir, *Path(tmp).glob(f"ds-{int(tokens)}-*")]:
                shutil.rmtree(kept)  # one size on disk at a time
    for name, rate in TRAINING_TOKENS_PER_S.items():
        print(f"training consumes: {name}: {rate:,.0f} tokens/s")


if __name__ == "__main__":
    main()
