"""benchmarks/gpu_check.sh's dry run (--cpu): the one-GPU check's every step, at CPU sizes, so
the script a lent GPU runs is known to work before it gets one."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_the_dry_run_passes_every_check_and_writes_the_table(tmp_path, own_ray):
    env = {**os.environ, "PYTHON": sys.executable, "OUT": str(tmp_path)}
    out = subprocess.run(["bash", "benchmarks/gpu_check.sh", "--cpu"], cwd=ROOT, env=env,
                         capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    rows = json.loads((tmp_path / "gpu_check.json").read_text())["rows"]
    assert {row["check"].split(" (")[0] for row in rows} == {
        "step-tiny", "step-demo", "round", "merge", "agree", "train"}
    assert not [row for row in rows if row["result"].startswith(("FAILED", "TIMEOUT"))]
    agree = [row["result"] for row in rows if row["check"].startswith("agree")]
    assert [line.split(":")[0] for line in agree] == ["codecs", "background", "resume"]
    assert all(": ok " in line for line in agree)
    assert [row["result"] for row in rows if row["check"].startswith("train")][0].startswith(
        "final eval loss ")
