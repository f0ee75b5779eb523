"""benchmarks/gpu_check.sh's dry run (--cpu): the one-GPU check's torch steps, at CPU sizes, so
the script a lent GPU runs is known to work before it gets one; its Ray step's flags, a valid
train config; and that the steps before its Ray step need no Ray, torchft or wandb, which the
lent machine's image lacks."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


# The checks that need torch alone: what the lent GPU machine's image runs.
TORCH_CHECKS = "step-tiny step-demo round merge agree"


def test_the_dry_run_passes_every_torch_check_and_writes_the_table(tmp_path):
    env = {**os.environ, "PYTHON": sys.executable, "OUT": str(tmp_path), "CHECKS": TORCH_CHECKS}
    out = subprocess.run(["bash", "benchmarks/gpu_check.sh", "--cpu"], cwd=ROOT, env=env,
                         capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    rows = json.loads((tmp_path / "gpu_check.json").read_text())["rows"]
    assert {row["check"].split(" (")[0] for row in rows} == set(TORCH_CHECKS.split())
    assert not [row for row in rows if row["result"].startswith(("FAILED", "TIMEOUT"))]
    agree = [row["result"] for row in rows if row["check"].startswith("agree")]
    assert [line.split(":")[0] for line in agree] == ["codecs", "background", "resume"]
    assert all(": ok " in line for line in agree)


def test_the_ray_steps_flags_are_a_valid_train_config():
    """The Ray step (the train CLI, where Ray is importable: never on the lent GPU machine's
    image) is a tiny run like the Ray Train tests' own; its command line is checked here
    without a Ray run: every flag is one load_config takes, on CPU and on GPU."""
    from isoloco_ray.config import load_config

    script = (ROOT / "benchmarks" / "gpu_check.sh").read_text()
    command = script.split("\n  check train ", 1)[1].split("\nelif", 1)[0]
    assert "-m isoloco_ray.train" in command
    flags = re.findall(r'(--[a-z_.]+)=("[^"]*"|\S+)', command.replace("\\\n", " "))
    assert {name for name, _ in flags} >= {"--model.preset", "--scaling.use_gpu",
                                           "--run.rounds", "--data.path"}
    for gpu in ("false", "true"):
        values = {"$GPU": gpu, '"$OUT/data"': "/data", '"$OUT/runs"': "/runs",
                  '"gpu-check-$(date +%s)"': "gpu-check-1"}
        cfg = load_config([f"{name}={values.get(value, value)}" for name, value in flags])
        assert cfg.scaling.use_gpu == (gpu == "true") and cfg.model.preset == "tiny"


# What the lent GPU machine's image lacks (docs/cluster.md "The one-GPU check"): the checks
# before the Ray step must run without them.
ABSENT = ("ray", "torchft", "wandb")


def unimportable(tmp_path: Path, names: tuple[str, ...]) -> Path:
    """A folder for PYTHONPATH whose sitecustomize makes `names` unimportable in every Python
    process started with it (the script starts one per check). None in sys.modules: `import`
    raises ImportError, and importlib.util.find_spec, with which transformers probes optional
    packages, answers None as for an absent one."""
    site = tmp_path / "site"
    site.mkdir()
    (site / "sitecustomize.py").write_text(
        f"import sys\nsys.modules.update(dict.fromkeys({list(names)!r}))\n")
    return site


def test_the_torch_only_checks_import_without_ray_torchft_and_wandb(tmp_path):
    code = ("import sys\n"
            "try:\n    import ray\nexcept ImportError:\n    pass\n"
            "else:\n    sys.exit('ray is still importable: the test checks nothing')\n"
            "sys.path.insert(0, 'benchmarks')\n"
            "import gpu_step, gpu_round, merge, gpu_agree\n"
            "print('imported')\n")
    env = {**os.environ, "PYTHONPATH": f"{unimportable(tmp_path, ABSENT)}:{ROOT}"}
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True,
                         text=True, timeout=120)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    assert out.stdout.split() == ["imported"]


def test_without_ray_the_script_skips_its_ray_step_with_one_row(tmp_path):
    env = {**os.environ, "PYTHON": sys.executable, "OUT": str(tmp_path / "out"),
           "PYTHONPATH": str(unimportable(tmp_path, ABSENT)), "CHECKS": "train"}
    out = subprocess.run(["bash", "benchmarks/gpu_check.sh", "--cpu"], cwd=ROOT, env=env,
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    rows = json.loads((tmp_path / "out" / "gpu_check.json").read_text())["rows"]
    assert [row["check"] for row in rows] == ["train"]
    assert rows[0]["result"].startswith("SKIPPED: ")
    assert "cannot import ray" in rows[0]["result"]
    assert [line for line in out.stderr.splitlines() if "cannot import ray" in line] == [
        rows[0]["result"]]
