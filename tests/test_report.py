"""Results tables, plot and best config regenerated from run files alone (no Ray)."""

from __future__ import annotations

import csv
import json
import math
import shutil
from pathlib import Path

import pytest
import yaml

from isoloco_ray import report, run_records, strict_json
from isoloco_ray.config import load_config


def write_run(run_dir: Path, args: list[str], losses: list[float] | None,
              finished: bool = True, error: str | None = None) -> None:
    """A run directory as the train CLI (or a grid trial) leaves it; `losses`: eval per round."""
    cfg = load_config(["--model.preset=tiny", "--run.rounds=2", f"--run.name={run_dir.name}",
                       *args])
    run_dir.mkdir(parents=True)
    (run_dir / "config.json").write_text(cfg.model_dump_json())
    tokens = cfg.tokens_per_round
    lines = [{"round": r, "tokens": r * tokens, "eval_loss": loss,
              "eval_perplexity": math.exp(loss)} for r, loss in enumerate(losses or [])]
    if losses and len(losses) > 1:
        # A restarted run appended rounds again: the latest report of a round wins.
        lines.insert(1, {"round": 1, "tokens": tokens, "eval_loss": 99.0})
    (run_dir / "metrics.jsonl").write_text("".join(json.dumps(m) + "\n" for m in lines)
                                           + '{"round": 7, "tok')  # a torn last line
    if finished:
        (run_dir / "summary.json").write_text(json.dumps({
            "strategy": cfg.outer.strategy, "tokens": (len(losses) - 1) * tokens,
            "final_eval_loss": losses[-1], "final_eval_perplexity": math.exp(losses[-1]),
            "seconds": 12.5}))
    if error:
        (run_dir / "error.txt").write_text(f"Traceback (most recent call last):\n  ...\n{error}\n")


@pytest.fixture
def grid_dir(tmp_path):
    """A grid directory: 4 trials, one failed, one interrupted, one not started."""
    trials = [("0-diloco-inner.lr=0.001", ["--inner.lr=0.001"], [6.0, 5.5, 5.2], True, None),
              ("1-diloco-inner.lr=0.002", ["--inner.lr=0.002"], [6.0, 5.3, 5.0], True, None),
              ("2-isoc", ["--outer.strategy=isoc"], [6.0], False,
               "RuntimeError: replica 3 diverged"),
              ("3-tsv", ["--outer.strategy=tsv"], [6.0, 5.6], False, None)]
    for name, args, losses, finished, error in trials:
        write_run(tmp_path / "runs" / name, args, losses, finished, error)
    overrides = [{"outer.strategy": "diloco", "inner.lr": 0.001},
                 {"outer.strategy": "diloco", "inner.lr": 0.002},
                 {"outer.strategy": "isoc"}, {"outer.strategy": "tsv"},
                 {"outer.strategy": "ties"}]
    names = [t[0] for t in trials] + ["4-ties"]
    (tmp_path / "grid.json").write_text(json.dumps({
        "name": "lrs", "metric": "final_eval_loss", "mode": "min",
        "trials": [{"name": n, "strategy": o["outer.strategy"], "overrides": o}
                   for n, o in zip(names, overrides)]}))
    return tmp_path


def test_grid_report_ranks_trials_and_names_failures(grid_dir, capsys):
    assert report.main([str(grid_dir)]) == 0
    out = capsys.readouterr().out
    assert "failed: 2-isoc: RuntimeError: replica 3 diverged" in out

    rows = list(csv.DictReader((grid_dir / "results.csv").open()))
    assert [r["trial"] for r in rows] == ["1-diloco-inner.lr=0.002", "0-diloco-inner.lr=0.001",
                                          "3-tsv", "2-isoc", "4-ties"]
    assert [r["status"] for r in rows] == ["done", "done", "incomplete", "failed", "pending"]
    assert list(rows[0]) == ["trial", "strategy", "inner.lr", "final eval loss", "perplexity",
                             "tokens", "seconds", "status"]
    assert float(rows[0]["final eval loss"]) == 5.0 and rows[0]["inner.lr"] == "0.002"
    assert float(rows[2]["final eval loss"]) == 5.6  # latest eval of an unfinished run
    assert rows[4]["strategy"] == "ties" and rows[4]["final eval loss"] == ""

    markdown = (grid_dir / "results.md").read_text()
    assert "| 1-diloco-inner.lr=0.002 | diloco | 0.002 | 5.0000 | 148.4 |" in markdown
    assert "- `2-isoc`: RuntimeError: replica 3 diverged" in markdown

    best = (grid_dir / "best_config.yaml").read_text()
    assert best.startswith("# Best of grid lrs: 1-diloco-inner.lr=0.002")
    values = yaml.safe_load(best)
    assert "name" not in values["run"] and "storage_path" not in values["run"]
    best_path = grid_dir / "best_config.yaml"
    assert load_config([str(best_path)]).inner.lr == 0.002  # ready for the train CLI

    pytest.importorskip("matplotlib")
    png = grid_dir / "eval_loss.png"
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and png.stat().st_size < 200_000


def test_single_run_and_directory_of_runs(tmp_path, capsys):
    write_run(tmp_path / "a", ["--outer.strategy=isoc"], [6.0, 5.1])
    write_run(tmp_path / "b", ["--outer.strategy=isoloco", "--run.seed=3"], [6.0, 4.9])
    assert report.main([str(tmp_path / "a")]) == 0
    rows = list(csv.DictReader((tmp_path / "a" / "results.csv").open()))
    assert [(r["trial"], r["strategy"], r["status"]) for r in rows] == [("a", "isoc", "done")]
    assert not (tmp_path / "a" / "best_config.yaml").exists()

    assert report.main([str(tmp_path), "--metric", "final_eval_perplexity"]) == 0
    rows = list(csv.DictReader((tmp_path / "results.csv").open()))
    assert [r["trial"] for r in rows] == ["b", "a"]
    # Fields that differ between the runs' configs become columns (the strategies' own
    # presets included), the strategy itself has its column.
    assert {"run.seed", "inner.lr", "outer.lr"} <= set(rows[0])
    assert rows[0]["run.seed"] == "3"

    assert report.main([str(tmp_path / "empty")]) == 2
    assert "does not exist" in capsys.readouterr().err


def test_a_run_marked_diverged_ranks_last_and_is_never_best(tmp_path):
    """A destroyed model with a finite eval loss (e.g. ln V): the run's own verdict counts."""
    write_run(tmp_path / "runs" / "0-diloco", [], [6.0, 5.9])
    write_run(tmp_path / "runs" / "1-isoc", ["--outer.strategy=isoc"], [6.0, 5.0])
    summary_path = tmp_path / "runs" / "1-isoc" / "summary.json"
    summary = json.loads(summary_path.read_text())
    summary.update(status="diverged", diverged="every replica diverged in the last 1 round(s)")
    summary_path.write_text(json.dumps(summary))
    (tmp_path / "grid.json").write_text(json.dumps({
        "name": "marked", "metric": "final_eval_loss", "mode": "min",
        "trials": [{"name": n, "strategy": n.split("-")[1], "overrides": {}}
                   for n in ("0-diloco", "1-isoc")]}))
    assert report.main([str(tmp_path)]) == 0
    rows = list(csv.DictReader((tmp_path / "results.csv").open()))
    assert [(r["trial"], r["status"]) for r in rows] == [("0-diloco", "done"),
                                                         ("1-isoc", "diverged")]
    assert (tmp_path / "best_config.yaml").read_text().startswith("# Best of grid marked: 0-diloco")


def test_non_finite_trials_rank_last_are_diverged_and_never_best(tmp_path, capsys):
    # Two trials whose eval loss ended NaN and inf (files as older versions wrote them, with
    # NaN/Infinity literals), between two normal ones; one more finished with null (strict).
    trials = [("0-diloco", ["--inner.lr=0.001"], [6.0, 5.5, 5.2]),
              ("1-isoc", ["--outer.strategy=isoc"], [6.0, 5.0, float("nan")]),
              ("2-tsv", ["--outer.strategy=tsv"], [6.0, float("inf"), float("inf")]),
              ("3-diloco", ["--inner.lr=0.002"], [6.0, 5.3, 5.0])]
    for name, args, losses in trials:
        write_run(tmp_path / "runs" / name, args, losses)
    assert "NaN" in (tmp_path / "runs" / "1-isoc" / "summary.json").read_text()
    assert "Infinity" in (tmp_path / "runs" / "2-tsv" / "summary.json").read_text()
    (tmp_path / "grid.json").write_text(json.dumps({
        "name": "nans", "metric": "final_eval_loss", "mode": "min",
        "trials": [{"name": n, "strategy": n.split("-")[1], "overrides": {}}
                   for n, _, _ in trials]}))

    assert report.main([str(tmp_path)]) == 0
    rows = list(csv.DictReader((tmp_path / "results.csv").open()))
    assert [(r["trial"], r["status"]) for r in rows] == [
        ("3-diloco", "done"), ("0-diloco", "done"), ("1-isoc", "diverged"), ("2-tsv", "diverged")]
    assert [r["final eval loss"] for r in rows] == ["5.0", "5.2", "nan", "inf"]
    markdown = (tmp_path / "results.md").read_text()
    assert "| 1-isoc | isoc | nan | nan |" in markdown and "| inf | inf |" in markdown
    assert "best config:" in capsys.readouterr().out
    assert (tmp_path / "best_config.yaml").read_text().startswith("# Best of grid nans: 3-diloco")

    # Ranked the other way, or by another figure, a non-finite value is still last, never best.
    for args in (["--mode", "max"], ["--metric", "final_eval_perplexity", "--mode", "max"]):
        assert report.main([str(tmp_path), *args]) == 0
        rows = list(csv.DictReader((tmp_path / "results.csv").open()))
        assert [r["trial"] for r in rows] == ["0-diloco", "3-diloco", "1-isoc", "2-tsv"]
        assert "3-diloco" not in (tmp_path / "best_config.yaml").read_text().splitlines()[0]

    # What a grid trial writes now: strict JSON, null for the non-finite loss.
    summary = tmp_path / "runs" / "1-isoc" / "summary.json"
    summary.write_text(strict_json.dumps(json.loads(summary.read_text())))
    assert '"final_eval_loss": null' in summary.read_text()
    loaded = run_records.load_report(tmp_path)
    assert [(r.name, r.status) for r in loaded.ranked()][2:] == [("1-isoc", "diverged"),
                                                                ("2-tsv", "diverged")]
    assert loaded.best().name == "3-diloco"
    assert "| 1-isoc | isoc | nan | nan |" in report.markdown_table(loaded)

    pytest.importorskip("matplotlib")
    png = tmp_path / "eval_loss.png"
    png.unlink()
    assert report.main([str(tmp_path)]) == 0
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_report_path_must_be_an_existing_directory(tmp_path, capsys):
    write_run(tmp_path / "a", [], [6.0, 5.1])
    for path, message in ((tmp_path / "a" / "summary.json", "is a file, not a directory"),
                          (tmp_path / "missing", "does not exist")):
        assert report.main([str(path)]) == 2
        err = capsys.readouterr().err
        assert err.startswith(f"error: {path} {message}; ") and err.count("\n") == 1
    # A grid.json names its trials' directories: never one outside runs/.
    (tmp_path / "grid.json").write_text(json.dumps({"name": "g", "trials": [
        {"name": "../a", "strategy": "diloco", "overrides": {}}]}))
    assert report.main([str(tmp_path)]) == 2
    assert capsys.readouterr().err == (f"error: {tmp_path / 'grid.json'}: trial name '../a' "
                                       "must be one directory name: ASCII letters, digits and "
                                       ". _ = , + - starting with a letter or digit (no '/', "
                                       "'..', spaces or other characters)\n")


def test_a_report_never_replaces_a_file_it_did_not_write_nor_writes_through_a_link(tmp_path,
                                                                                    capsys):
    """The report's names in a directory hold the user's own results.md, or a results.csv
    that is a link to another file: one line naming them, nothing written, both untouched.
    Its own files, once written, are replaced by the next report (and refused again once
    edited by hand)."""
    write_run(tmp_path / "a", ["--outer.strategy=isoc"], [6.0, 5.1])
    run_dir = tmp_path / "a"
    mine = run_dir / "results.md"
    mine.write_text("my notes\n")
    outside = tmp_path / "elsewhere.csv"
    outside.write_text("precious\n")
    (run_dir / "results.csv").symlink_to(outside)
    assert report.main([str(run_dir)]) == 2
    error = capsys.readouterr().err.strip()
    assert error == (f"error: {run_dir} holds results.md, results.csv, which a report did not "
                     "write there (or which changed since): a report never replaces them; move "
                     "them elsewhere and run the report again")
    assert mine.read_text() == "my notes\n" and outside.read_text() == "precious\n"
    assert not (run_dir / "eval_loss.png").exists()
    mine.unlink()
    (run_dir / "results.csv").unlink()
    assert report.main([str(run_dir)]) == 0
    assert report.main([str(run_dir)]) == 0  # its own files: replaced
    capsys.readouterr()
    (run_dir / "results.csv").write_text("edited\n")
    assert report.main([str(run_dir)]) == 2
    assert "holds results.csv," in capsys.readouterr().err
    assert (run_dir / "results.csv").read_text() == "edited\n"


def test_runs_whose_files_are_not_a_runs_are_skipped_with_one_line_each(tmp_path, capsys):
    """A directory of runs where one has a foreign config.json, one a metrics.jsonl line that
    is a list and one a line without tokens: each is skipped with one line naming its file,
    the others reported; with nothing left, one error line. A grid.json that is a list is one
    error line. Never a traceback."""
    write_run(tmp_path / "good", ["--outer.strategy=isoc"], [6.0, 5.1])
    write_run(tmp_path / "foreign", [], [6.0, 5.0])
    (tmp_path / "foreign" / "config.json").write_text('{"hello": 1}')
    write_run(tmp_path / "listed", [], [6.0, 5.0])
    with (tmp_path / "listed" / "metrics.jsonl").open("w") as out:
        out.write('{"round": 0, "tokens": 0}\n[1, 2]\n')
    write_run(tmp_path / "tokenless", [], [6.0, 5.0])
    (tmp_path / "tokenless" / "metrics.jsonl").write_text('{"round": 0}\n')
    assert report.main([str(tmp_path)]) == 0
    captured = capsys.readouterr()
    assert captured.err.splitlines() == [
        f"skipped: {tmp_path / 'foreign' / 'config.json'}: not a run's config.json (it has no "
        "outer.strategy)",
        f"skipped: {tmp_path / 'listed' / 'metrics.jsonl'}: line 2 is not a round's record (an "
        "object with an integer round and tokens)",
        f"skipped: {tmp_path / 'tokenless' / 'metrics.jsonl'}: line 1 is not a round's record "
        "(an object with an integer round and tokens)"]
    rows = list(csv.DictReader((tmp_path / "results.csv").open()))
    assert [r["trial"] for r in rows] == ["good"]
    shutil.rmtree(tmp_path / "good")
    assert report.main([str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"error: {tmp_path} holds no runs that can be read") and \
        err.count("\n") == 1 and "Traceback" not in err
    grid = tmp_path / "grid"
    grid.mkdir()
    (grid / "grid.json").write_text("[]")
    assert report.main([str(grid)]) == 2
    assert capsys.readouterr().err == (f"error: {grid / 'grid.json'}: not a grid's grid.json (a "
                                       "JSON list, not an object)\n")
