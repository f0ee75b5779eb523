"""Text sources and the streaming corpus preparation: each source kind, the hashed split, the
packing, resume after an interruption, the research .npy conversion, the CLI. Small local files
only; the Hugging Face path runs against a fake ``datasets`` module (no network)."""

from __future__ import annotations

import json
import sys
import types
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from isoloco_ray.data.prepare import corpus as corpus_pipeline
from isoloco_ray.data.prepare import cli as prepare_cli
from isoloco_ray.data.prepare import npy_import, packing, sources, tokenizing
from isoloco_ray.data.checks import check_layout
from isoloco_ray.data.format import SPLITS, DataError, DatasetMeta, read_blocks, split_files, verify
from isoloco_ray.data.stream import replica_share

from isoloco_ray.testing import synthetic_documents

DOCS = synthetic_documents(240, seed=4)
SETTINGS = dict(tokenizer="train-bpe:300", block_len=32, shard_blocks=8, seed=1,
                valid_fraction=0.1, test_fraction=0.1)


def write_sources(root: Path) -> Path:
    """The same 240 documents as .txt files, a .jsonl and a .parquet under one folder."""
    (root / "a_txt").mkdir(parents=True)
    for i, d in enumerate(DOCS[:40]):
        (root / "a_txt" / f"{i:03d}.txt").write_text(d)
    with open(root / "b.jsonl", "w") as f:
        for d in DOCS[40:140]:
            f.write(json.dumps({"text": d, "id": 1}) + "\n")
    pq.write_table(pa.table({"text": DOCS[140:]}), root / "c.parquet")
    (root / ".hidden.txt").write_text("not a document")
    return root


def settings(source: sources.TextSource, **kw) -> corpus_pipeline.CorpusSettings:  # type: ignore[no-untyped-def]
    return corpus_pipeline.CorpusSettings(source=source.name, **{**SETTINGS, **kw})


def test_local_sources_yield_every_document_in_order(tmp_path: Path) -> None:
    src = sources.open_source(str(write_sources(tmp_path / "in")))
    assert list(src.documents()) == DOCS  # a_txt/ sorts before b.jsonl before c.parquet
    assert list(src.documents()) == DOCS  # re-iterable
    assert list(sources.open_source(str(tmp_path / "in" / "b.jsonl")).documents()) == DOCS[40:140]


def test_bad_local_inputs_are_named(tmp_path: Path) -> None:
    (tmp_path / "x.jsonl").write_text('{"body": "hi"}\n')
    with pytest.raises(DataError, match=r"x.jsonl:1: no field 'text'"):
        list(sources.open_source(str(tmp_path / "x.jsonl")).documents())
    pq.write_table(pa.table({"body": ["a"]}), tmp_path / "y.parquet")
    with pytest.raises(DataError, match=r"y.parquet: no column 'text'"):
        list(sources.open_source(str(tmp_path / "y.parquet")).documents())
    with pytest.raises(DataError, match="no such file"):
        sources.open_source("./missing_dir")
    (tmp_path / "empty").mkdir()
    with pytest.raises(DataError, match="holds no"):
        sources.open_source(str(tmp_path / "empty"))


def test_hf_source_streams_through_datasets(monkeypatch: pytest.MonkeyPatch) -> None:
    calls = []

    def load_dataset(name, config=None, split=None, streaming=False):  # type: ignore[no-untyped-def]
        calls.append((name, config, split, streaming))
        return iter([{"text": "one"}, {"text": ""}, {"text": "two"}])

    monkeypatch.setitem(sys.modules, "datasets", types.SimpleNamespace(load_dataset=load_dataset))
    src = sources.open_source("org/corpus:cfg", hf_split="train")
    assert list(src.documents()) == ["one", "two"]
    assert calls == [("org/corpus", "cfg", "train", True)]


def test_hf_source_without_datasets_is_a_clear_error(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "datasets", None)  # import fails
    with pytest.raises(DataError, match=r'pip install -e "\.\[hf\]"'):
        list(sources.open_source("org/corpus").documents())


def test_document_split_is_deterministic_and_sized() -> None:
    labels = [corpus_pipeline.document_split(7, i, 0.1, 0.05) for i in range(4000)]
    assert labels == [corpus_pipeline.document_split(7, i, 0.1, 0.05) for i in range(4000)]
    assert labels != [corpus_pipeline.document_split(8, i, 0.1, 0.05) for i in range(4000)]
    assert 320 < labels.count("valid") < 480 and 130 < labels.count("test") < 270


@pytest.fixture(scope="module")
def corpus(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    root = write_sources(tmp_path_factory.mktemp("src") / "in")
    out = tmp_path_factory.mktemp("prepared") / "ds"
    src = sources.open_source(str(root))
    corpus_pipeline.prepare_corpus(src, out, settings(src))
    return root, out


def test_corpus_split_and_packing(corpus: tuple[Path, Path]) -> None:
    from tokenizers import Tokenizer

    root, out = corpus
    meta = verify(out)
    tok = Tokenizer.from_file(str(out / "tokenizer" / "tokenizer.json"))
    tok.encode_special_tokens = True
    eos = meta.eos_id
    assert meta.bos_id == eos  # our BPE: no BOS inserted
    by_split: dict[str, list[str]] = {s: [] for s in SPLITS}
    for i, d in enumerate(DOCS):
        by_split[corpus_pipeline.document_split(1, i, 0.1, 0.1)].append(d)
    for name in SPLITS:
        stream = np.array([t for d in by_split[name]
                           for t in tok.encode(d, add_special_tokens=False).ids + [eos]])
        info = meta.split(name)
        n = len(stream) // 32
        assert info.documents == len(by_split[name]) and info.blocks == n
        assert info.dropped_tokens == len(stream) % 32
        blocks = np.concatenate([read_blocks(f) for f in split_files(out, name)])
        np.testing.assert_array_equal(blocks.ravel(), stream[:n * 32])
    assert all(s.rows == 8 for s in meta.split("train").shards[:-1])
    assert not (out.parent / ".ds.partial").exists()


def test_rerun_is_idempotent_and_other_settings_refused(corpus: tuple[Path, Path],
                                                        capsys: pytest.CaptureFixture[str]) -> None:
    root, out = corpus
    args = ["--source", str(root), "--tokenizer", "train-bpe:300", "--out", str(out),
            "--block-len", "32", "--shard-blocks", "8", "--seed", "1", "--valid-fraction", "0.1",
            "--test-fraction", "0.1", "--workers", "1", "--quiet"]
    assert prepare_cli.main(args) == 0
    assert "already prepared" in capsys.readouterr().out
    other = [("2" if a == "1" and args[i - 1] == "--seed" else a) for i, a in enumerate(args)]
    assert prepare_cli.main(other) == 2
    assert "--overwrite" in capsys.readouterr().err


def _interrupt_at_write(monkeypatch: pytest.MonkeyPatch, n: int) -> None:
    """The n-th shard write raises KeyboardInterrupt (killed mid-run); batches of 16 documents,
    so progress is recorded between them."""
    real = packing.write_blocks
    calls = {"n": 0}

    def flaky(path, blocks):  # type: ignore[no-untyped-def]
        calls["n"] += 1
        if calls["n"] == n:
            raise KeyboardInterrupt
        return real(path, blocks)

    monkeypatch.setattr(packing, "write_blocks", flaky)
    monkeypatch.setattr(tokenizing, "CORPUS_BATCH", 16)


def _interrupted(src: sources.TextSource, out: Path, engine: str,
                 monkeypatch: pytest.MonkeyPatch) -> dict:
    """Run prepare_corpus into ``out`` until it is killed at its 30th shard write; return the
    progress record it left."""
    with monkeypatch.context() as patch:
        _interrupt_at_write(patch, 30)
        with pytest.raises(KeyboardInterrupt):
            corpus_pipeline.prepare_corpus(src, out, settings(src), engine=engine, workers=2)
    partial = corpus_pipeline.partial_dir(out)
    assert not out.exists() and (partial / "progress.json").is_file()
    assert not list(partial.rglob(".*.tmp"))  # no half-written shard
    progress = json.loads((partial / "progress.json").read_text())
    assert 0 < progress["next_document"] < len(DOCS)
    assert sum(progress["file_documents"]) == progress["next_document"]
    return progress


def test_interrupted_prepare_resumes_to_identical_output(
        corpus: tuple[Path, Path], tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    root, reference = corpus
    src = sources.open_source(str(root))
    out = tmp_path / "ds"
    progress = _interrupted(src, out, "local", monkeypatch)
    # A record without per-file counts (older versions) resumes too: they are counted again.
    partial = corpus_pipeline.partial_dir(out)
    del progress["file_documents"]
    (partial / "progress.json").write_text(json.dumps(progress))
    meta = corpus_pipeline.prepare_corpus(src, out, settings(src), workers=2)  # the pool path
    assert meta == DatasetMeta.load(reference)  # same shards, same checksums
    assert not partial.exists()


def _same_files(a: Path, b: Path) -> None:
    files = sorted(p.relative_to(a) for p in a.rglob("*") if p.is_file())
    assert files == sorted(p.relative_to(b) for p in b.rglob("*") if p.is_file())
    for name in files:
        assert (a / name).read_bytes() == (b / name).read_bytes(), name


def test_ray_engine_writes_the_local_engines_bytes(ray_cluster: None, corpus: tuple[Path, Path],
                                                   tmp_path: Path) -> None:
    root, reference = corpus
    args = ["--source", str(root), "--tokenizer", "train-bpe:300", "--out", str(tmp_path / "ds"),
            "--block-len", "32", "--shard-blocks", "8", "--seed", "1", "--valid-fraction", "0.1",
            "--test-fraction", "0.1", "--engine", "ray", "--workers", "2", "--quiet"]
    assert prepare_cli.main(args) == 0
    _same_files(reference, tmp_path / "ds")  # shards, meta.json and tokenizer, byte for byte


def test_each_engine_resumes_the_others_interrupted_run(
        ray_cluster: None, corpus: tuple[Path, Path], tmp_path: Path,
        monkeypatch: pytest.MonkeyPatch) -> None:
    root, reference = corpus
    src = sources.open_source(str(root))
    for first, then in (("local", "ray"), ("ray", "local")):
        out = tmp_path / f"{first}-{then}"
        progress = _interrupted(src, out, first, monkeypatch)
        file, skip = len(progress["file_documents"]) - 1, progress["file_documents"][-1]
        assert file > 0 and skip > 0  # reading restarts inside a file, after the first one
        corpus_pipeline.prepare_corpus(src, out, settings(src), engine=then, workers=2)
        _same_files(reference, out)


def test_ray_engine_names_the_bad_file_and_line(ray_cluster: None, corpus: tuple[Path, Path],
                                                tmp_path: Path) -> None:
    _, reference = corpus
    (tmp_path / "in").mkdir()
    (tmp_path / "in" / "a.jsonl").write_bytes(b'{"text": "good"}\n{"text": "caf\xe9"}\n')
    src = sources.open_source(str(tmp_path / "in"))
    with pytest.raises(DataError, match=r"a.jsonl:2: not valid UTF-8 \(byte 0xe9\)") as error:
        corpus_pipeline.prepare_corpus(src, tmp_path / "ds", settings(
            src, tokenizer=str(reference / "tokenizer")), engine="ray")
    assert "\n" not in str(error.value)  # the message alone: no task traceback, no retry advice


def test_ray_engine_needs_files(tmp_path: Path) -> None:
    src = sources.TextSource("generated", lambda: iter(DOCS))
    with pytest.raises(DataError, match="--engine ray reads local files"):
        corpus_pipeline.prepare_corpus(src, tmp_path / "ds", settings(src), engine="ray")
    assert not (tmp_path / "ds").exists() and not (tmp_path / ".ds.partial").exists()


def test_read_tasks_group_consecutive_files(tmp_path: Path) -> None:
    from isoloco_ray.data.prepare.ray_tokenize import read_task_files

    files = []
    for i, size in enumerate([10, 10, 10, 50, 5, 5]):
        files.append(tmp_path / f"{i}.txt")
        files[-1].write_bytes(b"x" * size)
    sizes = sources.open_source(str(tmp_path)).file_bytes
    assert sizes == (10, 10, 10, 50, 5, 5)
    assert read_task_files(sizes, 0, task_bytes=20) == [[0, 1], [2, 3], [4, 5]]
    assert read_task_files(sizes, 3, task_bytes=20) == [[3], [4, 5]]
    assert read_task_files(sizes, 6, task_bytes=20) == []


def test_progress_bar_shows_rate_and_files(corpus: tuple[Path, Path], tmp_path: Path,
                                           capsys: pytest.CaptureFixture[str]) -> None:
    root, _ = corpus
    args = ["--source", str(root), "--tokenizer", "train-bpe:300", "--out", str(tmp_path / "ds"),
            "--block-len", "32", "--shard-blocks", "8", "--workers", "1"]
    assert prepare_cli.main(args) == 0
    err = capsys.readouterr().err
    assert "train tokens" in err and "tok/s" in err and "file 42/42" in err


def test_token_targets(corpus: tuple[Path, Path], tmp_path: Path) -> None:
    root, _ = corpus
    src = sources.open_source(str(root))
    meta = corpus_pipeline.prepare_corpus(src, tmp_path / "t", settings(src, total_tokens=1000,
                                                                valid_tokens=100))
    train, valid = meta.split("train"), meta.split("valid")
    assert 1000 - 32 <= train.tokens + train.dropped_tokens < 1000 + 400
    assert valid.tokens + valid.dropped_tokens < 100 + 400  # stops after the doc that fills it


def _npy_arrays(npy: Path, vocab: int, lengths: dict[str, int]) -> dict[str, np.ndarray]:
    """Random token arrays of the given lengths saved as npy/NAME; returned by name."""
    npy.mkdir()
    rng = np.random.default_rng(0)
    arrays = {name: rng.integers(0, vocab, n, dtype=np.uint16) for name, n in lengths.items()}
    for name, a in arrays.items():
        np.save(npy / name, a)
    return arrays


def test_from_npy_keeps_the_file_split(tmp_path: Path, small_dataset: Path) -> None:
    """Every file becomes its own shards, never two files in one; a file longer than
    --shard-blocks is cut into equal shards, numbered so that replica r of as many replicas as
    files reads file r, whole and in order; each file's tail is dropped and counted."""
    meta0 = DatasetMeta.load(small_dataset)
    npy = tmp_path / "npy"
    arrays = _npy_arrays(npy, meta0.vocab_size, {
        **{f"train_{i:06d}.npy": 1000 for i in range(3)}, "valid_000000.npy": 300})
    tok = str(small_dataset / "tokenizer")
    out = tmp_path / "out"
    assert prepare_cli.main(["--from-npy", str(npy), "--tokenizer", tok, "--out", str(out),
                             "--block-len", "64", "--shard-blocks", "10"]) == 0
    meta = verify(out)
    train = meta.split("train")
    # 15 whole blocks a file (960 tokens, 40 dropped), in shards of 8 and 7 blocks.
    assert [s.rows for s in train.shards] == [8, 8, 8, 7, 7, 7]
    assert (train.blocks, train.dropped_tokens) == (45, 120)
    for r in range(3):
        read = np.concatenate([read_blocks(part.path)
                               for part in replica_share(out, r, 3).ranges]).ravel()
        np.testing.assert_array_equal(read, arrays[f"train_{r:06d}.npy"][:960])
    stream = np.concatenate(list(arrays.values())[:3])
    assert train.documents == int((stream == meta.eos_id).sum())
    assert meta.split("test").blocks == 0
    np.save(npy / "test_000000.npy", np.array([meta0.vocab_size], dtype=np.uint16))
    with pytest.raises(DataError, match=r"test_000000.npy: token id \d+ at index 0 is outside"):
        npy_import.prepare_from_npy(npy, tmp_path / "bad", tokenizer=tok, block_len=64)


def test_from_npy_gives_one_shard_per_worker_file_by_default(tmp_path: Path,
                                                            small_dataset: Path) -> None:
    """The research code's one file per worker: by default (shards up to 16 M tokens) each
    small file is one shard, so a run can use as many replicas as there are files (merged
    into one shard, these four files allowed one replica)."""
    npy = tmp_path / "npy"
    _npy_arrays(npy, 384, {**{f"train_{i:06d}.npy": 700 for i in range(4)},
                           "valid_000000.npy": 200})
    out = tmp_path / "out"
    tokenizer = str(small_dataset / "tokenizer")
    assert prepare_cli.main(["--from-npy", str(npy), "--tokenizer", tokenizer,
                             "--out", str(out), "--block-len", "64"]) == 0
    meta = DatasetMeta.load(out)
    assert [s.rows for s in meta.split("train").shards] == [10, 10, 10, 10]
    check_layout(out, meta, seq_len=64, replicas=4, batch_size=10)


def test_npy_shard_plan() -> None:
    plan = npy_import.npy_shard_plan([5, 0, 12, 3], shard_blocks=4)
    assert [(p.file, p.first, p.blocks) for p in plan] == [
        (0, 0, 3), (2, 0, 4), (3, 0, 3), (0, 3, 2), (2, 4, 4), (2, 8, 4)]
    assert npy_import.npy_shard_plan([0, 0], shard_blocks=4) == []


def test_from_npy_refuses_files_without_a_whole_block(tmp_path: Path, small_dataset: Path,
                                                      capsys: pytest.CaptureFixture[str]
                                                      ) -> None:
    npy = tmp_path / "npy"
    _npy_arrays(npy, 384, {"train_000000.npy": 40, "train_000001.npy": 40,
                           "valid_000000.npy": 200})
    tokenizer = str(small_dataset / "tokenizer")
    assert prepare_cli.main(["--from-npy", str(npy), "--tokenizer", tokenizer,
                             "--out", str(tmp_path / "out"), "--block-len", "64"]) == 2
    assert capsys.readouterr().err == (
        f"error: --from-npy {npy}: the train arrays hold 80 tokens, but none of its 2 files "
        "holds a whole block of 64 (--block-len), and a block never spans two files; use a "
        "smaller --block-len\n")
