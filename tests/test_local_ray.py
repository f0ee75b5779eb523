"""The local Ray cluster (local_ray.start_local_cluster, as train.py and the session fixture start
it) listens on loopback only, and refuses gRPC clients without its token."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import threading
from pathlib import Path

import pytest

from isoloco_ray import local_ray


class ListenerWatch:
    """Every listening socket of this process's tree, sampled every `interval` s until stopped
    (workers come and go: Train's actors exist only while fit() runs)."""

    def __init__(self, interval: float = 0.5) -> None:
        self.seen: dict[tuple, tuple] = {}
        self._stop = threading.Event()
        self._interval = interval
        self._thread = threading.Thread(target=self._run, daemon=True)

    def sample(self) -> None:
        for entry in local_ray.listening_sockets(local_ray.session_pids()):
            self.seen[entry[0], *entry[2:]] = entry

    def _run(self) -> None:
        while not self._stop.is_set():
            self.sample()
            self._stop.wait(self._interval)

    def __enter__(self) -> ListenerWatch:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()
        self.sample()


def run_two_gloo_workers(storage: Path) -> list[dict]:
    """A 2-worker TorchTrainer (gloo, Ray's env:// rendezvous); each rank reports its own
    non-loopback listeners while its process group is up."""
    import ray.train
    from ray.train.torch import TorchTrainer

    def loop(config: dict) -> None:
        import torch
        import torch.distributed as dist

        from isoloco_ray.local_ray import non_loopback_listeners

        value = torch.ones(1)
        dist.all_reduce(value)
        rank = ray.train.get_context().get_world_rank()
        Path(config["out"], f"rank{rank}.json").write_text(json.dumps({
            "sum": float(value), "MASTER_ADDR": os.environ.get("MASTER_ADDR"),
            "non_loopback": non_loopback_listeners([os.getpid()])}))
        dist.barrier()  # both ranks checked while the store and the gloo pairs exist

    out = storage / "ranks"
    out.mkdir()
    TorchTrainer(loop, train_loop_config={"out": str(out)},
                 scaling_config=ray.train.ScalingConfig(num_workers=2),
                 run_config=ray.train.RunConfig(name="gloo", storage_path=str(storage))).fit()
    return [json.loads((out / f"rank{rank}.json").read_text()) for rank in range(2)]


def test_local_cluster_listens_on_loopback_only(ray_cluster, tmp_path):
    import ray
    import ray.data

    @ray.remote
    def node_ip() -> str:
        return ray.util.get_node_ip_address()

    (tmp_path / "numbers.txt").write_text("\n".join(str(i) for i in range(50)))
    with ListenerWatch() as watch:
        task_ip = ray.get(node_ip.remote())
        rows = ray.data.read_text(str(tmp_path / "numbers.txt")).map(
            lambda row: {"n": int(row["text"])}).take_all()
        ranks = run_two_gloo_workers(tmp_path)

    listing = "\n".join(sorted(local_ray.format_socket(entry) for entry in watch.seen.values()))
    print("listening sockets of the Ray session:\n" + listing)
    names = {entry[1] for entry in watch.seen.values()}
    assert {"gcs_server", "raylet"} <= names, listing  # the check sees Ray's servers at all
    outside = [local_ray.format_socket(entry) for entry in watch.seen.values()
               if not local_ray.is_loopback(entry[3])]
    assert not outside, "listening outside loopback:\n" + "\n".join(sorted(outside))
    for rank in ranks:
        assert not rank["non_loopback"], rank  # gloo pairs and rank 0's TCPStore
        assert rank["sum"] == 2.0 and rank["MASTER_ADDR"] == "127.0.0.1"
    assert task_ip == "127.0.0.1" and sorted(row["n"] for row in rows) == list(range(50))


def test_local_cluster_refuses_clients_without_the_token(ray_cluster):
    import grpc
    import ray
    from ray.core.generated import gcs_service_pb2, gcs_service_pb2_grpc

    assert os.environ.get("RAY_AUTH_MODE") == "token"
    token = os.environ.get("RAY_AUTH_TOKEN") or Path(
        os.environ.get("RAY_AUTH_TOKEN_PATH") or Path.home() / ".ray" / "auth_token"
    ).read_text().strip()
    address = ray.get_runtime_context().gcs_address
    with grpc.insecure_channel(address) as channel:
        stub = gcs_service_pb2_grpc.NodeInfoGcsServiceStub(channel)
        request = gcs_service_pb2.GetClusterIdRequest()
        with pytest.raises(grpc.RpcError) as refused:
            stub.GetClusterId(request, timeout=10)
        assert refused.value.code() == grpc.StatusCode.UNAUTHENTICATED
        stub.GetClusterId(request, timeout=10,
                          metadata=[("authorization", f"Bearer {token}")])


def test_workers_ask_their_own_clusters_state_api(ray_cluster):
    """Ray Train's placement-group cleaner runs as a detached actor that the run's controller
    (an actor) starts, and asks the state API whether the controller lives: there, the state
    API is this cluster's own dashboard (not whatever listens at the 127.0.0.1:8265 the GCS
    records by default), which knows the controller alive, then dead."""
    import ray

    @ray.remote(num_cpus=0)
    class Cleaner:
        def ask(self, actor_id: str) -> tuple[str, str, bool]:
            from ray.dashboard.utils import get_address_for_submission_client
            from ray.train.v2._internal.state.util import is_actor_alive

            return (os.environ[local_ray.STATE_API_ENV],
                    get_address_for_submission_client(None), is_actor_alive(actor_id, 30))

    @ray.remote(num_cpus=0)
    class Controller:
        def start_cleaner(self) -> ray.actor.ActorHandle:
            return Cleaner.options(lifetime="detached").remote()

    controller = Controller.remote()
    cleaner = ray.get(controller.start_cleaner.remote())
    controller_id = controller._actor_id.hex()
    try:
        told, resolved, alive = ray.get(cleaner.ask.remote(controller_id), timeout=60)
        assert told == resolved and told.startswith("http://127.0.0.1:")
        assert alive
        ray.kill(controller)
        _, _, alive = ray.get(cleaner.ask.remote(controller_id), timeout=60)
        assert not alive
    finally:
        ray.kill(cleaner)


def test_without_a_dashboard_every_state_query_is_refused(monkeypatch):
    """A cluster without a dashboard has its workers ask a loopback port that refuses every
    connection: the cleaner's query fails (it goes on watching) rather than reading another
    cluster's "no such actor" as its controller's death."""
    from ray.train.v2._internal.state.util import is_actor_alive
    from ray.util.state.exception import RayStateApiException

    url = local_ray.own_state_api({"include_dashboard": False})
    assert url == local_ray.own_state_api({}) and url.startswith("http://127.0.0.1:")
    with pytest.raises(ConnectionRefusedError):
        socket.create_connection(("127.0.0.1", int(url.rsplit(":", 1)[1])), timeout=5)
    monkeypatch.setenv(local_ray.STATE_API_ENV, url)
    with pytest.raises(RayStateApiException):
        is_actor_alive("ab" * 16, timeout=5)
    options = {"include_dashboard": True}
    assert local_ray.own_state_api(options) == f"http://127.0.0.1:{options['dashboard_port']}"


def test_non_loopback_listeners_sees_wildcard_and_network_sockets():
    with socket.create_server(("0.0.0.0", 0)) as wildcard, \
            socket.create_server(("127.0.0.1", 0)) as loopback, \
            socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as udp:
        udp.bind(("0.0.0.0", 0))
        found = local_ray.non_loopback_listeners([os.getpid()])
        assert f"tcp 0.0.0.0:{wildcard.getsockname()[1]} pid {os.getpid()}" in "\n".join(found)
        assert f"udp 0.0.0.0:{udp.getsockname()[1]} pid {os.getpid()}" in "\n".join(found)
        assert str(loopback.getsockname()[1]) not in "\n".join(found)
    assert local_ray.is_loopback("::ffff:127.0.0.1") and local_ray.is_loopback("::1")
    assert not local_ray.is_loopback("::") and not local_ray.is_loopback("192.0.2.2")


def test_worker_setup_binds_the_rendezvous_store_to_loopback(tmp_path):
    """What the setup hook does in a Ray worker, here in a plain process: set before torch is
    imported, rank 0's TCPStore of a tcp:// rendezvous on 127.0.0.1 listens there only."""
    script = """
import os, sys
from isoloco_ray.local_ray import loopback_worker_setup, non_loopback_listeners
loopback_worker_setup()
import torch.distributed as dist
dist.init_process_group("gloo", init_method="tcp://127.0.0.1:" + sys.argv[1], rank=0,
                        world_size=1)
print("\\n".join(non_loopback_listeners([os.getpid()])) or "none")
dist.destroy_process_group()
"""
    with socket.socket() as probe:  # a free port
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    env = {**os.environ, "GLOO_SOCKET_IFNAME": local_ray.loopback_interface()}
    done = subprocess.run([sys.executable, "-c", script, str(port)], capture_output=True,
                          text=True, timeout=120, env=env, cwd=tmp_path)
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.strip() == "none", done.stdout


def test_a_ray_address_where_nothing_answers_is_refused_at_once(monkeypatch, small_dataset,
                                                               tmp_path, capsys):
    """RAY_ADDRESS naming a port where nothing listens: one error line naming the address,
    exit 2, within seconds (Ray's reconnect loop ran for minutes); an address that answers,
    or one with no port (auto), is left to Ray."""
    import ray

    from isoloco_ray import train

    # As in a fresh process (the suite may hold a cluster of its own): never joined here.
    monkeypatch.setattr(ray, "is_initialized", lambda: False)
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        free_port = probe.getsockname()[1]  # closed again: nothing listens there
    monkeypatch.setenv("RAY_ADDRESS", f"127.0.0.1:{free_port}")
    assert local_ray.unreachable_ray_address() == (
        f"RAY_ADDRESS='127.0.0.1:{free_port}': nothing answers at 127.0.0.1:{free_port} "
        "(Connection refused, 5 s); start the cluster there (ray start --head), fix the "
        "address, or unset RAY_ADDRESS to start a local cluster")
    assert train.main(["--model.preset=tiny", f"--data.path={small_dataset}",
                       "--data.seq_len=64", f"--run.storage_path={tmp_path}"]) == 2
    err = capsys.readouterr().err.splitlines()  # after the dataset's one-time verification
    assert err[-1].startswith(f"error: RAY_ADDRESS='127.0.0.1:{free_port}': nothing answers")
    assert not any(line.startswith("Traceback") for line in err)
    with socket.socket() as listening:
        listening.bind(("127.0.0.1", 0))
        listening.listen()
        monkeypatch.setenv("RAY_ADDRESS", f"ray://127.0.0.1:{listening.getsockname()[1]}")
        assert local_ray.unreachable_ray_address() is None
    monkeypatch.setenv("RAY_ADDRESS", "auto")
    assert local_ray.unreachable_ray_address() is None
