"""Shared fixtures (a small real dataset prepared once per session, one Ray cluster, an S3
server), and the markers every test gets from what it uses:

- `ray`: the test starts Ray (it uses `ray_cluster`, `ray_head` or `own_ray`, or is
  `multinode`). Any other test that starts a Ray process fails (`_no_ray_unless_marked`), so
  `pytest -m "not ray"`, the fast selection, starts none.
- `s3`: the test talks to the loopback S3 server (`s3_server`, directly or through a fixture).
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import threading
import time
import uuid

import pytest

from isoloco_ray.testing import synthetic_documents

# Ray reads these when it starts; quiet and fast for tests (docs/design.md, "Ray specifics").
os.environ.setdefault("RAY_TRAIN_ENABLE_PRINT_PATCH", "0")
os.environ.setdefault("RAY_TRAIN_HEALTH_CHECK_INTERVAL_S", "0.2")
os.environ.setdefault("RAY_TRAIN_ENABLE_PREEMPTION_WATCHER", "0")
os.environ.setdefault("RAY_TRAIN_ENABLE_STATE_ACTOR_RECONCILIATION", "0")
# torchft's Rust side logs every quorum at INFO straight to the process's stderr, past pytest's
# capture; warnings and errors still show. Read when torchft is first imported.
os.environ.setdefault("RUST_LOG", "warn")


def _free_loopback_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


# S3 for the tests is the `s3_server` fixture's, on loopback, never a real one. Set before any
# Ray process starts, so the session cluster's workers (pyarrow, s3fs) read it too.
S3_PORT = _free_loopback_port()
os.environ.update({"AWS_ENDPOINT_URL": f"http://127.0.0.1:{S3_PORT}",
                   "AWS_ACCESS_KEY_ID": "testing", "AWS_SECRET_ACCESS_KEY": "testing",
                   "AWS_DEFAULT_REGION": "us-east-1", "AWS_EC2_METADATA_DISABLED": "true"})
for _variable in ("AWS_PROFILE", "AWS_SESSION_TOKEN", "AWS_CONFIG_FILE",
                  "AWS_SHARED_CREDENTIALS_FILE"):
    os.environ.pop(_variable, None)


@pytest.fixture(scope="session", autouse=True)
def _gloo_processes_kept():
    """Multi-rank local runs (workers.local.in_gloo_group) reuse their spawned processes."""
    from isoloco_ray.workers.local import keep_processes

    with keep_processes():
        yield


@pytest.fixture(scope="session")
def small_dataset(tmp_path_factory):
    """A prepared dataset (format.py): BPE vocab 384, blocks of 64 tokens, 16 blocks a shard."""
    from isoloco_ray.data.prepare.documents import prepare_dataset

    out = tmp_path_factory.mktemp("data") / "small"
    prepare_dataset(synthetic_documents(600), out, vocab_size=384, block_len=64,
                    shard_blocks=16, valid_fraction=0.05, test_fraction=0.02, seed=0,
                    source_name="synthetic test text")
    return out


@pytest.fixture
def data(small_dataset, tmp_path, monkeypatch):
    """A private copy of the small dataset, never scanned, in the default scan mode: for tests
    that damage data or count scans."""
    import shutil

    from isoloco_ray.data import checks

    monkeypatch.delenv(checks.VERIFY_ENV, raising=False)
    copy = tmp_path / "ds"
    shutil.copytree(small_dataset, copy)
    (copy / checks.STAMP_FILE).unlink(missing_ok=True)  # other tests may have verified it
    return copy


@pytest.fixture(scope="session")
def ray_cluster():
    """One local Ray cluster for the whole session, more logical CPUs than cores, started the
    way train.py starts one (loopback only, token auth)."""
    import ray
    import ray.data

    from isoloco_ray.local_ray import start_local_cluster

    # With the dashboard, as tune.py starts its clusters (Ray Train's placement group cleaner
    # needs its state API).
    start_local_cluster(4, object_store_memory=512 * 1024**2, include_dashboard=True)
    ray.data.DataContext.get_current().enable_progress_bars = False
    yield
    ray.shutdown()


@pytest.fixture(scope="session")
def s3_server():
    """An S3-compatible server (moto's server mode) on loopback for the session; the AWS_*
    variables above point every S3 client at it. Yields its endpoint URL."""
    import urllib.request

    endpoint = os.environ["AWS_ENDPOINT_URL"]
    server = subprocess.Popen([sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p",
                               str(S3_PORT)], stdout=subprocess.DEVNULL,
                              stderr=subprocess.DEVNULL)
    deadline = time.monotonic() + 60
    while True:
        try:
            urllib.request.urlopen(endpoint, timeout=1).close()
            break
        except OSError:
            if server.poll() is not None or time.monotonic() > deadline:
                server.kill()
                raise RuntimeError(f"moto's S3 server did not start on {endpoint}") from None
            time.sleep(0.2)
    yield endpoint
    server.terminate()
    server.wait(timeout=30)


@pytest.fixture
def s3_bucket(s3_server):
    """A new, empty bucket on the loopback S3 server; its name."""
    import boto3

    name = f"test-{uuid.uuid4().hex[:12]}"
    boto3.client("s3").create_bucket(Bucket=name)
    return name


@pytest.fixture
def s3_data(small_dataset, s3_bucket) -> str:
    """A copy of `small_dataset` at s3://BUCKET/data, without a scan stamp; its URI."""
    uri = f"s3://{s3_bucket}/data"
    import pyarrow.fs

    from isoloco_ray.data.format import STAMP_FILE
    from isoloco_ray.storage import arrow_location, location

    filesystem, where = arrow_location(uri)
    pyarrow.fs.copy_files(str(small_dataset), where, source_filesystem=pyarrow.fs.LocalFileSystem(),
                          destination_filesystem=filesystem)
    (location(uri) / STAMP_FILE).unlink(missing_ok=True)  # other tests may have scanned the copy
    return uri


@pytest.fixture(scope="module")
def one_thread():
    """Torch on one intra-op thread for a test module, restored afterwards: a reference
    computed in this process then runs on as many threads as run_local's ranks (one), which
    float64 results depend on with some CPUs' MKL (seen on an AMD EPYC)."""
    import torch

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture
def no_ray(monkeypatch):
    """Fails the test if the train or tune CLI gets as far as starting Ray."""
    from isoloco_ray import train, tune

    def refuse(*args, **kwargs):
        raise AssertionError("Ray was started")

    monkeypatch.setattr(train, "start_ray", refuse)
    monkeypatch.setattr(tune, "start_cluster", refuse)


# -- markers from what a test uses, and the guard that keeps Ray out of the rest ---------------

RAY_FIXTURES = {"ray_cluster", "ray_head", "own_ray"}
RAY_PROCESS_NAMES = {"raylet", "gcs_server"}


@pytest.fixture
def own_ray():
    """For a test that starts Ray processes of its own (a CLI in a subprocess, a multi-node
    cluster): using it marks the test `ray`."""


def pytest_collection_modifyitems(config, items):
    for item in items:
        used = set(getattr(item, "fixturenames", ()))
        if used & RAY_FIXTURES or item.get_closest_marker("multinode"):
            item.add_marker(pytest.mark.ray)
        if "s3_server" in used:
            item.add_marker(pytest.mark.s3)
    # The Ray tests last, in their files' order, those on the session's cluster after those
    # with clusters of their own: the session's cluster, once started, idles at about a
    # seventh of a core (its dashboard, agents and idle workers), which every test run after
    # its start would share the 2 cores with.
    items.sort(key=lambda item: (item.get_closest_marker("ray") is not None,
                                 "ray_cluster" in getattr(item, "fixturenames", ())))


def _parent(pid: int) -> int:
    with open(f"/proc/{pid}/stat") as stat:
        return int(stat.read().rsplit(")", 1)[1].split()[1])


def ray_processes() -> set[int]:
    """Process ids of the Ray core processes (GCS, raylets) that descend from this process
    (other users' clusters on the machine are not this test's)."""
    found = set()
    for entry in os.scandir("/proc"):
        if entry.name.isdigit():
            try:
                with open(f"/proc/{entry.name}/comm") as comm:
                    if comm.read().strip() not in RAY_PROCESS_NAMES:
                        continue
                pid = int(entry.name)
                while pid > 1 and pid != os.getpid():
                    pid = _parent(pid)
                if pid == os.getpid():
                    found.add(int(entry.name))
            except (OSError, ValueError, IndexError):  # gone meanwhile
                pass
    return found


@pytest.fixture(autouse=True)
def _no_ray_unless_marked(request, monkeypatch):
    """Fails a test without the `ray` marker that starts Ray: `ray.init` in this process
    raises, and Ray processes started meanwhile by a subprocess are seen by polling /proc."""
    if request.node.get_closest_marker("ray") or not sys.platform.startswith("linux"):
        yield
        return
    import ray

    def refuse(*args, **kwargs):
        raise AssertionError("this test starts Ray: give it the ray_cluster fixture (or "
                             "own_ray for Ray processes of its own), which marks it `ray`")

    monkeypatch.setattr(ray, "init", refuse)
    before = ray_processes()
    started: set[int] = set()
    done = threading.Event()

    def watch() -> None:
        while not done.wait(0.2):
            started.update(ray_processes() - before)

    watcher = threading.Thread(target=watch, daemon=True)
    watcher.start()
    yield
    done.set()
    watcher.join()
    started.update(ray_processes() - before)
    if started:
        pytest.fail(f"this test started Ray processes {sorted(started)}: give it the "
                    "ray_cluster fixture (or own_ray), which marks it `ray`")


@pytest.fixture
def cluster_without_gpus(monkeypatch):
    """A running Ray cluster as train.start_ray sees it: 8 CPUs, no GPU (no Ray started)."""
    import ray

    from isoloco_ray import driver, train

    monkeypatch.setattr(ray, "is_initialized", lambda: True)
    monkeypatch.setattr(ray, "cluster_resources", lambda: {"CPU": 8.0})
    monkeypatch.setenv("ISOLOCO_RAY_GPU_WAIT_SECONDS", "0.3")
    monkeypatch.setattr(train, "GPU_POLL_SECONDS", 0.05)

    def no_training(*args, **kwargs):
        raise AssertionError("training started")

    monkeypatch.setattr(driver, "fit", no_training)
