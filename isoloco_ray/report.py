"""`python -m isoloco_ray.report DIR`: results table, eval-loss plot and best config of runs.

DIR is a grid directory (written by `python -m isoloco_ray.tune`: `grid.json` and
`runs/<trial>/`), a single run directory, or a directory holding run directories. Everything is
read from the runs' own files (run_records.py), so a report can be regenerated at any time,
without Ray, also while a grid is still running.

Written to DIR: `results.md` and `results.csv` (one row per run, best first), `eval_loss.png`
(eval loss against training tokens, one line per run; needs matplotlib, the `plot` extra) and,
for several runs, `best_config.yaml` (the best finished run's config, for the train CLI).
Diverged runs (a final eval loss that is not a finite number) rank last and are never the best.
"""

from __future__ import annotations

import csv
import io
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from isoloco_ray import own_files, run_files, strict_json
from isoloco_ray.config import flatten
from isoloco_ray.metrics import SUMMARY_METRICS
from isoloco_ray.run_records import (
    Report,
    ReportError,
    RunRecord,
    finite,
    last_error_line,
    load_report,
)
from isoloco_ray.storage import location


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


def plot_eval_loss(report: Report) -> bytes | None:
    """eval_loss.png's bytes: eval loss against tokens, one labelled line per run; left the
    whole run, right the second half zoomed in, where strategies differ. None without
    matplotlib."""
    try:
        import matplotlib
    except ImportError:
        return None
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import EngFormatter

    # NaN/inf points are left out (matplotlib cannot scale an axis to them); a run with
    # none left has no line, its status is in the table.
    evals = {id(run): [(t, loss) for t, loss in run.evals() if finite(loss) is not None]
             for run in report.runs}
    runs = [run for run in report.ranked() if evals[id(run)]]
    # The legend goes below both plots (constrained layout makes room for it): trial names
    # can be long (every setting that tells them apart), and inside a plot they hide its lines.
    fig, (full, zoom) = plt.subplots(1, 2, figsize=(12, 5 + 0.2 * len(runs)),
                                     layout="constrained")
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
        fig.legend(loc="outside lower center", fontsize="small")
    image = io.BytesIO()
    fig.savefig(image, format="png", dpi=90)
    plt.close(fig)
    return image.getvalue()


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


REPORT_FILES = ("results.md", "results.csv", "eval_loss.png", "best_config.yaml")


def write_report(directory: Path, report: Report | None = None) -> tuple[Report, Written]:
    """Write results.md, results.csv, eval_loss.png and best_config.yaml into `directory`.
    Raises ReportError, writing nothing, when any of those names holds a file a report did
    not write there (the user's own, a link, or one changed since: own_files); a link is
    never written through."""
    report = report or load_report(directory)
    directory = location(directory)
    foreign = own_files.foreign_files(directory, REPORT_FILES)
    if foreign:
        raise ReportError(
            f"{directory} holds {', '.join(foreign)}, which a report did not write there (or "
            "which changed since): a report never replaces them; move them elsewhere and run "
            "the report again")
    files: dict[str, bytes | str] = {"results.md": markdown_report(report),
                                     "results.csv": csv_table(report)}
    plot = plot_eval_loss(report)
    if plot is not None:
        files["eval_loss.png"] = plot
    best = best_config_yaml(report) if len(report.runs) > 1 else None
    if best is not None:
        files["best_config.yaml"] = best
    own_files.write_own(directory, files)
    return report, Written(directory / "results.md", directory / "results.csv",
                           directory / "eval_loss.png" if plot is not None else None,
                           directory / "best_config.yaml" if best is not None else None)


def print_report(report: Report, written: Written) -> None:
    """The table and the paths of the files, on stdout; each run left out, on stderr."""
    for why in report.skipped:
        print(f"skipped: {why}", file=sys.stderr)
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
    try:
        written = write_report(args.directory, report)[1]
    except ReportError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    print_report(report, written)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
