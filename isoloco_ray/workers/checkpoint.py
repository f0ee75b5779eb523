"""Checkpoints of a run: everything its future depends on, in formats that never unpickle.

A checkpoint is one directory, written by every worker (Ray Train merges the workers' files):

    state.json                 round, counters, the config, RNG states (rank 0)
    global.safetensors         θ_t, the global parameters (rank 0)
    outer_NNNN.safetensors     outer momentum buffers, if any, by the outer-group rank NNNN
                               that holds them (DESIGN.md: the owner of each tensor)
    rng.safetensors            torch's CPU RNG state (rank 0)
    replica_NNNN.pt            replica NNNN's AdamW state, LR schedule and stream position
                               (its host; loaded with torch.load(weights_only=True))

Loading needs every file: a directory missing one is reported, never half-restored.
"""

from __future__ import annotations

import hashlib
import json
import random
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import numpy as np
import torch
from safetensors.torch import load_file, save_file

FORMAT = 1
STATE_FILE = "state.json"
GLOBAL_FILE = "global.safetensors"
OUTER_PATTERN = "outer*.safetensors"
RNG_FILE = "rng.safetensors"


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
        digest.update(tensor.numpy().astype("<f4", copy=False).tobytes())
    return digest.hexdigest()


def rng_state() -> tuple[dict[str, Any], dict[str, torch.Tensor]]:
    """Python's and numpy's RNG states as JSON, torch's as a tensor."""
    version, internal, gauss = random.getstate()
    kind, keys, pos, has_gauss, cached = np.random.get_state()
    as_json = {"python": [version, list(internal), gauss],
               "numpy": [kind, keys.tolist(), pos, has_gauss, cached]}
    return as_json, {"torch": torch.get_rng_state()}


def set_rng_state(as_json: Mapping[str, Any], tensors: Mapping[str, torch.Tensor]) -> None:
    """Restore what `rng_state` returned."""
    version, internal, gauss = as_json["python"]
    random.setstate((version, tuple(internal), gauss))
    kind, keys, pos, has_gauss, cached = as_json["numpy"]
    np.random.set_state((kind, np.asarray(keys, dtype=np.uint32), pos, has_gauss, cached))
    torch.set_rng_state(tensors["torch"])


def outer_file(shard: int) -> str:
    """File name of the outer momentum buffers one outer-group rank holds."""
    return f"outer_{shard:04d}.safetensors"


def save_shared(directory: Path, global_params: Mapping[str, torch.Tensor],
                outer_state: Mapping[str, Any], state: Mapping[str, Any]) -> None:
    """Rank 0's part: global parameters, outer optimizer settings and step, counters and RNG
    states (the momentum buffers go through `save_outer_momentum`)."""
    save_file({k: v.contiguous() for k, v in global_params.items()}, directory / GLOBAL_FILE)
    rng_json, rng_tensors = rng_state()
    save_file(rng_tensors, directory / RNG_FILE)
    outer_scalars = {k: v for k, v in outer_state.items() if k != "buffers"}
    (directory / STATE_FILE).write_text(json.dumps(
        {"format": FORMAT, **state, "outer": outer_scalars, "rng": rng_json}, indent=1))


def save_outer_momentum(directory: Path, shard: int, buffers: Mapping[str, torch.Tensor]
                        ) -> None:
    """The outer momentum buffers outer-group rank `shard` holds."""
    save_file({k: v.contiguous() for k, v in buffers.items()}, directory / outer_file(shard))


def save_replica(directory: Path, replica: int, replica_state: Mapping[str, Any]) -> None:
    """One hosted replica's part (tensors and plain values only)."""
    torch.save(dict(replica_state), directory / replica_file(replica))


def load_shared(directory: Path) -> tuple[dict[str, torch.Tensor], dict[str, Any],
                                          dict[str, Any]]:
    """(global params, outer optimizer state, state.json) of a checkpoint; RNG states restored.
    The outer state's "buffers" are every momentum file's together."""
    missing = [f for f in (STATE_FILE, GLOBAL_FILE, RNG_FILE) if not (directory / f).is_file()]
    if missing:
        raise FileNotFoundError(f"checkpoint {directory} is incomplete: missing {missing}")
    state = json.loads((directory / STATE_FILE).read_text())
    if state.get("format") != FORMAT:
        raise ValueError(f"checkpoint {directory} has format {state.get('format')}, "
                         f"this version reads {FORMAT}")
    set_rng_state(state.pop("rng"), load_file(directory / RNG_FILE))
    buffers: dict[str, torch.Tensor] = {}
    for path in sorted(directory.glob(OUTER_PATTERN)):
        buffers.update(load_file(path))
    outer_state = {**state.pop("outer"), "buffers": buffers}
    return load_file(directory / GLOBAL_FILE), outer_state, state


def load_replica(directory: Path, replica: int) -> dict[str, Any]:
    """One replica's saved state, loaded without unpickling arbitrary objects."""
    path = directory / replica_file(replica)
    if not path.is_file():
        raise FileNotFoundError(f"checkpoint {directory} is incomplete: missing {path.name}")
    return torch.load(path, map_location="cpu", weights_only=True)
