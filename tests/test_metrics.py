"""metrics.py: every figure a run reports is a field of RoundMetrics or RunSummary, and the
names the grid, the report and the console use are read from those fields."""

from __future__ import annotations

import dataclasses
import math

import pytest

from helpers import TINY_RUN
from isoloco_ray.config import load_config
from isoloco_ray.metrics import (DIVERGED_IF_NOT_FINITE, ROUND_METRICS, SUMMARY_METRICS,
                                 RoundMetrics, RunSummary, format_progress)
from isoloco_ray.workers.local import run_local

TINY = TINY_RUN + ["--scaling.replicas=2", "--scaling.replicas_per_worker=2", "--inner.steps=2",
                   "--run.rounds=2", "--data.micro_batch_size=2", "--run.eval_tokens=512",
                   "--run.eval_every=2", "--run.checkpoint_every=2"]


def field_names(record: type) -> set[str]:
    return {f.name for f in dataclasses.fields(record)}


def test_every_report_and_the_summary_of_a_run_use_only_declared_names(small_dataset):
    reports = []
    summary, _ = run_local(load_config(TINY), small_dataset, reports=reports)
    assert [report["round"] for report in reports] == [0, 1, 2]
    for report in reports:
        assert set(report) <= field_names(RoundMetrics), set(report) - field_names(RoundMetrics)
        assert RoundMetrics.from_dict(report).as_dict() == report  # nothing lost either way
    assert "eval_loss" not in reports[1] and "eval_loss" in reports[2]  # eval_every=2
    assert "state_checksum" in reports[1] and "state_sha256" in reports[2]  # checkpoint round
    assert set(summary) <= field_names(RunSummary), set(summary) - field_names(RunSummary)
    assert RunSummary.from_dict(summary).as_dict() == summary


def test_a_name_that_is_not_a_field_is_refused_when_built_and_ignored_when_read():
    with pytest.raises(TypeError, match="final_loss"):
        RunSummary(final_loss=1.0)
    tune_result = {"round": 1, "tokens": 96, "loss": 5.0, "training_iteration": 1}
    assert RoundMetrics.from_dict(tune_result).as_dict() == {"round": 1, "tokens": 96,
                                                             "loss": 5.0}


def test_derived_names_are_the_marked_fields_in_order(tmp_path, capsys):
    assert ROUND_METRICS == ("eval_loss", "eval_perplexity", "loss")
    assert SUMMARY_METRICS == ("final_eval_loss", "final_eval_perplexity", "tokens_per_s",
                               "seconds", "train_seconds", "outer_bytes_per_round")
    assert set(DIVERGED_IF_NOT_FINITE) <= set(SUMMARY_METRICS)
    from isoloco_ray import report
    from isoloco_ray.grids.spec import SummaryMetric

    assert SummaryMetric.__args__ == SUMMARY_METRICS
    with pytest.raises(SystemExit):
        report.main([str(tmp_path), "--metric", "final_loss"])
    choices = ", ".join(f"'{name}'" for name in SUMMARY_METRICS)
    assert f"invalid choice: 'final_loss' (choose from {choices})" in capsys.readouterr().err


def test_progress_line_of_an_initial_evaluation_and_of_a_round():
    assert format_progress({"round": 0, "tokens": 0, "eval_loss": math.log(384),
                            "eval_perplexity": 384.0}, 8) == \
        "round    0/8 | eval 5.9506 (ppl 384.0)"
    line = RoundMetrics(round=2, tokens=192, loss=5.5, tokens_per_s=1234.0, inner_seconds=1.0,
                        outer_comm_seconds=0.25, outer_merge_seconds=0.5,
                        outer_bytes_received=3 * 2**20, dropped_replicas=[1]).progress_line(8)
    assert line == ("round    2/8 | loss 5.5000 | dropped replicas [1] | 1,234 tok/s | "
                    "inner 1.0s comm 0.25s merge 0.50s 3.0 MiB in")
