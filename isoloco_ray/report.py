"""`python -m isoloco_ray.report DIR`: results table, eval-loss plot and best config of runs.

DIR is a grid directory (written by `python -m isoloco_ray.tune`: `grid.json` and
`runs/<trial>/`), a single run directory, or a directory holding run directories. Everything is
read from the runs' own files (`config.json`, `metrics.jsonl`, `summary.json`, `error.txt`,
`stopped.json`), so
a report can be regenerated at any time, without Ray, also while a grid is still running.

Written to DIR: `results.md` and `results.csv` (one row per run, best first), `eval_loss.png`
(eval loss against training tokens, one line per run; needs matplotlib, the `plot` extra) and,
for several runs, `best_config.yaml` (the best finished run's config, for the train CLI).

A run whose final eval loss is not a finite number (NaN, inf; null in the strict JSON that
isoloco_ray.strict_json writes) is `diverged`: it ranks after every other run and is never the
best. Files written before strict JSON, with NaN/Infinity in them, are read as well.
"""

from __future__ import annotations

import csv
import io
import json
import math
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from isoloco_ray import run_files, strict_json
from isoloco_ray.config import check_name, flatten
from isoloco_ray.metrics import DIVERGED_IF_NOT_FINITE, SUMMARY_METRICS
from isoloco_ray.storage import location

# Fields every run sets differently by construction: never "varied" in a table.
_IGNORED_FIELDS = ("run.name", "run.storage_path", "outer.strategy")


class ReportError(ValueError):
    """A directory with nothing to report, or an unreadable run file."""


def finite(value: Any) -> float | None:
    """`value` as a float if it is a finite number, else None (NaN, inf, null, text)."""
    if isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value):
        return float(value)
    return None


@dataclass
class RunRecord:
    """What the files of one run (or one grid trial) say."""

    name: str
    run_dir: Path
    overrides: dict[str, Any] = field(default_factory=dict)  # the grid's settings of this trial
    config: dict[str, Any] | None = None  # config.json: the resolved TrainConfig
    summary: dict[str, Any] | None = None  # summary.json: written when the run finished
    metrics: list[dict[str, Any]] = field(default_factory=list)  # metrics.jsonl, one per round
    error: str | None = None  # error.txt: why the trial failed
    stopped: dict[str, Any] | None = None  # stopped.json: the scheduler stopped it early
    planned_strategy: str | None = None  # a grid trial's strategy, known before it starts

    @property
    def status(self) -> str:
        """done, diverged (finished with a non-finite final eval loss, or marked so by the run:
        its last rounds skipped, or no better than a uniform prediction), stopped (early, by the
        grid's scheduler), failed, incomplete (running or interrupted) or pending (not
        started). A stopped trial that still finished (its last rounds raced the stop) is
        done; one whose Train run failed as it was torn down is stopped."""
        if self.summary is not None:
            diverged = self.summary.get("status") == "diverged" or any(
                key in self.summary and finite(self.summary[key]) is None
                for key in DIVERGED_IF_NOT_FINITE)
            return "diverged" if diverged else "done"
        if self.stopped is not None:
            return "stopped"
        if self.error is not None:
            return "failed"
        return "incomplete" if self.metrics else "pending"

    @property
    def strategy(self) -> str:
        """The run's outer strategy, from whichever file has it."""
        if self.config is not None:
            return self.config["outer"]["strategy"]
        return self.planned_strategy or "?"

    def evals(self) -> list[tuple[int, float]]:
        """(tokens, eval loss) of every evaluation so far."""
        return [(m["tokens"], m["eval_loss"]) for m in self.metrics if "eval_loss" in m]

    def value(self, metric: str) -> float | None:
        """`metric` of the finished run, or for an unfinished one its latest eval loss; may be
        NaN or inf (shown as such), None when unknown."""
        if self.summary is not None:
            value = self.summary.get(metric)
            if value is None and metric in DIVERGED_IF_NOT_FINITE and metric in self.summary:
                return math.nan  # strict JSON's null for NaN/inf
            return float(value) if isinstance(value, (int, float)) else None
        evals = self.evals()
        if evals and metric in ("final_eval_loss", "final_eval_perplexity"):
            loss = evals[-1][1]
            loss = math.nan if loss is None else float(loss)  # null: not finite
            return loss if metric == "final_eval_loss" else math.exp(min(loss, 50.0))
        return None

    def tokens(self) -> int | None:
        """Training tokens done."""
        if self.summary is not None:
            return self.summary.get("tokens")
        return self.metrics[-1].get("tokens") if self.metrics else None


@dataclass
class Report:
    """The runs of a directory, ranked by `metric`."""

    title: str
    runs: list[RunRecord]
    varied: list[str]  # dotted config fields shown as columns
    metric: str = "final_eval_loss"
    mode: str = "min"

    def ranked(self) -> list[RunRecord]:
        """Runs best first; then runs without the metric, then diverged runs and runs whose
        metric is NaN or inf, each group in its original order."""
        sign = 1.0 if self.mode == "min" else -1.0

        def key(run: RunRecord) -> tuple[int, float]:
            value = run.value(self.metric)
            if run.status == "diverged" or (value is not None and finite(value) is None):
                return (2, 0.0)
            return (1, 0.0) if value is None else (0, sign * value)

        return sorted(self.runs, key=key)

    def best(self) -> RunRecord | None:
        """The best finished run (never one that diverged or whose metric is not finite)."""
        return next((run for run in self.ranked() if run.status == "done"
                     and finite(run.value(self.metric)) is not None), None)


# ---------------------------------------------------------------------------------------------
# Reading runs


def _read_json(path: Path) -> Any:
    try:
        return json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as exc:
        raise ReportError(f"cannot read {path}: {exc}") from None


def read_metrics(path: Path) -> list[dict[str, Any]]:
    """metrics.jsonl, one entry per round: a run restarted from an earlier point appended its
    rounds again, and the latest report of a round wins. A torn last line is skipped."""
    by_round: dict[int, dict[str, Any]] = {}
    if not path.is_file():
        return []
    for line in path.read_text().splitlines():
        try:
            metrics = json.loads(line)
        except json.JSONDecodeError:
            continue
        by_round[metrics["round"]] = metrics
    return [by_round[r] for r in sorted(by_round)]


def last_error_line(error: str) -> str:
    """The most telling line of a traceback: its last non-empty one."""
    lines = [line.strip() for line in error.strip().splitlines() if line.strip()]
    return lines[-1] if lines else "unknown error"


def load_run(run_dir: Path, name: str | None = None,
             overrides: dict[str, Any] | None = None) -> RunRecord:
    """The record of one run directory (which may not exist yet: a pending trial)."""
    run = RunRecord(name=name or run_dir.name, run_dir=run_dir, overrides=overrides or {})
    if (run_dir / run_files.CONFIG).is_file():
        run.config = _read_json(run_dir / run_files.CONFIG)
    if (run_dir / run_files.SUMMARY).is_file():
        run.summary = _read_json(run_dir / run_files.SUMMARY)
    if (run_dir / run_files.ERROR).is_file():
        run.error = (run_dir / run_files.ERROR).read_text()
    if (run_dir / run_files.STOPPED).is_file():
        run.stopped = _read_json(run_dir / run_files.STOPPED)
    run.metrics = read_metrics(run_dir / run_files.METRICS)
    return run


def is_run_dir(path: Path) -> bool:
    """Whether `path` holds a training run's files."""
    return any((path / name).is_file() for name in (run_files.CONFIG, run_files.METRICS,
                                                    run_files.SUMMARY))


def varied_fields(configs: list[dict[str, Any]]) -> list[str]:
    """The config fields whose values differ between runs (in config order)."""
    flats = [flatten(c) for c in configs]
    keys = list(dict.fromkeys(k for flat in flats for k in flat))
    return [k for k in keys if k not in _IGNORED_FIELDS
            and len({json.dumps(flat.get(k), sort_keys=True) for flat in flats}) > 1]


def load_report(directory: Path) -> Report:
    """The runs in `directory`: a grid, a single run, or a directory of runs."""
    directory = location(directory)
    if not directory.exists():
        raise ReportError(f"{directory} does not exist; give a grid directory, a run directory "
                          "or a directory of runs")
    if not directory.is_dir():
        raise ReportError(f"{directory} is a file, not a directory; give the directory that "
                          "holds it (a grid directory, a run directory or a directory of runs)")
    if (directory / run_files.GRID).is_file():
        grid = _read_json(directory / run_files.GRID)
        for trial in grid["trials"]:  # each names a directory under runs/, nothing outside
            try:
                check_name(trial["name"], f"{directory / run_files.GRID}: trial name")
            except ValueError as exc:
                raise ReportError(str(exc)) from None
        runs = [load_run(directory / run_files.RUNS / t["name"], t["name"], t.get("overrides"))
                for t in grid["trials"]]
        for run, trial in zip(runs, grid["trials"]):
            run.planned_strategy = trial.get("strategy")
        varied = list(dict.fromkeys(k for t in grid["trials"] for k in t.get("overrides", {})
                                    if k not in _IGNORED_FIELDS))
        return Report(f"grid {grid['name']}", runs, varied, grid.get("metric", "final_eval_loss"),
                      grid.get("mode", "min"))
    if is_run_dir(directory):
        return Report(f"run {directory.name}", [load_run(directory)], [])
    runs = [load_run(path) for path in sorted(directory.iterdir())
            if path.is_dir() and is_run_dir(path)]
    if not runs:
        raise ReportError(f"{directory} holds no runs (no config.json, metrics.jsonl or "
                          "summary.json in it or its subdirectories)")
    return Report(f"runs in {directory.name}", runs,
                  varied_fields([run.config for run in runs if run.config is not None]))


# ---------------------------------------------------------------------------------------------
# Writing the table, the plot and the best config


def _cell(value: Any) -> str:
    if value is None:
        return ""
    if isinstance(value, float):
        return f"{value:.4g}"
    if isinstance(value, (list, tuple)):
        return ",".join(str(v) for v in value)
    return str(value)


def table_rows(report: Report, for_csv: bool = False) -> tuple[list[str], list[list[Any]]]:
    """Header and rows of the results table, best run first. CSV rows keep raw numbers."""
    header = ["trial", "strategy", *report.varied, "final eval loss", "perplexity", "tokens",
              "seconds", "status"]
    rows = []
    for run in report.ranked():
        flat = flatten(run.config) if run.config else {}
        varied = [run.overrides.get(k, flat.get(k)) for k in report.varied]
        loss, ppl = run.value("final_eval_loss"), run.value("final_eval_perplexity")
        tokens = run.tokens()
        seconds = run.summary.get("seconds") if run.summary else None
        if for_csv:
            rows.append([run.name, run.strategy, *varied, loss, ppl, tokens, seconds,
                         run.status])
        else:
            rows.append([run.name, run.strategy, *(_cell(v) for v in varied),
                         "" if loss is None else f"{loss:.4f}",
                         "" if ppl is None else f"{ppl:.1f}",
                         "" if tokens is None else f"{tokens:,}",
                         "" if seconds is None else f"{seconds:.0f}", run.status])
    return header, rows


def markdown_table(report: Report) -> str:
    """The results table in Markdown, best first."""
    header, rows = table_rows(report)
    lines = ["| " + " | ".join(header) + " |",
             "|" + "|".join("---" if i < 2 + len(report.varied) or i == len(header) - 1
                            else "--:" for i in range(len(header))) + "|"]
    lines += ["| " + " | ".join(str(cell) for cell in row) + " |" for row in rows]
    return "\n".join(lines)


def markdown_report(report: Report) -> str:
    """results.md: the table, what ranks it, and why any run failed."""
    text = [f"# {report.title}", "",
            f"Ranked by `{report.metric}` ({'lower' if report.mode == 'min' else 'higher'} is "
            "better). final eval loss: the validation loss at the end (for unfinished runs, the "
            "latest); seconds: the whole run, start-up included; diverged: finished with a "
            "non-finite eval loss, ranked last; stopped: stopped early by the grid's "
            "scheduler, never the best.", "", markdown_table(report)]
    failed = [run for run in report.runs if run.status == "failed"]
    if failed:
        text += ["", "## Failed", ""]
        text += [f"- `{run.name}`: {last_error_line(run.error or '')} "
                 f"(`{run.run_dir / run_files.ERROR}`)" for run in failed]
    stopped = [run for run in report.runs if run.status == "stopped"]
    if stopped:
        text += ["", "## Stopped early", ""]
        text += [f"- `{run.name}`: {stopped_reason(run)} (`{run.run_dir / run_files.STOPPED}`)"
                 for run in stopped]
    return "\n".join(text) + "\n"


def stopped_reason(run: RunRecord) -> str:
    """`round 1, eval_loss 5.6400: stopped early by asha on eval_loss ...` of a stopped run."""
    marker = run.stopped or {}
    value = finite(marker.get("value"))
    return (f"round {marker.get('round', '?')}, {marker.get('metric', 'metric')} "
            + ("not a finite number" if value is None else f"{value:.4f}")
            + f": {marker.get('reason', 'stopped early by the scheduler')}")


def csv_table(report: Report) -> str:
    """The results table as CSV, best first, numbers unformatted."""
    header, rows = table_rows(report, for_csv=True)
    out = io.StringIO()
    writer = csv.writer(out)
    writer.writerow(header)
    writer.writerows(rows)
    return out.getvalue()


def plot_eval_loss(report: Report, path: Path) -> bool:
    """eval_loss.png: eval loss against tokens, one labelled line per run; left the whole
    run, right the second half zoomed in, where strategies differ. False without matplotlib."""
    try:
        import matplotlib
    except ImportError:
        return False
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import EngFormatter

    # NaN/inf points are left out (matplotlib cannot scale an axis to them); a run with
    # none left has no line, its status is in the table.
    evals = {id(run): [(t, loss) for t, loss in run.evals() if finite(loss) is not None]
             for run in report.runs}
    runs = [run for run in report.ranked() if evals[id(run)]]
    fig, (full, zoom) = plt.subplots(1, 2, figsize=(12, 5))
    halfway = max((t for run in runs for t, _ in evals[id(run)]), default=0) / 2
    zoom_values = []
    for run in runs:
        tokens, losses = zip(*evals[id(run)])
        label = run.name if run.status == "done" else f"{run.name} ({run.status})"
        (line,) = full.plot(tokens, losses, marker="o", markersize=3, label=label)
        half = [(t, v) for t, v in zip(tokens, losses) if t >= halfway]
        if half:
            zoom.plot(*zip(*half), marker="o", markersize=3, color=line.get_color())
            zoom_values += [v for _, v in half]
    for ax, title in ((full, "whole run"), (zoom, "second half")):
        ax.xaxis.set_major_formatter(EngFormatter())
        ax.set_xlabel("training tokens")
        ax.set_ylabel("eval loss")
        ax.set_title(title)
        ax.grid(alpha=0.3)
    if zoom_values:
        low, high = min(zoom_values), max(zoom_values)
        zoom.set_ylim(low - 0.05 * (high - low + 1e-3), high + 0.05 * (high - low + 1e-3))
    fig.suptitle(f"{report.title}: eval loss")
    if runs:
        full.legend(fontsize="small")
    fig.tight_layout()
    image = io.BytesIO()  # through bytes: `path` may be on object storage
    fig.savefig(image, format="png", dpi=90)
    path.write_bytes(image.getvalue())
    plt.close(fig)
    return True


def best_config_yaml(report: Report) -> str | None:
    """The best finished run's config as YAML for `python -m isoloco_ray.train`, or None.

    Its name and storage are dropped, so the train CLI starts a fresh run instead of
    refusing the finished one."""
    import yaml

    best = report.best()
    if best is None or best.config is None:
        return None
    config = strict_json.finite_or_none(best.config)
    for key in ("name", "storage_path"):
        config.get("run", {}).pop(key, None)
    header = (f"# Best of {report.title}: {best.name}, {report.metric} "
              f"{best.value(report.metric):.4f}\n"
              f"# python -m isoloco_ray.train best_config.yaml\n")
    return header + yaml.safe_dump(config, sort_keys=False)


@dataclass
class Written:
    """Paths of what `write_report` wrote."""

    markdown: Path
    csv: Path
    plot: Path | None
    best_config: Path | None


def write_report(directory: Path, report: Report | None = None) -> tuple[Report, Written]:
    """Write results.md, results.csv, eval_loss.png and best_config.yaml into `directory`."""
    report = report or load_report(directory)
    directory = location(directory)
    written = Written(directory / "results.md", directory / "results.csv", None, None)
    written.markdown.write_text(markdown_report(report))
    written.csv.write_text(csv_table(report))
    if plot_eval_loss(report, directory / "eval_loss.png"):
        written.plot = directory / "eval_loss.png"
    best = best_config_yaml(report) if len(report.runs) > 1 else None
    if best is not None:
        written.best_config = directory / "best_config.yaml"
        written.best_config.write_text(best)
    return report, written


def print_report(report: Report, written: Written) -> None:
    """The table and the paths of the files, on stdout."""
    print(markdown_table(report))
    for run in report.runs:
        if run.status == "failed":
            print(f"failed: {run.name}: {last_error_line(run.error or '')}")
    print(f"table: {written.markdown} (and {written.csv.name})")
    print(f"plot: {written.plot}" if written.plot else
          "plot: skipped, matplotlib is not installed (pip install matplotlib)")
    if written.best_config:
        print(f"best config: {written.best_config}")


def main(argv: list[str] | None = None) -> int:
    """CLI entry point; returns the exit status (2 when there is nothing to report)."""
    import argparse

    parser = argparse.ArgumentParser(
        prog="python -m isoloco_ray.report",
        description="Results table (Markdown, CSV), eval-loss plot and best config of a grid "
                    "directory, a run directory, or a directory of runs.")
    parser.add_argument("directory", type=location)
    parser.add_argument("--metric", choices=SUMMARY_METRICS,
                        help="rank by this summary figure (default: the grid's, else "
                             "final_eval_loss)")
    parser.add_argument("--mode", choices=("min", "max"), help="lower or higher is better")
    args = parser.parse_args(sys.argv[1:] if argv is None else argv)
    try:
        report = load_report(args.directory)
    except ReportError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    report.metric = args.metric or report.metric
    report.mode = args.mode or ("max" if args.metric == "tokens_per_s" else report.mode)
    print_report(report, write_report(args.directory, report)[1])
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
