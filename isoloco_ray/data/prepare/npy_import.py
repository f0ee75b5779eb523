"""The research code's ready token arrays (``prepare --from-npy``): its
``{train,valid,test}_NNNNNN.npy`` files converted into shards without tokenizing again.
"""

from __future__ import annotations

import itertools
import os
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from isoloco_ray.data.format import (
    SPLITS,
    TOKENIZER_DIR,
    DataError,
    DatasetMeta,
    SplitInfo,
    shard_name,
    write_blocks,
)
from isoloco_ray.data.prepare.corpus import DEFAULT_SHARD_TOKENS, CorpusSettings, resolve_tokenizer
from isoloco_ray.data.prepare.encoding import save_tokenizer
from isoloco_ray.data.prepare.sources import TextSource, npy_token_files
from isoloco_ray.data.prepare.staging import NOTHING_KEPT_NPY, locked, staged


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
    with locked(out_dir), staged(out_dir, overwrite, NOTHING_KEPT_NPY) as staging:
        save_tokenizer(tok, staging / TOKENIZER_DIR)
        splits = {s: _convert_npy_split(files[s], staging, s, tok.eos_token_id, vocab,
                                        block_len, shard_blocks) for s in SPLITS}
        meta = DatasetMeta(
            source=f"{source.name}; tokenizer {tokenizer}", tokenizer=TOKENIZER_DIR,
            vocab_size=vocab, eos_id=tok.eos_token_id, bos_id=tok.bos_token_id,
            pad_id=tok.pad_token_id, block_len=block_len, seed=0, splits=splits)
        meta.save(staging)
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
