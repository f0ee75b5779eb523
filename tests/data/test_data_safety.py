"""Safety of the data tools: what ``prepare --overwrite`` may replace, corrupt data found after
the first scan (the stamp's key, the stream's token-id check, block_len against the shards), and
clear messages for bad input and Ctrl-C (exit 2 or 130, one line, no traceback, nothing left
behind unless it is resumable work, which the message names).

Real files in ``tmp_path`` throughout. The two Ctrl-C tests run the CLI in a subprocess and send
it a real SIGINT at a point where it is known to wait: a FIFO it reads (``--from-npy``), or a fake
``datasets`` module (the Hugging Face source) that blocks after its last document.
"""

from __future__ import annotations

import errno
import importlib.util
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from helpers import check
from isoloco_ray.data import checks

from isoloco_ray.data.prepare import demo, documents, cli as prepare_cli
from isoloco_ray.data.format import (
    DataError, DatasetMeta, read_blocks, split_files, verify, write_blocks,
)
from isoloco_ray.data.ray_reader import read_with_ray_data
from isoloco_ray.data.stream import (
    ReplicaStream, ShardBlocks, read_with_pyarrow, replica_share,
)

from isoloco_ray.testing import synthetic_documents

REPO = Path(__file__).resolve().parents[2]
# A small recipe for the CLI: BPE of 300 tokens, blocks of 32, 8 blocks a shard.
CLI = ["--tokenizer", "train-bpe:300", "--block-len", "32", "--shard-blocks", "8",
       "--workers", "1", "--quiet"]
OLD_NS = 1_000_000_000  # an mtime (1 s after the epoch) no file written by a test can have


def snapshot(root: Path) -> dict[str, bytes | None]:
    """Every path under ``root`` with its bytes (None for a directory)."""
    return {str(p.relative_to(root)): None if p.is_dir() else p.read_bytes()
            for p in sorted(root.rglob("*"))}


def text_source(root: Path, count: int = 60, seed: int = 3) -> Path:
    """A folder of ``count`` small .txt documents."""
    root.mkdir(parents=True)
    for i, d in enumerate(synthetic_documents(count, seed)):
        (root / f"{i:03d}.txt").write_text(d)
    return root


def cli(args: list[object], capsys: pytest.CaptureFixture[str]) -> tuple[int, str]:
    """``prepare_cli.main(args)``: (exit status, stderr)."""
    code = prepare_cli.main([str(a) for a in args])
    return code, capsys.readouterr().err


def error_line(err: str) -> str:
    """The one ``error: ...`` line stderr must consist of."""
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), err
    return lines[0]


def names(directory: Path) -> list[str]:
    return sorted(p.name for p in directory.iterdir())


# --------------------------------------------------------------- 1. what --overwrite replaces


def test_overwrite_never_replaces_a_folder_with_a_foreign_meta_json(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    src = text_source(tmp_path / "src")
    project = tmp_path / "project"
    (project / "src").mkdir(parents=True)
    (project / "meta.json").write_text('{"name": "my project", "version": 3}\n')
    (project / "notes.txt").write_text("keep me")
    (project / "src" / "main.py").write_text("print('hello')\n")
    before = snapshot(project)
    code, err = cli(["--source", src, "--out", project, "--overwrite", *CLI], capsys)
    assert code == 2
    assert error_line(err) == (
        f"error: {project} is not a prepared dataset (its meta.json is not a dataset meta.json; "
        "it holds files a dataset never has: notes.txt, src/), so it is never replaced, not "
        "even with --overwrite; choose another output directory (or empty this one yourself)")
    assert snapshot(project) == before
    assert names(tmp_path) == ["project", "src"]  # no lock, staging or partial left


def test_overwrite_refuses_a_dataset_holding_a_user_file(small_dataset: Path,
                                                         tmp_path: Path) -> None:
    out = tmp_path / "ds"
    shutil.copytree(small_dataset, out)
    (out / "NOTES.md").write_text("my notes")
    (out / "train" / "extra.csv").write_text("1,2\n")
    before = snapshot(out)
    with pytest.raises(DataError, match=r"is not a prepared dataset \(it holds files a dataset "
                                        r"never has: NOTES.md, train/extra.csv\)"):
        documents.prepare_dataset(synthetic_documents(100), out, overwrite=True, vocab_size=300,
                                block_len=32, shard_blocks=8)
    assert snapshot(out) == before
    assert names(tmp_path) == ["ds"]


def test_overwrite_replaces_a_real_dataset(data: Path, tmp_path: Path) -> None:
    checks.scanned_max_token_id(data, DatasetMeta.load(data))
    assert (data / checks.STAMP_FILE).is_file()  # the scan stamp is one of our files
    meta = documents.prepare_dataset(synthetic_documents(100, seed=8), data, overwrite=True,
                                   vocab_size=300, block_len=32, shard_blocks=8)
    assert verify(data) == meta and meta.block_len == 32
    assert not (data / checks.STAMP_FILE).exists()
    assert names(tmp_path) == ["ds"]


def test_demo_cache_that_is_not_a_dataset_is_refused_before_downloading(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(demo.CACHE_ENV, str(tmp_path))
    folder = tmp_path / "demo"
    folder.mkdir()
    (folder / "meta.json").write_text("{}")
    (folder / "results.bin").write_bytes(b"\x00\x01")
    before = snapshot(folder)
    with pytest.raises(DataError, match=r"demo is not a prepared dataset \(its meta.json"):
        documents.ensure_demo_data()
    assert snapshot(folder) == before
    assert names(tmp_path) == ["demo"]  # nothing downloaded, no lock left


# --------------------------------------------------------------- 2. corrupt data after the scan


def test_stamp_is_keyed_on_every_shards_size_and_mtime(
        data: Path, capsys: pytest.CaptureFixture[str]) -> None:
    shard = split_files(data, "train")[0]
    os.utime(shard, ns=(OLD_NS, OLD_NS))
    check(data)
    assert "verifying" in capsys.readouterr().err
    stamp = json.loads((data / checks.STAMP_FILE).read_text())
    assert stamp["shards"]["train/part-00000.parquet"] == [shard.stat().st_size, OLD_NS]
    check(data)
    assert "verifying" not in capsys.readouterr().err
    os.utime(shard, ns=(OLD_NS, OLD_NS + 1))  # same bytes, touched: scanned again
    check(data)
    assert "verifying" in capsys.readouterr().err


def test_shard_flipped_after_the_first_scan_is_caught(data: Path) -> None:
    shard = split_files(data, "train")[0]
    os.utime(shard, ns=(OLD_NS, OLD_NS))
    check(data)
    raw = bytearray(shard.read_bytes())
    raw[len(raw) // 3] ^= 0xFF  # same size; the footer still reads fine
    shard.write_bytes(bytes(raw))
    with pytest.raises(DataError, match=r"train/part-00000.parquet: sha256 .* corrupt"):
        check(data)


def damage_in_place(shard: Path) -> None:
    """Flip the bytes of the middle of `shard`, keeping its size and modification time (as a
    failing disk or a careless tool may)."""
    times = shard.stat()
    raw = bytearray(shard.read_bytes())
    for i in range(len(raw) // 4, len(raw) // 2):
        raw[i] ^= 0xFF
    shard.write_bytes(bytes(raw))
    os.utime(shard, ns=(times.st_atime_ns, times.st_mtime_ns))


def unreadable(shard: Path) -> str:
    """The start and end of the DataError of a shard that cannot be read."""
    return (rf"^cannot read shard {re.escape(str(shard))} \(.+\): it is missing or damaged "
            r"\(changed in place after the dataset was verified\?\); restore it or prepare the "
            r"dataset again, and set ISOLOCO_RAY_VERIFY_DATA=always to check every shard before "
            r"a run$")


def test_a_shard_damaged_in_place_stops_training_naming_it(
        data: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Size and mtime kept: the pre-flight stamp still matches (it compares those, not every
    byte, on each run), so the damage is met where the shard is read: a DataError naming it
    and how to check every shard, which stops the run (no restarts: they would meet it
    again); the full scan then names it too."""
    from isoloco_ray.config import load_config
    from isoloco_ray.workers.local import run_local

    check(data)
    shard = split_files(data, "train")[1]  # replica 1 of 2 reads shards 1, 3, ...
    damage_in_place(shard)
    check(data)  # the stamp's key is unchanged
    with pytest.raises(DataError, match=unreadable(shard)):
        read_blocks(shard)
    cfg = load_config(["--model.preset=tiny", "--scaling.replicas=2", "--inner.steps=2",
                       "--run.rounds=2", "--data.seq_len=64", "--data.batch_size=4",
                       "--run.eval_tokens=512"])
    summary, _ = run_local(cfg, data)
    assert summary["rounds"] == 0 and summary["error"].startswith("worker 0 in round 1: ")
    assert re.match(unreadable(shard), summary["error"].removeprefix("worker 0 in round 1: "))
    monkeypatch.setenv(checks.VERIFY_ENV, "always")
    with pytest.raises(DataError, match=re.escape(str(shard))):
        check(data)


def test_shard_swapped_after_the_first_scan_is_caught(data: Path) -> None:
    first, second = split_files(data, "train")[:2]
    os.utime(first, ns=(OLD_NS, OLD_NS))
    check(data)
    shutil.copyfile(second, first)  # another valid shard with the same rows in its place
    with pytest.raises(DataError, match=r"train/part-00000.parquet: sha256 .* corrupt"):
        check(data)


def test_block_len_disagreeing_with_the_shards_is_caught_by_the_footer_check(
        data: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    raw = json.loads((data / "meta.json").read_text())
    raw["block_len"] = 32  # the shards hold rows of 64
    for info in raw["splits"].values():
        info["tokens"] = info["blocks"] * 32
    (data / "meta.json").write_text(json.dumps(raw))
    monkeypatch.setenv(checks.VERIFY_ENV, "never")  # the cheap checks alone catch it
    rows = raw["splits"]["train"]["shards"][0]["rows"]
    with pytest.raises(DataError, match=rf"train/part-00000.parquet: {rows * 64} token ids in "
                                        rf"{rows} rows \(64 a row\), but meta.json says "
                                        r"block_len 32"):
        check(data, seq_len=32)
    with pytest.raises(DataError, match="block_len 32"):
        verify(data, checksums=False)


def _set_token(shard: Path, row: int, column: int, value: int) -> None:
    blocks = read_blocks(shard)
    blocks[row, column] = value
    write_blocks(shard, blocks)


def test_stream_names_the_shard_of_an_out_of_vocabulary_id(data: Path) -> None:
    vocab = DatasetMeta.load(data).vocab_size
    files = split_files(data, "train")[:2]  # 2 x 16 blocks of 64: 8 batches of 4
    _set_token(files[1], 5, 7, vocab + 5)
    share = replica_share(data, 0, 1)
    plain = ReplicaStream(share, read_with_pyarrow, 64, 4)  # vocab_size None: no check
    for _ in range(8):
        plain.next_batch()
    stream = ReplicaStream(share, read_with_pyarrow, 64, 4, vocab_size=vocab)
    for _ in range(4):
        stream.next_batch()  # the first shard is fine
    with pytest.raises(DataError, match=rf"^{re.escape(str(files[1]))}: token id {vocab + 5} is "
                                        rf"outside the model's vocabulary \(0..{vocab - 1}\)"):
        stream.next_batch()
    _set_token(files[0], 0, 0, -3)
    with pytest.raises(DataError, match=rf"^{re.escape(str(files[0]))}: token id -3 is outside"):
        ReplicaStream(share, read_with_pyarrow, 64, 4, vocab_size=vocab).next_batch()


def test_ray_data_rows_name_the_shard_of_each_row(data: Path) -> None:
    vocab = DatasetMeta.load(data).vocab_size
    share = replica_share(data, 0, 1)
    files = split_files(data, "train")[:2]
    _set_token(files[1], 1, 3, vocab)
    a, b = read_blocks(files[0]), read_blocks(files[1])
    rows = np.concatenate([a[-3:], b[:3]])  # one batch across the two shards
    tokens = np.empty(len(rows), dtype=object)  # a list column arrives as an array of arrays
    tokens[:] = list(rows)
    paths = np.array([str(files[0])] * 3 + [str(files[1])] * 3, dtype=object)

    def recorded(ranges: object) -> list[ShardBlocks]:
        return [ShardBlocks(np.stack(tokens), paths)]

    with pytest.raises(DataError, match=rf"^{re.escape(str(files[1]))}: token id {vocab} "):
        ReplicaStream(share, recorded, 64, 2, vocab_size=vocab).next_batch()


def test_ray_data_stream_names_the_bad_shard(ray_cluster: None, data: Path) -> None:
    vocab = DatasetMeta.load(data).vocab_size
    share = replica_share(data, 0, 2)
    bad = share.ranges[1].path
    _set_token(bad, 2, 0, vocab + 1)
    stream = ReplicaStream(share, read_with_ray_data, 64, 4, vocab_size=vocab)
    with pytest.raises(DataError, match=rf"{re.escape(str(bad))}: token id {vocab + 1} "):
        for _ in range(100):
            stream.next_batch()
    # A shard damaged in place: the read task's DataError, without its traceback.
    damaged = share.ranges[0].path
    damage_in_place(damaged)
    stream = ReplicaStream(share, read_with_ray_data, 64, 4, vocab_size=vocab)
    with pytest.raises(DataError, match=unreadable(damaged)) as raised:
        stream.next_batch()
    assert "Traceback" not in str(raised.value) and type(raised.value) is DataError


# --------------------------------------------------------------- 3. clear messages


def test_parquet_text_column_of_another_type(tmp_path: Path,
                                             capsys: pytest.CaptureFixture[str]) -> None:
    source = tmp_path / "numbers.parquet"
    pq.write_table(pa.table({"text": pa.array([1, 2, 3], pa.int64())}), source)
    code, err = cli(["--source", source, "--out", tmp_path / "out", *CLI], capsys)
    assert code == 2
    assert error_line(err) == (f"error: {source}: column 'text' has type int64, not text "
                               "(string); choose the text column with --text-field")
    assert names(tmp_path) == ["numbers.parquet"]


def test_text_that_is_not_utf8_names_file_and_line(tmp_path: Path,
                                                   capsys: pytest.CaptureFixture[str]) -> None:
    jsonl = tmp_path / "docs.jsonl"
    jsonl.write_bytes(b'{"text": "fine"}\n{"text": "also fine"}\n{"text": "caf\xe9"}\n')
    src = text_source(tmp_path / "src")
    (src / "latin1.txt").write_bytes(b"first line\nsecond caf\xe9 line\n")
    for source, where in ((jsonl, f"{jsonl}:3"), (src, f"{src / 'latin1.txt'}:2")):
        code, err = cli(["--source", source, "--out", tmp_path / "out", *CLI], capsys)
        assert code == 2
        assert error_line(err) == (
            f"error: {where}: not valid UTF-8 (byte 0xe9); convert the file to UTF-8 (e.g. iconv "
            "-f latin1 -t utf-8) or leave it out of --source (nothing was kept: the same command "
            "starts over)")
        assert names(tmp_path) == ["docs.jsonl", "src"]


def test_failure_mid_run_keeps_resumable_work_and_says_so(
        small_dataset: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    docs = synthetic_documents(700, seed=6)
    source = tmp_path / "docs.jsonl"
    lines = [json.dumps({"text": d}).encode() for d in docs]
    lines[650] = b'{"text": "caf\xe9"}'  # after the first batch of 512 documents
    source.write_bytes(b"\n".join(lines) + b"\n")
    out = tmp_path / "out"
    args = ["--source", source, "--out", out, "--tokenizer", small_dataset / "tokenizer",
            "--block-len", "32", "--shard-blocks", "8", "--workers", "1", "--quiet"]
    code, err = cli(args, capsys)
    partial = tmp_path / ".out.partial"
    assert code == 2
    assert error_line(err).endswith(
        f"{source}:651: not valid UTF-8 (byte 0xe9); convert the file to UTF-8 (e.g. iconv -f "
        "latin1 -t utf-8) or leave it out of --source (partial work kept in "
        f"{partial}: rerun the same command to resume)")
    assert names(tmp_path) == [".out.partial", "docs.jsonl"]
    assert json.loads((partial / "progress.json").read_text())["next_document"] == 512
    lines[650] = json.dumps({"text": docs[650]}).encode()  # fixed in place: resume
    source.write_bytes(b"\n".join(lines) + b"\n")
    assert cli(args, capsys)[0] == 0
    assert names(tmp_path) == ["docs.jsonl", "out"]
    fresh = tmp_path / "fresh"
    assert cli([fresh if a == out else a for a in args], capsys)[0] == 0
    assert DatasetMeta.load(out) == DatasetMeta.load(fresh)


def test_missing_tokenizer_path_says_no_such_directory(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
        capsys: pytest.CaptureFixture[str]) -> None:
    src = text_source(tmp_path / "src")
    monkeypatch.chdir(tmp_path)
    for spec in (str(tmp_path / "no_tok"), "./no_tok", "~/no/such/tok", "no/such/tok"):
        code, err = cli(["--source", src, "--out", tmp_path / "out", *CLI, "--tokenizer", spec],
                        capsys)
        assert code == 2
        assert error_line(err) == (
            f"error: --tokenizer {spec}: no such directory; pass the directory of a saved Hugging "
            "Face tokenizer, a Hugging Face name or train-bpe:VOCAB (nothing was kept: the same "
            "command starts over)")
        assert names(tmp_path) == ["src"]


def test_binary_txt_is_skipped_with_a_warning(tmp_path: Path,
                                              capsys: pytest.CaptureFixture[str]) -> None:
    src = text_source(tmp_path / "src", count=60)
    blob = bytearray(np.random.default_rng(0).integers(0, 256, 20000, dtype=np.uint8).tobytes())
    blob[100] = 0
    (src / "random.txt").write_bytes(bytes(blob))
    code, err = cli(["--source", src, "--out", tmp_path / "out", *CLI], capsys)
    assert code == 0
    assert err.strip().splitlines() == [
        f"warning: {src / 'random.txt'}: skipped: looks like binary data (NUL bytes in its first "
        "8 KiB), not UTF-8 text"]
    meta = verify(tmp_path / "out")
    assert "(60 files" in meta.source
    assert sum(meta.split(s).documents for s in ("train", "valid", "test")) == 60


def _npy_dir(root: Path, arrays: dict[str, np.ndarray]) -> Path:
    root.mkdir()
    for name, array in arrays.items():
        np.save(root / name, array)
    return root


def test_from_npy_bad_arrays(small_dataset: Path, tmp_path: Path,
                            capsys: pytest.CaptureFixture[str]) -> None:
    tok = small_dataset / "tokenizer"
    good = np.arange(1000, dtype=np.int32) % 300
    negative = good.copy()
    negative[5] = -3
    cases = {
        "negative": ({"train_000000.npy": negative, "valid_000000.npy": good},
                     "{dir}/train_000000.npy: token id -3 at index 5 is outside the vocabulary "
                     "(0..383); a negative id means the file is not a token array, a large one "
                     "the wrong --tokenizer or --vocab-size (nothing was kept (--from-npy is not "
                     "resumable): the same command starts over)"),
        "empty": ({"train_000000.npy": good[:0], "valid_000000.npy": good},
                  "--from-npy {dir}: the train arrays hold 0 tokens, less than one block of 32 "
                  "(--block-len); training needs train data"),
        "novalid": ({"train_000000.npy": good, "test_000000.npy": good},
                    "--from-npy {dir}: no valid_NNNNNN.npy files; training needs a valid split"),
    }
    for name, (arrays, message) in cases.items():
        npy = _npy_dir(tmp_path / name, arrays)
        code, err = cli(["--from-npy", npy, "--tokenizer", tok, "--out", tmp_path / "out",
                         "--block-len", "32"], capsys)
        assert code == 2
        assert error_line(err) == "error: " + message.format(dir=npy)
    assert names(tmp_path) == ["empty", "negative", "novalid"]


# --------------------------------------------------------------- Ctrl-C


def _wait_for(condition: Callable[[], bool], proc: subprocess.Popen[str],
              seconds: float = 120) -> None:
    deadline = time.monotonic() + seconds
    while not condition():
        if proc.poll() is not None or time.monotonic() > deadline:
            proc.kill()
            pytest.fail(f"prepare did not reach the expected point:\n{proc.communicate()[1]}")
        time.sleep(0.05)


def _ctrl_c(proc: subprocess.Popen[str], unblock: Callable[[], None] | None = None
            ) -> tuple[int, str]:
    """Ctrl-C as a terminal sends it (to the whole process group); (exit status, stderr).
    `unblock`, called if the process is still there after 5 s: ends a read it may be blocked
    in (the kernel may hand SIGINT to another of its threads, and then nothing interrupts the
    main thread's read; Python acts on the signal once that read returns)."""
    os.killpg(proc.pid, signal.SIGINT)
    try:
        try:
            _, err = proc.communicate(timeout=5 if unblock else 60)
        except subprocess.TimeoutExpired:
            if unblock is None:
                raise
            unblock()
            _, err = proc.communicate(timeout=60)
    except subprocess.TimeoutExpired:
        proc.kill()
        raise
    return proc.returncode, err


def _prepare_process(args: list[object], cwd: Path,
                     env: dict[str, str] | None = None) -> subprocess.Popen[str]:
    return subprocess.Popen(
        [sys.executable, "-m", "isoloco_ray.data.prepare", *map(str, args)], cwd=cwd,
        env={**os.environ, "PYTHONPATH": str(REPO), **(env or {})}, stdout=subprocess.PIPE,
        stderr=subprocess.PIPE, text=True, start_new_session=True)


def test_ctrl_c_during_from_npy_leaves_nothing(small_dataset: Path, tmp_path: Path) -> None:
    good = np.arange(2000, dtype=np.uint16) % 300
    npy = _npy_dir(tmp_path / "npy", {"train_000000.npy": good, "valid_000000.npy": good})
    fifo = npy / "test_000000.npy"  # converted last; reading it waits for a writer
    os.mkfifo(fifo)
    proc = _prepare_process(["--from-npy", npy, "--tokenizer", small_dataset / "tokenizer",
                             "--out", tmp_path / "out", "--block-len", "32"], tmp_path)
    writer: list[int] = []

    def converting_test_split() -> bool:  # the open succeeds once prepare has the FIFO open
        try:
            writer.append(os.open(fifo, os.O_WRONLY | os.O_NONBLOCK))
        except OSError as e:
            if e.errno != errno.ENXIO:
                raise
        return bool(writer)

    _wait_for(converting_test_split, proc)

    def close_writer() -> None:  # the FIFO's end of file
        os.close(writer.pop())

    try:
        code, err = _ctrl_c(proc, unblock=close_writer)
    finally:
        if writer:
            os.close(writer[0])
    assert code == 130
    assert err.strip().splitlines() == [
        "interrupted: nothing was kept (--from-npy is not resumable): the same command starts "
        "over"]
    assert names(tmp_path) == ["npy"]  # no output, staging or lock


FAKE_DATASETS = '''
"""A fake Hugging Face `datasets`: FAKE_DOCS documents, then (with FAKE_READY) it touches that
file and waits, as a slow stream would."""
import os
import time
from collections.abc import Callable
from pathlib import Path

WORDS = "river stone light house garden winter letter morning window silver".split()


def load_dataset(name, config=None, split=None, streaming=False):
    def rows():
        for i in range(int(os.environ["FAKE_DOCS"])):
            yield {"text": " ".join(WORDS[(i * 7 + k) % len(WORDS)] for k in range(i % 40 + 5))}
        if os.environ.get("FAKE_READY"):
            Path(os.environ["FAKE_READY"]).touch()
            time.sleep(300)
    return rows()
'''


def test_ctrl_c_during_source_prepare_keeps_resumable_work(
        small_dataset: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
        capsys: pytest.CaptureFixture[str]) -> None:
    fake = tmp_path / "fake"
    fake.mkdir()
    (fake / "datasets.py").write_text(FAKE_DATASETS)
    ready = tmp_path / "ready"
    out = tmp_path / "out"
    args: list[object] = ["--source", "org/corpus", "--tokenizer", small_dataset / "tokenizer",
                          "--block-len", "32", "--shard-blocks", "8", "--workers", "1",
                          "--quiet"]
    proc = _prepare_process([*args, "--out", out], tmp_path, {
        "PYTHONPATH": f"{fake}{os.pathsep}{REPO}", "FAKE_DOCS": "1024",
        "FAKE_READY": str(ready)})
    _wait_for(ready.exists, proc)
    code, err = _ctrl_c(proc)
    partial = tmp_path / ".out.partial"
    assert code == 130
    assert err.strip().splitlines() == [
        f"interrupted: partial work kept in {partial}: rerun the same command to resume"]
    assert json.loads((partial / "progress.json").read_text())["next_document"] == 1024
    assert names(tmp_path) == [".out.partial", "fake", "ready"]
    # The same command again (in this process, the same fake source) finishes the work, and
    # gives what an uninterrupted run gives.
    spec = importlib.util.spec_from_file_location("datasets", fake / "datasets.py")
    module = importlib.util.module_from_spec(spec)  # type: ignore[arg-type]
    spec.loader.exec_module(module)  # type: ignore[union-attr]
    monkeypatch.setitem(sys.modules, "datasets", module)
    monkeypatch.setenv("FAKE_DOCS", "1024")
    monkeypatch.delenv("FAKE_READY", raising=False)
    assert cli([*args, "--out", out], capsys)[0] == 0
    assert not partial.exists()
    assert cli([*args, "--out", tmp_path / "fresh"], capsys)[0] == 0
    assert DatasetMeta.load(out) == DatasetMeta.load(tmp_path / "fresh")


def test_an_unfinished_preparation_planted_as_a_link_is_refused_and_its_target_untouched(
        small_dataset: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """`.NAME.partial`, where an unfinished preparation keeps its work, has a fixed name: one
    planted as a symbolic link would be read, written and deleted through. One line, rc 2."""
    source = tmp_path / "docs.jsonl"
    source.write_text("".join(json.dumps({"text": d}) + "\n" for d in synthetic_documents(20)))
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    (elsewhere / "mine.txt").write_text("the user's own words\n")
    partial = tmp_path / ".out.partial"
    partial.symlink_to(elsewhere, target_is_directory=True)
    code, err = cli(["--source", source, "--out", tmp_path / "out", "--tokenizer",
                     small_dataset / "tokenizer", "--workers", "1", "--quiet"], capsys)
    assert code == 2
    assert error_line(err) == (
        f"error: {partial} is a symbolic link, not the unfinished preparation this command "
        "keeps there: remove it, then run the same command again")
    assert [p.name for p in elsewhere.iterdir()] == ["mine.txt"]
    assert (elsewhere / "mine.txt").read_text() == "the user's own words\n"
