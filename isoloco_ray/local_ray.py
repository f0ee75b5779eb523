"""A local Ray cluster that listens on loopback only, with Ray's token authentication on.

`ray.init(num_cpus=...)` on Linux gives every Ray process the machine's network address as its
node IP, and then GCS, raylet, object manager, every worker's gRPC server and the dashboard
agent listen on all interfaces (0.0.0.0 / ::), the runtime env agent on the node IP: anyone who
can reach the machine can talk to them. Ray binds all of them to loopback when the node IP is
exactly 127.0.0.1 (the C++ servers test `node_ip_address == "127.0.0.1"`, the Python agents
`is_localhost(node_ip)`), but `ray.init(_node_ip_address="127.0.0.1")` alone does not get there:
ray/_private/worker.py passes it through `services.resolve_ip_for_localhost`, which turns a
loopback address back into the network one unless `ray_constants.ENABLE_RAY_CLUSTER` is false
(ray/_private/services.py `get_node_ip_address`; false by default only on macOS and Windows,
`RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0`, read when ray is imported). `start_local_cluster` turns
that constant off for the length of its `ray.init` call, so the cluster gets 127.0.0.1.

Two sockets are torch's, not Ray's, in Ray Train's gloo process group: gloo's own listeners bind
the address of `GLOO_SOCKET_IFNAME` (else whatever the host name resolves to), set here to the
loopback interface for every Ray worker (`NCCL_SOCKET_IFNAME` too, for GPU runs); and rank 0's
c10d TCPStore binds all interfaces whatever MASTER_ADDR says (torch/distributed/rendezvous.py
`_create_c10d_store` gives it no bind address). A worker setup hook makes rank 0 hand TCPStore a
socket already bound to MASTER_ADDR when that is a loopback address (`master_listen_fd`), and
changes nothing otherwise.

Ray's state API, which Ray Train's placement-group cleaner asks every second whether a run's
controller still lives, is found through the dashboard address the cluster's GCS records: that
is 127.0.0.1:8265 even on a cluster that runs no dashboard. Whatever else answers there (the
dashboard of another Ray cluster on the machine: a grid, a test session, another user's) knows
none of this cluster's actors, its "no such actor" reads as the controller's death, and the
cleaner removes a live run's placement group, every worker with it. So every worker of a local
cluster is told its own state API (RAY_API_SERVER_ADDRESS, read before any other address): its
dashboard on a port chosen for it, or, without one, a loopback port this process holds bound and
never listens on, where every query is refused (the cleaner takes a refused query for "unknown"
and asks again; the run's controller dies only with this process, and the cluster with it).

`non_loopback_listeners` lists what a set of processes listens on outside loopback (the check in
tests/test_local_ray.py).
"""

from __future__ import annotations

import functools
import ipaddress
import os
import socket
import sys
import warnings
from collections.abc import Iterable
from typing import Any

LOOPBACK = "127.0.0.1"
AUTH_MODE_ENV = "RAY_AUTH_MODE"
# The default quiet settings of our local clusters (train.py start_ray, tests/conftest.py).
QUIET_INIT = {"include_dashboard": False, "log_to_driver": False, "logging_level": "ERROR"}
_HOOK = f"{__name__}.loopback_worker_setup"
STATE_API_ENV = "RAY_API_SERVER_ADDRESS"  # Ray's own variable (ray_constants)
# Bound to a loopback port, never listening, for this process's life: refuses connections.
_refusing: socket.socket | None = None
_RENDEZVOUS = "torch.distributed.rendezvous"


def joined_cluster() -> bool:
    """Whether this process joins a cluster named by RAY_ADDRESS (e.g. under `ray job submit`)
    rather than starting a local one."""
    return bool(os.environ.get("RAY_ADDRESS"))


# How long RAY_ADDRESS's host may take to accept a connection before the run is refused
# (Ray's own reconnect loop would go on for minutes).
ADDRESS_CHECK_SECONDS = 5.0
# What to do about a RAY_ADDRESS that names no Ray cluster.
RAY_ADDRESS_FIX = ("start the cluster there (ray start --head), fix the address, or unset "
                   "RAY_ADDRESS to start a local cluster")


def unreachable_ray_address(timeout: float = ADDRESS_CHECK_SECONDS) -> str | None:
    """Why the cluster RAY_ADDRESS names does not answer (nothing accepts a connection at its
    host and port within `timeout`), or None: it answers, or it names no port to try
    (`auto`, `local`)."""
    address = os.environ.get("RAY_ADDRESS", "")
    target = address.split("://", 1)[-1].rstrip("/")
    host, _, port = target.rpartition(":")
    if not host or not port.isdigit():
        return None
    try:
        with socket.create_connection((host.strip("[]"), int(port)), timeout=timeout):
            return None
    except OSError as exc:
        why = "timed out" if isinstance(exc, TimeoutError) else (exc.strerror or str(exc))
        return (f"RAY_ADDRESS={address!r}: nothing answers at {host}:{port} ({why}, "
                f"{timeout:g} s); {RAY_ADDRESS_FIX}")


def start_local_cluster(num_cpus: int, **kwargs: Any) -> None:
    """`ray.init` a new single-node cluster on 127.0.0.1 only, with QUIET_INIT's settings, its
    workers told its own state API (own_state_api); kwargs go to `ray.init` and override
    those. Raises RuntimeError (after shutting Ray down
    again) if the node did not get the loopback address.

    Token authentication is Ray 2.60's own default for a cluster that ray.init starts
    (worker.py `enable_token_auth_by_default`: RAY_AUTH_MODE=token in os.environ, a token
    generated into ~/.ray/auth_token if there is none); only an explicit RAY_AUTH_MODE=disabled
    in the environment turns it off, which is respected with a warning. Setting RAY_AUTH_MODE
    here instead would not work: the driver's C++ config read it when ray was imported, and Ray
    refreshes that only on its own default path."""
    import ray
    import ray._private.ray_constants as ray_constants

    options = {**QUIET_INIT, **kwargs}
    options["runtime_env"] = _with_loopback_workers(options.get("runtime_env"))
    options["runtime_env"]["env_vars"][STATE_API_ENV] = own_state_api(options)
    cluster_mode = ray_constants.ENABLE_RAY_CLUSTER
    ray_constants.ENABLE_RAY_CLUSTER = False  # keeps 127.0.0.1 from being "resolved" away
    try:
        # address="local": always a new cluster. Without it ray.init joins any Ray it finds
        # running on the machine (RAY_ADDRESS, or a GCS process found by pgrep: another
        # user's, or a test's), whose settings and authentication are not these.
        ray.init(address="local", num_cpus=num_cpus, _node_ip_address=LOOPBACK, **options)
    finally:
        ray_constants.ENABLE_RAY_CLUSTER = cluster_mode
    node_ip = ray.util.get_node_ip_address()
    if node_ip != LOOPBACK:
        ray.shutdown()
        raise RuntimeError(f"the local Ray cluster got node IP {node_ip}, not {LOOPBACK}: its "
                           "servers would listen on the network; refusing to run")
    if os.environ.get(AUTH_MODE_ENV, "").lower() == "token":
        _restrict_token_file()
    else:
        warnings.warn(f"{AUTH_MODE_ENV}={os.environ.get(AUTH_MODE_ENV)}: the local Ray cluster "
                      "runs without token authentication (it listens on 127.0.0.1 only)",
                      stacklevel=2)


def own_state_api(options: dict[str, Any]) -> str:
    """The URL of the state API of the cluster `options` (ray.init's) start: with a dashboard,
    the dashboard's, on a free loopback port chosen here unless `dashboard_port` names one
    (written into `options`); without one, a port that refuses every connection (the module's
    docstring says why)."""
    global _refusing
    if options.get("include_dashboard"):
        if not options.get("dashboard_port"):
            with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
                probe.bind((LOOPBACK, 0))
                options["dashboard_port"] = probe.getsockname()[1]
        return f"http://{LOOPBACK}:{options['dashboard_port']}"
    if _refusing is None:
        _refusing = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        _refusing.bind((LOOPBACK, 0))
    return f"http://{LOOPBACK}:{_refusing.getsockname()[1]}"


def _with_loopback_workers(runtime_env: Any) -> dict[str, Any]:
    """The job's runtime_env plus our worker setup hook, gloo and NCCL on the loopback
    interface."""
    env = dict(runtime_env or {})
    if env.get("worker_process_setup_hook") not in (None, _HOOK):
        raise ValueError("start_local_cluster sets runtime_env['worker_process_setup_hook'] "
                         "itself")
    env["worker_process_setup_hook"] = _HOOK
    # One node: its collectives never need another interface (NCCL's bootstrap and proxy
    # sockets would otherwise take the first non-loopback interface).
    loopback = loopback_interface()
    env["env_vars"] = {**env.get("env_vars", {}), "GLOO_SOCKET_IFNAME": loopback,
                       "NCCL_SOCKET_IFNAME": loopback}
    return env


def _psutil() -> Any:
    """psutil: Ray ships a copy and puts it on sys.path when it is imported, so Ray comes first
    (psutil itself is not a dependency; an import in the other order fails without it)."""
    import ray  # noqa: F401

    # isort: split
    import psutil

    return psutil


def loopback_interface() -> str:
    """The name of the network interface that holds 127.0.0.1 ("lo" on Linux)."""
    psutil = _psutil()

    for name, addresses in psutil.net_if_addrs().items():
        if any(a.family == socket.AF_INET and a.address == LOOPBACK for a in addresses):
            return name
    return "lo"


def _restrict_token_file() -> None:
    """Ray writes ~/.ray/auth_token with the umask's mode (0644 by default): make it 0600."""
    if os.environ.get("RAY_AUTH_TOKEN"):
        return
    path = os.environ.get("RAY_AUTH_TOKEN_PATH") or os.path.expanduser("~/.ray/auth_token")
    try:
        info = os.stat(path)
        if info.st_uid == os.getuid() and info.st_mode & 0o077:
            os.chmod(path, 0o600)
    except OSError:
        pass


def loopback_worker_setup() -> None:
    """Ray's worker_process_setup_hook (set by start_local_cluster): patch torch's c10d store
    creation once torch.distributed.rendezvous is imported (not before: most Ray workers never
    import torch, and importing it costs a second of CPU)."""
    module = sys.modules.get(_RENDEZVOUS)
    if module is not None:
        _patch_rendezvous(module)
    elif not any(isinstance(finder, _PatchOnImport) for finder in sys.meta_path):
        sys.meta_path.insert(0, _PatchOnImport())


class _PatchOnImport:
    """A meta path finder that only wraps the loader of torch.distributed.rendezvous."""

    def find_spec(self, name: str, path: Any, target: Any = None) -> Any:
        if name != _RENDEZVOUS:
            return None
        for finder in sys.meta_path:
            find_spec = getattr(finder, "find_spec", None)
            if finder is self or find_spec is None:
                continue
            spec = find_spec(name, path, target)
            if spec is not None and spec.loader is not None:
                spec.loader = _PatchingLoader(spec.loader)
                return spec
        return None


class _PatchingLoader:
    def __init__(self, loader: Any) -> None:
        self._loader = loader

    def __getattr__(self, name: str) -> Any:
        return getattr(self._loader, name)

    def create_module(self, spec: Any) -> Any:
        return self._loader.create_module(spec)

    def exec_module(self, module: Any) -> None:
        self._loader.exec_module(module)
        _patch_rendezvous(module)


def loopback_store(hostname: str, port: int = 0, **options: Any) -> Any:
    """A master torch TCPStore listening on `hostname` (a loopback IP) only: TCPStore itself
    listens on every interface whatever host it is given, unless handed a bound socket."""
    from torch.distributed import TCPStore

    family = socket.AF_INET6 if ":" in hostname else socket.AF_INET
    listener = socket.create_server((hostname, port), family=family, backlog=2048)
    try:
        store = TCPStore(host_name=hostname, port=listener.getsockname()[1], is_master=True,
                         master_listen_fd=listener.fileno(), **options)
    except BaseException:
        listener.close()
        raise
    listener.detach()  # the store's server owns the descriptor now
    return store


def _patch_rendezvous(module: Any) -> None:
    """Rank 0's TCPStore (env:// and tcp:// rendezvous) listens on a socket bound to the
    rendezvous host when that is a loopback IP, instead of on all interfaces."""
    original = module._create_c10d_store
    if getattr(original, "_loopback_listen", False):
        return

    @functools.wraps(original)
    def create_c10d_store(hostname: str, port: int, rank: int, world_size: int, timeout: Any,
                          use_libuv: bool = True) -> Any:
        if rank != 0 or not is_loopback(hostname) or module._torchelastic_use_agent_store():
            return original(hostname, port, rank, world_size, timeout, use_libuv)
        return loopback_store(hostname, port, world_size=world_size, timeout=timeout,
                              multi_tenant=True, use_libuv=use_libuv)

    create_c10d_store._loopback_listen = True  # type: ignore[attr-defined]
    module._create_c10d_store = create_c10d_store


def is_loopback(host: str) -> bool:
    try:
        address = ipaddress.ip_address(host.split("%")[0])
    except ValueError:
        return False
    mapped = getattr(address, "ipv4_mapped", None)
    return (mapped or address).is_loopback


def session_pids(root: int | None = None) -> list[int]:
    """`root` (default: this process, the driver that started Ray) and all its descendants:
    GCS, raylet, the agents, monitor and dashboard processes, every worker."""
    psutil = _psutil()

    process = psutil.Process(os.getpid() if root is None else root)
    return [process.pid] + [child.pid for child in process.children(recursive=True)]


def listening_sockets(pids: Iterable[int]) -> list[tuple[int, str, str, str, int]]:
    """(pid, process name, "tcp"/"udp", address, port) of every listening TCP socket and every
    unconnected UDP socket the processes hold; processes gone meanwhile are skipped."""
    psutil = _psutil()

    found = []
    for pid in pids:
        try:
            process = psutil.Process(pid)
            name = process.name()
            connections = process.net_connections(kind="inet")
        except (psutil.NoSuchProcess, psutil.ZombieProcess):
            continue
        for conn in connections:
            if conn.type == socket.SOCK_STREAM and conn.status != psutil.CONN_LISTEN:
                continue
            if conn.type == socket.SOCK_DGRAM and conn.raddr:
                continue
            proto = "tcp" if conn.type == socket.SOCK_STREAM else "udp"
            found.append((pid, name, proto, conn.laddr.ip, conn.laddr.port))
    return found


def format_socket(entry: tuple[int, str, str, str, int]) -> str:
    pid, name, proto, ip, port = entry
    host = f"[{ip}]" if ":" in ip else ip
    return f"{proto} {host}:{port} pid {pid} ({name})"


def non_loopback_listeners(pids: Iterable[int]) -> list[str]:
    """Every socket of `listening_sockets(pids)` bound to a non-loopback address (0.0.0.0, ::,
    a network address), as "tcp 0.0.0.0:1234 pid 42 (raylet)"; empty when all are loopback."""
    return [format_socket(entry) for entry in listening_sockets(pids)
            if not is_loopback(entry[3])]
