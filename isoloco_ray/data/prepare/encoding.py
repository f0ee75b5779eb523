"""Tokenizers for prepared data: a byte-level BPE trained on the corpus, saving it beside the
shards, and the raw Rust encoder that turns documents into token streams ([BOS] ids EOS).
"""

from __future__ import annotations

import itertools
import json
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

from isoloco_ray.data.format import DataError

if TYPE_CHECKING:
    from tokenizers import Tokenizer
    from transformers import PreTrainedTokenizerBase

EOS_TOKEN = "<|endoftext|>"
ENCODE_BATCH = 1024  # documents per encode_batch call: enough to keep the Rust side busy


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


def encoder(tokenizer: PreTrainedTokenizerBase) -> Tokenizer:
    """A private copy of the fast tokenizer's Rust backend, set up to encode raw documents."""
    return encoder_from_json(backend_json(tokenizer))


def backend_json(tokenizer: PreTrainedTokenizerBase) -> str:
    """The fast tokenizer's Rust backend as JSON (what a tokenizing process needs)."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is None:
        raise DataError(f"{type(tokenizer).__name__} is not a fast (Rust-backed) tokenizer")
    return backend.to_str()


def encoder_from_json(tokenizer_json: str) -> Tokenizer:
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
    enc = encoder(tokenizer)
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
