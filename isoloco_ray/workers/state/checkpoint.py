"""Checkpoints of a run: everything its future depends on, in formats that never unpickle.
The files' formats and the checks of a checkpoint read back; what goes into which file and
which worker writes it: checkpoint_manager.py.

A checkpoint is one directory, written by every worker (Ray Train merges the workers' files):

    state.json                 round, counters, the config (rank 0)
    global.safetensors         θ_t, the global parameters (rank 0)
    outer_NNNN.safetensors     outer momentum buffers, if any, by the outer-group rank that
                               holds them (docs/design.md: the owner of each tensor); NNNN =
                               the writer's rank
    replica_NNNN.pt            replica NNNN's AdamW state, LR schedule and stream position
                               (its host; loaded with torch.load(weights_only=True))
    data_parallel.pt           adamw_ddp only: its one AdamW state and LR schedule (rank 0)

Loading needs every file: a directory missing one is reported, never half-restored. One
exception, by design: in `scaling.fault_tolerance: replica` a worker missing from the round's
sync (lost, or paused) writes no files, and its replicas' are not needed (`absent_replicas`):
restored, they start again from θ at the checkpoint's round (Replica.rejoin), as they would
have once that worker was healed or replaced. So every checkpoint of such a run is complete,
however many workers each fault left out.

No random-number state is saved because nothing in a run draws from a global generator: the
model is initialised from `run.seed` in a forked RNG, the data order is fixed, the model has no
dropout, and random pruning draws from generators keyed by (seed, round, replica, tensor). A
resumed run is therefore the same run on every rank, whatever its layout.

Before a resume every worker checks the whole checkpoint, every file (`checkpoint_problems`),
so all of them reach the same verdict from the same shared files; a damaged newest checkpoint
gives way to the newest intact one (resume.py), and with none intact the run stops with a
message naming the bad files rather than starting over (which would discard the run).
"""

from __future__ import annotations

import hashlib
import json
import pickle
import posixpath
import re
import zipfile
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from isoloco_ray.strategies import STRATEGIES

FORMAT = 2  # 2: no RNG state (format 1 held one that nothing used)
STATE_FILE = "state.json"
GLOBAL_FILE = "global.safetensors"
OUTER_PATTERN = "outer*.safetensors"
REPLICA_KEYS = ("optimizer", "schedule", "stream")  # what a replica file's dict holds
DATA_PARALLEL_FILE = "data_parallel.pt"  # adamw_ddp's optimizer, beside the replicas' streams
DATA_PARALLEL_KEYS = ("optimizer", "schedule")
# Ray Train V2 keeps a run's checkpoints as <run dir>/checkpoint_<%Y-%m-%d_%H-%M-%S.%f>
# (listed in its checkpoint_manager_snapshot.json): their names sort in the order written.
RAY_CHECKPOINT_GLOB = "checkpoint_*"


class CheckpointError(ValueError):
    """A checkpoint the run cannot resume from (damaged, or written with other settings); the
    message names the files and what to do."""


# The Trainer's counters that state.json records beside the config and the outer optimizer:
# name -> (type, whether None is allowed). Saved from and restored into these attributes only.
COUNTERS: dict[str, tuple[type, bool]] = {
    "round": (int, False),
    "initial_eval_loss": (float, True),
    "last_eval_loss": (float, True),
    "train_seconds": (float, False),
    "first_round_seconds": (float, False),
    "bytes_total": (int, False),
    "bad_rounds": (int, False),
}


def read_counters(state: Mapping[str, Any], path: Path) -> dict[str, Any]:
    """The COUNTERS of a loaded state.json, each of its type; CheckpointError naming `path`
    and the counters that are missing or of another type."""
    wrong = _garbled_counters(state)
    if wrong:
        raise CheckpointError(f"{path}: lacks or garbles {', '.join(wrong)}")
    return {name: None if state[name] is None else kind(state[name])
            for name, (kind, _) in COUNTERS.items()}


def _garbled_counters(state: Mapping[str, Any]) -> list[str]:
    """The COUNTERS that `state` lacks or holds as another type (or negative)."""
    def good(name: str, kind: type, optional: bool) -> bool:
        value = state.get(name)
        if value is None:
            return optional and name in state
        number = isinstance(value, (int, float)) and not isinstance(value, bool)
        return number and (kind is float or isinstance(value, int)) and value >= 0

    return [name for name, (kind, optional) in COUNTERS.items() if not good(name, kind, optional)]


def replica_file(replica: int) -> str:
    """File name of one replica's state."""
    return f"replica_{replica:04d}.pt"


def parameters_sha256(params: Mapping[str, torch.Tensor]) -> str:
    """sha256 of parameters in a stable order: for each name in sorted order, the UTF-8 name,
    a NUL, the shape as text, a NUL, then the float32 values' little-endian bytes."""
    digest = hashlib.sha256()
    for name in sorted(params):
        tensor = params[name].detach().to("cpu", torch.float32).contiguous()
        digest.update(name.encode() + b"\0" + str(tuple(tensor.shape)).encode() + b"\0")
        # The array's own buffer, not a bytes copy of it (a third less time on CPU).
        digest.update(tensor.numpy().astype("<f4", copy=False).reshape(-1).data)
    return digest.hexdigest()


def parameters_checksum(params: Mapping[str, torch.Tensor]) -> str:
    """A fingerprint of the parameters' exact float32 bits computed on their device, with a
    small copy to the host (about 1 MB at 178M): the per-round agreement check on GPUs, where
    `parameters_sha256` would first copy every byte to the host.

    Per tensor, seen as rows of its last dimension (1-D tensors: one value per row): the int64
    sums of its float32 bit patterns along each row and each column, exact integer arithmetic
    that does not depend on summation order. A change of any one value changes its row's sum;
    a swap of two different values changes two row sums or, within a row, two column sums.
    Returned as the sha256 hex digest of the names, shapes and sums."""
    digest = hashlib.sha256()
    sums = []
    for name in sorted(params):
        tensor = params[name].detach()
        digest.update(name.encode() + b"\0" + str(tuple(tensor.shape)).encode() + b"\0")
        bits = tensor.to(torch.float32).contiguous().view(torch.int32)
        rows = bits.reshape(-1, bits.shape[-1] if bits.dim() > 1 else 1)
        sums += [rows.sum(dim=1, dtype=torch.int64), rows.sum(dim=0, dtype=torch.int64)]
    if sums:
        digest.update(torch.cat(sums).cpu().numpy().astype("<i8", copy=False).data)
    return digest.hexdigest()


def outer_file(shard: int) -> str:
    """File name of the outer momentum buffers one outer-group rank holds (`shard`:
    checkpoint_manager.Roles.momentum_file, unique among the G outer groups' ranks)."""
    return f"outer_{shard:04d}.safetensors"


def save_shared(directory: Path, global_params: Mapping[str, torch.Tensor],
                outer_state: Mapping[str, Any], state: Mapping[str, Any]) -> None:
    """Rank 0's part: global parameters, outer optimizer settings and step, and counters (the
    momentum buffers go through `save_outer_momentum`)."""
    save_file({k: v.contiguous() for k, v in global_params.items()}, directory / GLOBAL_FILE)
    outer_scalars = {k: v for k, v in outer_state.items() if k != "buffers"}
    (directory / STATE_FILE).write_text(json.dumps(
        {"format": FORMAT, **state, "outer": outer_scalars}, indent=1))


def absent_replicas(state: Mapping[str, Any]) -> set[int]:
    """The replicas a checkpoint needs no file of (the module's docstring): those hosted by
    the workers its round's record (state.json's "record") names in `missing_workers`;
    empty without such a record (`restart` mode, or an older checkpoint)."""
    record = state.get("record")
    missing = record.get("missing_workers") if isinstance(record, dict) else None
    if not isinstance(missing, list):
        return set()
    hosted = state["config"]["scaling"]["replicas_per_worker"]
    return {w * hosted + i for w in missing if isinstance(w, int) for i in range(hosted)}


def needed_files(state: Mapping[str, Any]) -> set[str]:
    """The files a checkpoint whose state.json is `state` cannot resume without, by name: the
    shared files, adamw_ddp's optimizer, and every replica's but those of workers missing from
    its round (`absent_replicas`). Outer momentum files are named by the layout that wrote
    them: checkpoint_problems checks that they hold every tensor's. Raises KeyError, TypeError
    or AttributeError for a state.json that lacks the replica count."""
    absent = absent_replicas(state)
    config = state["config"]
    needed = {STATE_FILE, GLOBAL_FILE, *(replica_file(r)
                                         for r in range(config["scaling"]["replicas"])
                                         if r not in absent)}
    strategy = STRATEGIES.get(config.get("outer", {}).get("strategy"))
    if strategy is not None and not strategy.has_outer_step:  # its one optimizer
        needed.add(DATA_PARALLEL_FILE)
    return needed


def rejoining_replicas(directory: Path, state: Mapping[str, Any]) -> set[int]:
    """The `absent_replicas` of checkpoint `directory` (its state.json: `state`) that have no
    file there: restored, they start again from θ (Replica.rejoin); one that has a file (its
    worker joined in the round) is loaded and checked like any other."""
    return {r for r in absent_replicas(state) if not (directory / replica_file(r)).exists()}


def saved_record(directory: Path) -> dict[str, Any] | None:
    """The metrics line of the round checkpoint `directory` was taken after, as its writer
    kept it (state.json's "record"), or None (an older checkpoint, or none kept)."""
    record = json.loads((directory / STATE_FILE).read_text()).get("record")
    return record if isinstance(record, dict) else None


def save_outer_momentum(directory: Path, shard: int, buffers: Mapping[str, torch.Tensor]
                        ) -> None:
    """The outer momentum buffers an outer-group rank holds, in file number `shard`."""
    save_file({k: v.contiguous() for k, v in buffers.items()}, directory / outer_file(shard))


def save_replica(directory: Path, replica: int, replica_state: Mapping[str, Any]) -> None:
    """One hosted replica's part (tensors and plain values only)."""
    torch.save(dict(replica_state), directory / replica_file(replica))


def save_data_parallel(directory: Path, optimizer_state: Mapping[str, Any]) -> None:
    """adamw_ddp's optimizer and schedule (the same on every rank: rank 0 saves them)."""
    torch.save(dict(optimizer_state), directory / DATA_PARALLEL_FILE)


def load_shared(directory: Path) -> tuple[dict[str, torch.Tensor], dict[str, Any],
                                          dict[str, Any]]:
    """(global params, outer optimizer state, state.json) of a checkpoint. The outer state's
    "buffers" are every momentum file's together."""
    missing = [f for f in (STATE_FILE, GLOBAL_FILE) if not (directory / f).is_file()]
    if missing:
        raise FileNotFoundError(f"checkpoint {directory} is incomplete: missing {missing}")
    state = json.loads((directory / STATE_FILE).read_text())
    if state.get("format") != FORMAT:
        raise ValueError(f"checkpoint {directory} has format {state.get('format')}, "
                         f"this version reads {FORMAT}")
    buffers: dict[str, torch.Tensor] = {}
    for path in sorted(directory.glob(OUTER_PATTERN)):
        buffers.update(load_file(path))
    outer_state = {**state.pop("outer"), "buffers": buffers}
    return load_file(directory / GLOBAL_FILE), outer_state, state


def load_replica(directory: Path, replica: int) -> dict[str, Any]:
    """One replica's saved state, loaded without unpickling arbitrary objects."""
    return _load_torch_state(directory, replica_file(replica))


def load_data_parallel(directory: Path) -> dict[str, Any]:
    """adamw_ddp's saved optimizer and schedule, loaded without unpickling arbitrary objects."""
    return _load_torch_state(directory, DATA_PARALLEL_FILE)


def _load_torch_state(directory: Path, name: str) -> dict[str, Any]:
    path = directory / name
    if not path.is_file():
        raise FileNotFoundError(f"checkpoint {directory} is incomplete: missing {path.name}")
    return torch.load(path, map_location="cpu", weights_only=True)


# -- checking a checkpoint before resuming from it ------------------------------------------------

Damaged = tuple[str, list[str]]  # a checkpoint (as messages name it) and what is wrong with it


def checkpoint_problems(directory: Path) -> list[str]:
    """What is wrong with checkpoint `directory`: one line per bad file, naming it and saying
    what is wrong; [] when it is intact.

    Reads every file the checkpoint must hold without unpickling anything: state.json must be
    JSON of this format with the keys a resume needs, the safetensors files must parse (header,
    and a size that matches it), every replica's .pt file (one per replica of the saved config)
    must load with torch.load(weights_only=True) into the expected dict, and the outer momentum
    files together must hold a buffer for every parameter once the outer optimizer has stepped
    with momentum. Every worker checks the whole checkpoint, so all reach the same verdict."""
    if not directory.is_dir():
        return [f"{directory}: not a directory"]
    problems: list[str] = []
    state = _read_state(directory / STATE_FILE, problems)
    global_names = _safetensors_names(directory / GLOBAL_FILE, problems)
    outer_paths = sorted({directory / outer_file(0), *directory.glob(OUTER_PATTERN)})
    buffer_names: set[str] | None = set()
    for path in outer_paths:
        names = _safetensors_names(path, problems)
        if names is None or buffer_names is None:
            buffer_names = None
        else:
            buffer_names |= names
    needed = set() if state is None else needed_files(state)
    if state is not None:  # the needed ones, and an absent replica's that its worker wrote
        replica_paths = [directory / replica_file(r)
                         for r in range(state["config"]["scaling"]["replicas"])
                         if replica_file(r) in needed or (directory / replica_file(r)).exists()]
    else:  # the replica count is unknown: check the replica files there are
        replica_paths = sorted(directory.glob("replica_*.pt"))
    for path in replica_paths:
        _check_torch_state(path, REPLICA_KEYS, "a replica state", problems)
    if DATA_PARALLEL_FILE in needed:
        _check_torch_state(directory / DATA_PARALLEL_FILE, DATA_PARALLEL_KEYS,
                           "the data-parallel optimizer", problems)
    outer = state["outer"] if state is not None else None
    if (outer is not None and outer["momentum"] > 0 and outer["step"] > 0
            and global_names is not None and buffer_names is not None):
        missing = sorted(global_names - buffer_names)
        if missing:
            problems.append(
                f"{directory}: no {OUTER_PATTERN} file holds the outer momentum of "
                f"{len(missing)} parameters (e.g. {missing[0]!r}): an outer momentum file is "
                "missing")
    return problems


def damage_report(directory: str | Path, problems: Sequence[str]) -> str:
    """One line for a damaged checkpoint: its directory and every problem found."""
    return f"checkpoint {directory} is damaged: {'; '.join(problems)}"


def fallback_warning(chosen: str, round_saved: int, skipped: Sequence[Damaged]) -> str:
    """The warning of a resume that skips damaged newer checkpoints for `chosen` (saved after
    round `round_saved`)."""
    damaged = " | ".join(damage_report(directory, problems) for directory, problems in skipped)
    return (f"warning: {damaged} | resuming from the older checkpoint {chosen} (round "
            f"{round_saved}) instead; the rounds after it are trained again")


def no_intact_message(skipped: Sequence[Damaged]) -> str:
    """Why a run cannot resume when none of its checkpoints is intact, and what to do."""
    run_dir = posixpath.dirname(skipped[0][0])
    damaged = " | ".join(damage_report(directory, problems) for directory, problems in skipped)
    return (f"no intact checkpoint to resume from: {damaged} | Starting over would discard the "
            "run, so it stops here. If the storage is at fault (unmounted, full, files still "
            "being copied), fix it and run the same command again; to start the run over, "
            f"delete {run_dir} (Ray Train refuses a run directory whose checkpoints were "
            "removed one by one) or choose another run.name")


def saved_round(directory: Path) -> int:
    """The round an intact checkpoint was saved after."""
    return int(json.loads((directory / STATE_FILE).read_text())["round"])


def _read_state(path: Path, problems: list[str]) -> dict[str, Any] | None:
    """state.json if it is of this format with the keys a resume needs, else None (and the
    problem recorded)."""
    if not path.is_file():
        problems.append(f"{path}: missing")
        return None
    try:
        state = json.loads(path.read_bytes())
    except OSError as exc:
        problems.append(f"{path}: cannot be read ({exc.strerror or type(exc).__name__})")
        return None
    except ValueError as exc:  # JSONDecodeError, UnicodeDecodeError
        problems.append(f"{path}: not valid JSON ({_first_line(exc)})")
        return None
    if not isinstance(state, dict):
        problems.append(f"{path}: not a JSON object")
        return None
    if state.get("format") != FORMAT:
        problems.append(f"{path}: has format {state.get('format')!r}, this version reads "
                        f"{FORMAT}")
        return None
    config, outer = state.get("config"), state.get("outer")
    scaling = config.get("scaling") if isinstance(config, dict) else None
    wrong = _garbled_counters(state) + [key for key, good in (
        ("config.scaling.replicas", isinstance(scaling, dict)
         and _is_count(scaling.get("replicas")) and scaling["replicas"] > 0),
        ("outer.step", isinstance(outer, dict) and _is_count(outer.get("step"))),
        ("outer.momentum", isinstance(outer, dict)
         and isinstance(outer.get("momentum"), (int, float))),
    ) if not good]
    if wrong:
        problems.append(f"{path}: lacks or garbles {', '.join(wrong)}")
        return None
    return state


def _safetensors_names(path: Path, problems: list[str]) -> set[str] | None:
    """The tensor names of a safetensors file whose header parses and whose size matches it,
    else None (and the problem recorded)."""
    if not path.is_file():
        problems.append(f"{path}: missing")
        return None
    try:
        with safe_open(path, "pt") as handle:
            return set(handle.keys())
    except OSError as exc:
        problems.append(f"{path}: cannot be read ({exc.strerror or type(exc).__name__})")
    except Exception as exc:  # SafetensorError and whatever else a damaged file raises
        problems.append(f"{path}: not a complete safetensors file ({_first_line(exc)})")
    return None


def _check_torch_state(path: Path, keys: Sequence[str], what: str, problems: list[str]
                       ) -> None:
    """Record the problem, if any, of a .pt state file: it must be a torch.save zip file that
    loads with weights_only=True (never unpickling anything else) into a dict of `keys`."""
    if not path.is_file():
        problems.append(f"{path}: missing")
        return
    try:
        if not zipfile.is_zipfile(path):
            problems.append(f"{path}: not a complete torch.save file (no zip directory: "
                            "truncated, or something else)")
            return
        # mmap: the tensors are not read into memory, only the structure is checked.
        replica = torch.load(path, map_location="cpu", weights_only=True, mmap=True)
    except OSError as exc:
        problems.append(f"{path}: cannot be read ({exc.strerror or type(exc).__name__})")
        return
    except pickle.UnpicklingError as exc:
        problems.append(f"{path}: holds objects other than tensors and plain values, refused "
                        f"without running them ({_unpickler_reason(exc)})")
        return
    except Exception as exc:  # whatever else a damaged zip or pickle raises
        problems.append(f"{path}: does not load ({_first_line(exc)})")
        return
    if not isinstance(replica, dict) or not set(keys) <= set(replica):
        problems.append(f"{path}: not {what} (a dict of {', '.join(keys)})")


def _is_count(value: Any) -> bool:
    """A non-negative int (not a bool)."""
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


def _first_line(exc: BaseException) -> str:
    """The first line of an error message, without terminal colour codes, at most 200
    characters."""
    text = re.sub(r"\x1b\[[0-9;]*m", "", str(exc))
    line = next((line.strip() for line in text.splitlines() if line.strip()),
                type(exc).__name__)
    return line[:200]


def _unpickler_reason(exc: BaseException) -> str:
    """What torch's weights-only unpickler refused (e.g. "Unsupported global: GLOBAL
    posix.system ..."), without torch's advice to load the file unsafely."""
    text = re.sub(r"\x1b\[[0-9;]*m", "", str(exc))
    _, found, detail = text.partition("WeightsUnpickler error:")
    if not found:
        return "weights-only unpickling failed"
    sentence = " ".join(detail.split()).split(". ")[0]
    return sentence[:200] or "weights-only unpickling failed"
