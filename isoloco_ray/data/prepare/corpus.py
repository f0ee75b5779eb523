"""Real corpora (``prepare --source``): streamed, split by a per-document hash, tokenized in a
process pool, packed and sharded as they come, resumable.

prepare_corpus streams documents instead of holding them: each document's split is decided on
its own (a hash of seed and document index), documents are tokenized in a process pool a batch
at a time, packed, and shards are written as they fill, so memory is bounded by three shards'
worth of blocks (one open shard per split), never by the corpus. The work happens in a fixed
sibling directory ``.NAME.partial``; after each batch that completed a shard, a progress file
records the shards done, the next document index and every split's unwritten tokens, so a
re-run with the same arguments continues from there (shards already written are kept; a shard
written after the last progress record is simply written again, identically).
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import itertools
import json
import os
import shutil
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from isoloco_ray import strict_json
from isoloco_ray.data.format import (
    SPLITS,
    TOKENIZER_DIR,
    DataError,
    DatasetMeta,
    ShardInfo,
    SplitInfo,
)
from isoloco_ray.data.prepare.encoding import (
    backend_json,
    save_tokenizer,
    train_bpe_tokenizer,
)
from isoloco_ray.data.prepare.packing import BlockPacker, ShardWriter
from isoloco_ray.data.prepare.sources import TextSource
from isoloco_ray.data.prepare.staging import NOTHING_KEPT, check_replaceable, locked, publish
from isoloco_ray.data.prepare.tokenizing import TokenizedBatch, local_tokenized_batches

PROGRESS_FILE = "progress.json"
DEFAULT_SHARD_TOKENS = 1 << 24      # 16 M tokens = 64 MB of int32 per shard
DEFAULT_BPE_CHARS = 50_000_000      # text a train-bpe tokenizer learns from
ENGINES = ("local", "ray")


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
        self.file_documents: list[int] = []  # documents routed from each source file, so far
        self.given = {s: 0 for s in SPLITS}  # tokens given to each split: written or pending
        self.packers = {s: BlockPacker(settings.block_len) for s in SPLITS}
        self.writers = {s: ShardWriter(staging / s, settings.shard_blocks) for s in SPLITS}
        self.targets = {"valid": settings.valid_tokens, "test": settings.test_tokens,
                        "train": settings.total_tokens}

    def tokens(self, split: str) -> int:
        """Tokens given to a split so far (written, queued and in the packer)."""
        return self.given[split]

    def done(self) -> bool:
        """Whether train holds its --total-tokens (then no more documents are read)."""
        target = self.targets["train"]
        return target is not None and self.given["train"] >= target

    def assign(self, index: int) -> str:
        s = self.settings
        split = document_split(s.seed, index, s.valid_fraction, s.test_fraction)
        target = self.targets[split]
        if split != "train" and target is not None and self.given[split] >= target:
            return "train"  # valid/test are full: the document is train's, still disjoint
        return split

    def resume_point(self) -> tuple[int, int]:
        """(source file, documents of it already routed): where reading goes on."""
        if not self.file_documents:
            return 0, 0
        return len(self.file_documents) - 1, self.file_documents[-1]

    def add_batch(self, batch: TokenizedBatch) -> None:
        """Route a tokenized batch document by document (each split keeps the documents'
        order); stops early once train is full."""
        ends = np.cumsum(batch.lengths)
        spans: dict[str, list[np.ndarray]] = {s: [] for s in SPLITS}
        start = 0
        for end, file in zip(ends.tolist(), batch.files.tolist()):
            if self.done():
                break
            split = self.assign(self.next_document)
            spans[split].append(batch.stream[start:end])
            self.given[split] += end - start
            self.documents[split] += 1
            self.next_document += 1
            count_document(self.file_documents, file)
            start = end
        for split, pieces in spans.items():
            if pieces:
                self.writers[split].add(self.packers[split].add(np.concatenate(pieces)))

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
                    "documents": self.documents, "file_documents": self.file_documents,
                    "shards": {s: [i.model_dump() for i in self.writers[s].shards]
                               for s in SPLITS}}
        strict_json.write(self.staging / PROGRESS_FILE, progress, indent=1)
        for old in self.staging.glob("carry-*.npz"):
            if old.name != name:
                old.unlink()

    def restore(self, progress: dict[str, Any]) -> None:
        self.next_document = progress["next_document"]
        self.documents = progress["documents"]
        self.file_documents = progress["file_documents"]
        with np.load(self.staging / progress["carry"]) as carry:
            for s in SPLITS:
                self.writers[s].shards = [ShardInfo(**i) for i in progress["shards"][s]]
                self.writers[s].add(self.packers[s].add(carry[s]))
                written = sum(i.rows for i in self.writers[s].shards)
                self.given[s] = written * self.settings.block_len + len(carry[s])

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
                   *, workers: int | None = 1, engine: str = "local", overwrite: bool = False,
                   progress: bool = False) -> DatasetMeta:
    """Prepare a streamed corpus in ``out_dir`` (format.py), resuming an unfinished run of the
    same settings; return its meta. ``engine``: "local" tokenizes in ``workers`` processes
    here, "ray" on ``workers`` Ray actors (ray_tokenize.py); None: one per CPU (of the
    cluster, for "ray"). Both write the same bytes, and either can resume the other's
    unfinished run. See the comment at the top of this module
    for the guarantees."""
    if engine not in ENGINES:
        raise ValueError(f"engine {engine!r}: use one of {', '.join(ENGINES)}")
    if engine == "ray" and not source.files:
        raise DataError(f"--engine ray reads local files, and {source.name} is not: download "
                        "its parquet files to a folder every node can read and pass that folder "
                        "as --source, or use --engine local")
    out_dir = Path(out_dir).expanduser().absolute()
    with locked(out_dir):
        check_replaceable(out_dir, overwrite)
        staging = partial_dir(out_dir)
        if staging.is_symlink():  # its work would be read, written and deleted through it
            raise DataError(f"{staging} is a symbolic link, not the unfinished preparation "
                            "this command keeps there: remove it, then run the same command "
                            "again")
        saved = _read_progress(staging)
        if saved is not None and saved["fingerprint"] != settings.fingerprint():
            if not overwrite:
                raise DataError(
                    f"{staging} holds an unfinished preparation with other settings "
                    f"({_settings_diff(saved['settings'], settings)}); run the same command again "
                    "to finish it, or pass --overwrite to discard it")
            saved = None
        try:
            meta = _prepare_into(staging, saved, source, settings, workers, engine, progress)
            publish(staging, out_dir, overwrite)
        except BaseException as e:
            e.add_note(_keep_if_resumable(staging, settings))
            raise
    return meta


def _prepare_into(staging: Path, saved: dict[str, Any] | None, source: TextSource,
                  settings: CorpusSettings, workers: int | None, engine: str,
                  progress: bool) -> DatasetMeta:
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
        if "file_documents" not in saved:  # recorded by a version without per-file counts
            saved["file_documents"] = _count_by_file(source, saved["next_document"])
        run.restore(saved)
    else:
        run.save_progress()
    bos_id = uses_bos(tokenizer)
    _stream_into(run, source, tokenizer, bos_id, workers, engine, progress)
    meta = run.finish(tokenizer, bos_id)
    meta.save(staging)
    (staging / PROGRESS_FILE).unlink()
    for carry in staging.glob("carry-*.npz"):
        carry.unlink()
    return meta


def _count_by_file(source: TextSource, documents: int) -> list[int]:
    """How many of the first ``documents`` documents each source file holds."""
    counts: list[int] = []
    for file, _ in itertools.islice(source.documents_from(0, 0), documents):
        count_document(counts, file)
    return counts


def count_document(counts: list[int], file: int) -> None:
    """One more document of source file ``file`` in ``counts`` (a count per file)."""
    counts.extend([0] * (file + 1 - len(counts)))
    counts[file] += 1


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
                 workers: int | None, engine: str, progress: bool) -> None:
    """Tokenize the documents from the run's resume point on and route them; checkpoint after
    every batch that completed a shard."""
    bar = _ProgressBar(run, source, progress)
    file, skip = run.resume_point()
    encoding = (backend_json(tokenizer), tokenizer.eos_token_id, bos_id)
    written = run.shards_written()
    with contextlib.ExitStack() as stack:
        stack.callback(bar.close)  # ends the bar's line before any message
        if engine == "ray":
            from isoloco_ray.data.prepare import ray_tokenize

            actors = stack.enter_context(ray_tokenize.ray_running(workers))
            batches = ray_tokenize.ray_tokenized_batches(source, file, skip, *encoding, actors)
        else:
            batches = local_tokenized_batches(source.documents_from(file, skip), *encoding,
                                              workers or os.cpu_count() or 1)
        for batch in batches:
            run.add_batch(batch)
            bar.update(run)
            if run.shards_written() != written:
                run.save_progress()
                written = run.shards_written()
            if run.done():
                break


class _ProgressBar:
    """train tokens with tokens/s and an ETA: against --total-tokens, or else against the
    whole source, extrapolated from the bytes of the source files read so far."""

    def __init__(self, run: _Run, source: TextSource, enabled: bool) -> None:
        from tqdm import tqdm

        # Bytes of the source files before each one, and of them all (the last entry).
        self._bytes_before = list(itertools.accumulate(source.file_bytes, initial=0))
        self._target = run.settings.total_tokens
        self._bar = tqdm(total=self._target, initial=run.tokens("train"), unit="tok",
                         unit_scale=True, disable=not enabled, desc="train tokens",
                         file=sys.stderr)

    def update(self, run: _Run) -> None:
        train = run.tokens("train")
        files = len(self._bytes_before) - 1
        if files and run.file_documents:
            files_read = len(run.file_documents) - 1  # the last one may go on
            self._bar.set_postfix_str(f"file {files_read + 1}/{files}", refresh=False)
            read = self._bytes_before[files_read]
            if self._target is None and read:
                self._bar.total = round(train * self._bytes_before[-1] / read)
        self._bar.update(train - self._bar.n)

    def close(self) -> None:
        self._bar.close()


def _read_progress(staging: Path) -> dict[str, Any] | None:
    try:
        return json.loads((staging / PROGRESS_FILE).read_text())
    except (OSError, ValueError):
        return None  # no (or an unreadable) progress file: start over


def _settings_diff(saved: dict[str, Any], settings: CorpusSettings) -> str:
    now = dataclasses.asdict(settings)
    diffs = [f"{k}: {saved.get(k)!r} then, {v!r} now" for k, v in now.items() if saved.get(k) != v]
    return "; ".join(diffs) or "same settings, other version"
