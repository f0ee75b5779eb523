"""A list of documents in memory as a prepared dataset (``prepare_dataset``): the demo corpus
(``ensure_demo_data``, prepared on first use) and the tests' small corpora.

1. Split by document, deterministically from ``seed``: shuffle, then the first documents go to
   valid and test until each holds its fraction of the characters, the rest to train. The
   shuffled order is also the packing order, so every train shard mixes all sources.
   Streamed corpora (corpus.py) split by a per-document hash instead, as a stream cannot be
   shuffled without holding it. Two rules on purpose: the demo's corpus is its sources one
   after the other (Shakespeare's works, then wiki pages), which a shuffle spreads evenly over
   every shard, and moving it to the hash would change the demo's bytes and every figure
   measured on it.
2. Tokenizer: a given Hugging Face tokenizer, or a byte-level BPE trained on the train documents
   only. Saved to ``DIR/tokenizer``.
3. Each document is tokenized (in batches) with EOS appended; the split's token stream is cut
   into blocks of ``block_len``; the tail that does not fill a block is dropped and counted.
4. Blocks are written ``shard_blocks`` to a parquet shard; ``meta.json`` last.

Written through staging.py: a staging directory renamed into place, a lock against concurrent
preparers.
"""

from __future__ import annotations

import os
import random
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from isoloco_ray.config import ConfigError
from isoloco_ray.data.format import SPLITS, TOKENIZER_DIR, DataError, DatasetMeta, verify
from isoloco_ray.data.prepare import demo
from isoloco_ray.data.prepare.encoding import save_tokenizer, train_bpe_tokenizer
from isoloco_ray.data.prepare.packing import write_split
from isoloco_ray.data.prepare.staging import NOTHING_KEPT, check_replaceable, locked, staged

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

    from isoloco_ray.config import TrainConfig

# The demo's recipe. Its train split is ~50 shards, so training can give each of up to ~50
# replicas whole shards of similar data.
DEMO_SETTINGS: dict[str, Any] = dict(
    vocab_size=8192, block_len=128, shard_blocks=512,
    valid_fraction=0.0125, test_fraction=0.0125, seed=0)


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
    with locked(out_dir):
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
    with staged(out_dir, overwrite, NOTHING_KEPT) as staging:
        return _build(documents, staging, tokenizer, vocab_size, block_len, shard_blocks,
                      valid_fraction, test_fraction, seed, source_name)


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


def default_demo_dir(cache_dir: Path | None = None) -> Path:
    """Where the demo dataset lives: ``<cache root>/demo``."""
    return (cache_dir if cache_dir is not None else demo.cache_root()) / "demo"


def prepare_demo(out_dir: Path, *, overwrite: bool = False, cache_dir: Path | None = None,
                 **settings: Any) -> DatasetMeta:
    """Download (or reuse) the demo corpus and prepare it in ``out_dir``. ``settings`` override
    DEMO_SETTINGS (vocab_size, block_len, shard_blocks, valid_fraction, test_fraction, seed)."""
    options = {**DEMO_SETTINGS, **settings}
    check_replaceable(Path(out_dir).expanduser().absolute(), overwrite)  # before downloading
    documents = list(demo.iter_demo_documents(demo.download_dir(cache_dir)))
    return prepare_dataset(documents, out_dir, source_name=demo.DEMO_SOURCE,
                           overwrite=overwrite, **options)


def ensure_demo_data(cache_dir: Path | None = None) -> Path:
    """Return the prepared demo dataset directory (``<cache root>/demo``), preparing it on first
    use and reusing it afterwards. A cached directory that is incomplete, fails the cheap
    verification or comes from another demo recipe is prepared again."""
    out_dir = default_demo_dir(cache_dir).expanduser().absolute()
    with locked(out_dir):
        if is_current_demo(out_dir):
            return out_dir
        # A dataset (of another recipe, or damaged) is replaced; anything else is refused,
        # before downloading.
        check_replaceable(out_dir, overwrite=True)
        documents = list(demo.iter_demo_documents(demo.download_dir(cache_dir)))
        _prepare_locked(documents, out_dir, source_name=demo.DEMO_SOURCE, overwrite=True,
                        **DEMO_SETTINGS)
    return out_dir


# The model sizes the demo corpus (8k BPE, 128-token blocks) is meant for; a larger model never
# falls back to it silently.
DEMO_CORPUS_PRESETS = ("tiny", "demo")


def check_demo_fallback(cfg: TrainConfig) -> None:
    """ConfigError when data.path is unset for a model the demo corpus is not meant for."""
    if cfg.data.path is None and cfg.model.preset not in DEMO_CORPUS_PRESETS:
        raise ConfigError(
            f"data.path: unset, and the demo corpus is for the tiny and demo models, not "
            f"model.preset {cfg.model.preset}; set data.path to a prepared dataset (python -m "
            "isoloco_ray.data.prepare)")


def ensure_demo_for(cfg: TrainConfig) -> None:
    """Prepare the demo corpus now (on first use; ensure_demo_data) when `cfg` trains on it
    (data.path unset); ConfigError first for a model it is not meant for."""
    if cfg.data.path is None:
        check_demo_fallback(cfg)
        ensure_demo_data()


def is_current_demo(out_dir: Path, settings: dict[str, Any] | None = None) -> bool:
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
