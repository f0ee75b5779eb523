"""The cluster files: every cluster YAML passes Ray's own config validation offline and keeps
the safe defaults; a tiny training submitted as a Ray job to a local head succeeds."""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[1]
CLUSTER_YAMLS = sorted(p for p in (ROOT / "cluster").glob("*.yaml")
                       if "provider" in yaml.safe_load(p.read_text()))

# Strings that look like credentials: AWS access key ids, private keys, 64-hex tokens (Ray's
# token format), AWS secret/session keys, 12-digit account ids.
SECRET_PATTERNS = [r"AKIA[0-9A-Z]{16}", r"-----BEGIN [A-Z ]*PRIVATE KEY", r"\b[0-9a-f]{64}\b",
                   r"aws_secret_access_key|aws_session_token", r"(?<![\w.-])\d{12}(?![\w.-])"]


def test_cluster_yamls_exist():
    assert {p.name for p in CLUSTER_YAMLS} >= {"h100.yaml", "gcp-a3.yaml"}


@pytest.mark.parametrize("path", CLUSTER_YAMLS, ids=lambda p: p.name)
def test_cluster_yaml_passes_ray_validation_and_is_safe(path):
    from ray.autoscaler._private.util import prepare_config, validate_config

    raw = yaml.safe_load(path.read_text())
    config = prepare_config(raw)  # fills in the provider's defaults, offline
    validate_config(config)       # Ray's JSON schema + its consistency checks

    head = config["available_node_types"][config["head_node_type"]]
    assert head["resources"] == {"CPU": 0}  # no training work on the head
    start = " ".join(config["head_start_ray_commands"])
    assert "--dashboard-host=127.0.0.1" in start and "0.0.0.0" not in start
    assert "--num-cpus=0" in start
    # Token auth: the token is mounted on every node and every node/driver uses it.
    assert "~/.ray/auth_token" in config["file_mounts"]
    assert any("RAY_AUTH_MODE=token" in c for c in config["initialization_commands"])
    for command in config["head_start_ray_commands"] + config["worker_start_ray_commands"]:
        assert "ray stop" in command or "RAY_AUTH_MODE=token" in command
    # The pinned Ray and a CUDA torch are installed, the project from the mounted working dir.
    setup = " ".join(config["setup_commands"])
    assert '"ray[default,train,tune,data]==2.60.0"' in setup and "torch==2.13.0" in setup
    assert "pip install -q -e ~/isoloco_ray" in setup
    text = path.read_text()
    for pattern in SECRET_PATTERNS:
        assert not re.search(pattern, text), f"{path.name} holds something like a secret"


def test_misspelt_key_is_rejected():
    """The validation above really checks the schema."""
    import jsonschema
    from ray.autoscaler._private.util import prepare_config, validate_config

    raw = yaml.safe_load((ROOT / "cluster" / "h100.yaml").read_text())
    raw["max_wrokers"] = 2
    with pytest.raises(jsonschema.ValidationError):
        validate_config(prepare_config(raw))


def test_cluster_example_config_and_runtime_env():
    from isoloco_ray.config import load_config

    cfg = load_config([str(ROOT / "cluster" / "178m_diloco.yaml")])
    assert cfg.scaling.use_gpu and cfg.scaling.replicas == 8 and cfg.model.preset == "178M"
    assert str(cfg.run.storage_path).startswith("/mnt/shared")
    env = yaml.safe_load((ROOT / "cluster" / "runtime_env.yaml").read_text())
    assert set(env) == {"excludes", "env_vars"}
    assert ".venv" in env["excludes"] and ".git" in env["excludes"]
    assert env["env_vars"]["RAY_AUTH_MODE"] == "token"
    assert all(isinstance(v, str) for v in env["env_vars"].values())  # Ray wants strings


# ------------------------------------------------------------------------------------------
# A real job against a real head.


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def session_processes(sid: int) -> list[int]:
    """Pids of the processes in session `sid` (Linux /proc)."""
    pids = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                fields = (entry / "stat").read_text().rsplit(")", 1)[1].split()
            except OSError:
                continue
            if int(fields[3]) == sid and fields[0] != "Z":
                pids.append(int(entry.name))
    return pids


def stop_session(sid: int, grace: float = 2.0) -> list[int]:
    """SIGTERM every process of session `sid`, SIGKILL what is left after `grace` s; returns
    the pids still alive at the end (should be none)."""
    for sig, wait in ((signal.SIGTERM, grace), (signal.SIGKILL, 5.0)):
        for pid in session_processes(sid):
            try:
                os.kill(pid, sig)
            except ProcessLookupError:
                pass
        deadline = time.monotonic() + wait
        while session_processes(sid) and time.monotonic() < deadline:
            time.sleep(0.2)
    return session_processes(sid)


@pytest.fixture
def ray_head():
    """A Ray head on this machine, as on a cluster: dashboard/Jobs API on 127.0.0.1, token
    auth; yields (jobs address, client env).

    Not stopped with `ray stop`, which kills every Ray process of the user (other tests'
    clusters, other people's work): `ray start` runs as the leader of a new session, every
    process the head starts (GCS, raylet, dashboard, workers) inherits that session, and
    teardown signals exactly that session. `--temp-dir` keeps its address file and logs apart.
    """
    if not sys.platform.startswith("linux"):
        pytest.skip("stops the head through /proc")
    temp_dir = tempfile.mkdtemp(prefix="rj", dir="/tmp")  # short: Ray's socket paths must fit
    token = os.urandom(32).hex()  # in the environment only: nothing written to ~/.ray
    env = dict(os.environ, RAY_AUTH_MODE="token", RAY_AUTH_TOKEN=token,
               RAY_TRAIN_ENABLE_PRINT_PATCH="0",
               # Read by the raylet: Ray Data starts a reader per replica stream at once.
               RAY_worker_maximum_startup_concurrency="8",
               # The job's `python` must be this venv's (workers inherit the head's env).
               PATH=f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}")
    env.pop("RAY_ADDRESS", None)
    ray_bin = str(Path(sys.executable).parent / "ray")
    dashboard_port = free_port()
    head = subprocess.Popen(
        [ray_bin, "start", "--head", f"--port={free_port()}", "--dashboard-host=127.0.0.1",
         f"--dashboard-port={dashboard_port}", f"--dashboard-agent-listen-port={free_port()}",
         f"--ray-client-server-port={free_port()}", "--num-cpus=4", "--include-dashboard=true",
         f"--temp-dir={temp_dir}", "--disable-usage-stats",
         f"--object-store-memory={512 * 1024**2}"],
        env=env, start_new_session=True, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
        text=True)
    try:
        out, _ = head.communicate(timeout=120)
        assert head.returncode == 0, out[-3000:]
        yield f"http://127.0.0.1:{dashboard_port}", env
    finally:
        if head.poll() is None:
            head.kill()
        left = stop_session(head.pid)
        shutil.rmtree(temp_dir, ignore_errors=True)
        assert not left, f"Ray processes left behind: {left}"


def test_job_submit_runs_a_tiny_training(ray_head, small_dataset, tmp_path):
    address, env = ray_head
    job_id = f"isoloco-test-{os.getpid()}-{time.time_ns()}"
    submit = [
        str(Path(sys.executable).parent / "ray"), "job", "submit", "--address", address,
        "--submission-id", job_id, "--working-dir", str(ROOT),
        "--runtime-env", str(ROOT / "cluster" / "runtime_env.yaml"), "--",
        "python", "-m", "isoloco_ray.train", "--model.preset=tiny",
        f"--data.path={small_dataset}", "--data.seq_len=64", "--data.batch_size=4",
        "--scaling.replicas=2", "--scaling.replicas_per_worker=1", "--inner.steps=2",
        "--run.rounds=2", "--run.eval_every=2", "--run.eval_tokens=512",
        f"--run.storage_path={tmp_path}", "--run.name=job"]
    done = subprocess.run(submit, env=env, capture_output=True, text=True, timeout=300)
    logs = done.stdout[-4000:] + done.stderr[-4000:]
    assert done.returncode == 0, logs
    status = subprocess.run([submit[0], "job", "status", "--address", address, job_id],
                            env=env, capture_output=True, text=True, timeout=60)
    assert "succeeded" in (status.stdout + status.stderr).lower(), logs
    assert f"summary: {tmp_path / 'job' / 'summary.json'}" in done.stdout, logs
    summary = json.loads((tmp_path / "job" / "summary.json").read_text())
    assert summary["rounds"] == 2 and summary["replicas"] == 2
    assert summary["final_eval_loss"] < summary["initial_eval_loss"]
    # Without the token the Jobs API refuses the client.
    no_token = {k: v for k, v in env.items() if k not in ("RAY_AUTH_TOKEN", "RAY_AUTH_MODE")}
    no_token["HOME"] = str(tmp_path)  # and no ~/.ray/auth_token to fall back on
    refused = subprocess.run([submit[0], "job", "list", "--address", address], env=no_token,
                             capture_output=True, text=True, timeout=60)
    assert refused.returncode != 0
    assert "auth" in (refused.stdout + refused.stderr).lower(), refused.stderr[-2000:]
