"""Convert the research code's W&B sweep files into grid files for `python -m isoloco_ray.tune`.

    python -m isoloco_ray.tune --from-wandb-sweep SWEEP.yaml > tune_configs/X.yaml

A sweep file has `name`, `project`, `method: grid`, `metric: {goal, name}`, `program: train.py`,
`command:` (torchrun with `--nproc_per_node=N`) and `parameters:` whose keys map to
`{value: X}` or `{values: [...]}`. Every combination of the listed values is converted (the
strategy and the options that apply to it depend on each other, e.g. `mergeloco` is DARE when
it prunes at random, rescales and merges without TIES' disjoint step); settings common to all
combinations go to `base:`, the rest to `grid:` when they still form a Cartesian product, else
to explicit `trials:`. Environment references in paths (`$DATA_DIR/...`) are kept; the tune
CLI expands them when the grid runs. Warnings (unknown keys, settings left out) go to stderr.
"""

from __future__ import annotations

import itertools
import json
import re
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from isoloco_ray.config import ConfigError, nest, read_yaml_config
from isoloco_ray.strategies import STRATEGIES, option_strategies

# The research code's strategy names -> ours (mergeloco is refined into ties or dare).
RESEARCH_STRATEGIES = {
    "adam_baseline": "adamw_ddp",
    "diloco_baseline": "diloco",
    "diloco_sgd_noMom": "diloco_sgd",
    "isocloco": "isoc",
    "isoloco": "isoloco",
    "isoctsloco": "isocts",
    "tsvloco": "tsv",
    "mergeloco": "ties",
}
# Plain renames: sweep key -> (field path, value type).
RENAMED: dict[str, tuple[str, str]] = {
    "outer_momentum": ("outer.momentum", "float"),
    "outer_nesterov": ("outer.nesterov", "bool"),
    "weight_decay": ("inner.weight_decay", "float"),
    "inner_steps": ("inner.steps", "int"),
    "batch_size": ("data.batch_size", "int"),
    "micro_batch_size": ("data.micro_batch_size", "int"),
    "token_budget": ("run.token_budget", "int"),
    "sparsity": ("outer.sparsity", "float"),
    "rescale_pruned": ("outer.rescale", "bool"),
    "ties_disjoint": ("outer.disjoint", "bool"),
    "tsv_singular_ratio": ("outer.keep_fraction", "float"),
    "tsv_decorrelate": ("outer.decorrelate", "bool"),
    "common_space_fraction": ("outer.common_fraction", "float"),
    "seed": ("run.seed", "int"),
    "shards_path": ("data.path", "str"),
    "save_path": ("run.storage_path", "str"),
}
# Keys with their own conversion below.
SPECIAL = ("strategy", "inner_learning_rate", "outer_learning_rate", "inner_beta2",
           "warmup_steps", "sequence_length", "virtual_workers", "hparams_file", "prune_method",
           "prune_dimension", "orthogonalize_object")
IGNORED = {"use_compile": "no torch.compile setting here"}
KNOWN_KEYS = set(RENAMED) | set(SPECIAL) | set(IGNORED)
CHOICES = {
    "prune_method": {"magnitude": "magnitude", "mag": "magnitude", "random": "random",
                     "rand": "random"},
    "prune_dimension": {"all": "all", "row": "row", "rows": "row", "column": "column",
                        "columns": "column", "col": "column", "cols": "column"},
    "orthogonalize_object": {"gradient": "gradient", "grad": "gradient",
                             "pseudo_gradient": "gradient", "pseudogradient": "gradient",
                             "update": "update", "momentum": "update"},
}
DEFAULT_SEQUENCE_LENGTH = 2048
# Where the research code reads its shards when a sweep sets no shards_path (its README).
DEFAULT_SHARDS_PATH = "$DATA_DIR/dclm_tokenized-train_valid_test"
SWEEP_KEYS = {"name", "project", "entity", "method", "metric", "program", "command",
              "parameters", "description"}


class SweepError(ConfigError):
    """A sweep file this converter cannot turn into a grid; the message names the key."""


@dataclass
class Notes:
    """Warnings for stderr, each said once; settings left out of some strategies' trials are
    gathered into one line per sweep key."""

    lines: list[str] = field(default_factory=list)
    left_out: dict[str, list[str]] = field(default_factory=dict)  # sweep key -> strategies
    header: list[str] = field(default_factory=list)  # for the converted file's header too

    def add(self, line: str) -> None:
        if line not in self.lines:
            self.lines.append(line)

    def leave_out(self, key: str, strategy: str | None) -> None:
        strategies = self.left_out.setdefault(key, [])
        if strategy not in strategies:
            strategies.append(str(strategy))

    def all_lines(self) -> list[str]:
        """Every line, prefixed `warning:` or (defaults and settings left out as expected)
        `note:`."""
        return [f"note: {line}" for line in self.header] + [
            f"warning: {line}" for line in self.lines] + [
            f"note: parameters.{key} does not apply to {', '.join(strategies)}; left out of "
            "their trials" for key, strategies in self.left_out.items()]


def as_bool(key: str, value: Any) -> bool:
    """A sweep boolean: true/false, also as the strings "true"/"false"."""
    if isinstance(value, bool):
        return value
    if isinstance(value, str) and value.strip().lower() in ("true", "false"):
        return value.strip().lower() == "true"
    raise SweepError(f"parameters.{key}: expected true or false, got {value!r}")


def as_number(key: str, value: Any, kind: str) -> float | int:
    """A sweep number; YAML reads `1e-3` (no dot) as a string, so strings are parsed too."""
    try:
        number = float(value)
    except (TypeError, ValueError):
        raise SweepError(f"parameters.{key}: expected a number, got {value!r}") from None
    if kind == "int":
        if number != int(number):
            raise SweepError(f"parameters.{key}: expected a whole number, got {value!r}")
        return int(number)
    return number


def convert_value(key: str, value: Any, kind: str) -> Any:
    """`value` of sweep key `key` as the type of its field."""
    if kind == "bool":
        return as_bool(key, value)
    if kind in ("int", "float"):
        return as_number(key, value, kind)
    return str(value)


def choice(key: str, value: Any) -> str:
    """One of the known spellings of an enumerated sweep value."""
    options = CHOICES[key]
    normalised = str(value).strip().lower()
    if normalised not in options:
        raise SweepError(f"parameters.{key}: unknown value {value!r} (expected one of "
                         f"{', '.join(sorted(set(options.values())))})")
    return options[normalised]


def sweep_parameters(sweep: dict[str, Any]) -> dict[str, list[Any]]:
    """Each parameter's list of values ({value: X} -> [X], {values: [...]} -> the list)."""
    parameters = sweep.get("parameters")
    if not isinstance(parameters, dict) or not parameters:
        raise SweepError("parameters: missing; a sweep file maps each parameter to "
                         "{value: X} or {values: [...]}")
    listed = {}
    for key, spec in parameters.items():
        if isinstance(spec, dict) and "value" in spec:
            listed[key] = [spec["value"]]
        elif isinstance(spec, dict) and isinstance(spec.get("values"), list) and spec["values"]:
            listed[key] = list(spec["values"])
        else:
            raise SweepError(f"parameters.{key}: expected {{value: X}} or {{values: [...]}}, "
                             f"got {spec!r} (distributions cannot make a grid)")
    return listed


def nproc_per_node(command: Any, notes: Notes) -> int:
    """N of torchrun's `--nproc_per_node=N` (or `--nproc-per-node N`) in the sweep command."""
    items = [str(item) for item in command] if isinstance(command, list) else []
    for index, item in enumerate(items):
        match = re.fullmatch(r"--nproc[_-]per[_-]node(?:=(\S+))?", item)
        if match:
            value = match.group(1) or (items[index + 1] if index + 1 < len(items) else "")
            if value.isdigit():
                return int(value)
            raise SweepError(f"command: --nproc_per_node={value!r} is not a number of GPUs")
    notes.add("command: no torchrun --nproc_per_node=N; assuming 1 process per node")
    return 1


def model_preset(path: str) -> str | None:
    """178M or 512M from the folder names of an hparams_file path."""
    for part in reversed(Path(path).parts[:-1] or Path(path).parts):
        for preset in ("178M", "512M"):
            if part.upper() == preset:
                return preset
    return None


def strategy_of(params: dict[str, Any]) -> str:
    """Our strategy for one combination of sweep values."""
    raw = str(params["strategy"])
    if raw not in RESEARCH_STRATEGIES:
        raise SweepError(f"parameters.strategy: unknown strategy {raw!r} (known: "
                         f"{', '.join(RESEARCH_STRATEGIES)})")
    strategy = RESEARCH_STRATEGIES[raw]
    if (raw == "mergeloco" and str(params.get("prune_method", "")).lower() == "random"
            and as_bool("rescale_pruned", params.get("rescale_pruned", "false"))
            and not as_bool("ties_disjoint", params.get("ties_disjoint", "true"))):
        return "dare"
    return strategy


def convert_combination(params: dict[str, Any], nproc: int, notes: Notes) -> dict[str, Any]:
    """One combination of sweep values as grid field paths -> values."""
    out: dict[str, Any] = {"scaling.use_gpu": True}
    strategy = strategy_of(params) if "strategy" in params else None
    if strategy is None:
        notes.add("parameters.strategy: missing; the trials use the train CLI's default "
                  "(diloco)")
    else:
        out["outer.strategy"] = strategy

    def applies(option: str) -> bool:
        strategies = option_strategies().get(option.removeprefix("outer."))
        return strategy is None or strategies is None or strategy in strategies

    def put(key: str, path: str, value: Any) -> None:
        # A momentum that a sweep shared by several strategies sets is not theirs where the
        # strategy is defined without one (the registry's takes_momentum).
        if not applies(path) or (strategy is not None
                                 and not STRATEGIES[strategy].takes_momentum
                                 and path in ("outer.momentum", "outer.nesterov")):
            notes.leave_out(key, strategy)
            return
        out[path] = value

    for key, value in params.items():
        if key in RENAMED:
            path, kind = RENAMED[key]
            put(key, path, convert_value(key, value, kind))
        elif key in IGNORED:
            notes.add(f"parameters.{key}: left out ({IGNORED[key]})")
        elif key in CHOICES:
            path = {"prune_method": "outer.prune", "prune_dimension": "outer.prune_dim",
                    "orthogonalize_object": "outer.orthogonalize"}[key]
            put(key, path, choice(key, value))
    if "inner_learning_rate" in params:
        if not STRATEGIES[strategy].has_outer_step:
            notes.leave_out("inner_learning_rate", strategy)  # its lr: outer_learning_rate
        else:
            out["inner.lr"] = as_number("inner_learning_rate", params["inner_learning_rate"],
                                        "float")
    if "outer_learning_rate" in params:
        lr = as_number("outer_learning_rate", params["outer_learning_rate"], "float")
        # The research code's AdamW baseline takes its (only) lr from outer_learning_rate.
        if not STRATEGIES[strategy].has_outer_step:
            out["inner.lr"] = lr
        else:
            out["outer.lr"] = lr
    if "inner_beta2" in params:
        out["inner.betas"] = [0.9, as_number("inner_beta2", params["inner_beta2"], "float")]
    out["data.seq_len"] = as_number("sequence_length",
                                    params.get("sequence_length", DEFAULT_SEQUENCE_LENGTH), "int")
    virtual = as_number("virtual_workers", params.get("virtual_workers", 1), "int")
    out["scaling.replicas"] = nproc * virtual  # R = processes x replicas per process
    out["scaling.replicas_per_worker"] = virtual
    if "hparams_file" in params:
        preset = model_preset(str(params["hparams_file"]))
        if preset is None:
            notes.add(f"parameters.hparams_file: no 178M or 512M folder in "
                      f"{params['hparams_file']!r}; set base.model.preset yourself")
        else:
            out["model.preset"] = preset
    else:
        notes.add("parameters.hparams_file: missing; set base.model.preset yourself")
    if "warmup_steps" in params:
        warmup = warmup_fraction(params, out, notes)
        if warmup is not None:
            out["inner.warmup"] = warmup
    return out


def warmup_fraction(params: dict[str, Any], out: dict[str, Any], notes: Notes) -> float | None:
    """inner.warmup from warmup_steps: a fraction when < 1, else steps over all inner steps
    (rounds x H, with rounds = token_budget // (batch x seq x H x R))."""
    steps = as_number("warmup_steps", params["warmup_steps"], "float")
    if steps < 1:
        return steps
    try:
        h = out["inner.steps"]
        rounds = out["run.token_budget"] // (out["data.batch_size"] * out["data.seq_len"] * h
                                             * out["scaling.replicas"])
    except KeyError as missing:
        notes.add(f"parameters.warmup_steps: {steps:g} steps cannot become a fraction without "
                  f"{missing}; left out (default 0.1)")
        return None
    if rounds < 1:
        return None
    return round(min(steps / (rounds * h), 0.99), 6)


def factor(combos: list[dict[str, Any]]) -> tuple[dict[str, Any], dict[str, list[Any]],
                                                  list[dict[str, Any]]]:
    """(base, grid, trials): settings shared by every combination; the others as a grid when
    the combinations are exactly its Cartesian product, else as explicit trials."""
    unique = list({json.dumps(c, sort_keys=True): c for c in combos}.values())
    keys = list(dict.fromkeys(k for c in unique for k in c))

    def same_everywhere(key: str) -> bool:
        return all(key in c for c in unique) and len({json.dumps(c[key]) for c in unique}) == 1

    base = {k: unique[0][k] for k in keys if same_everywhere(k)}
    varying = [k for k in keys if k not in base]
    rest = [{k: c[k] for k in varying if k in c} for c in unique]
    if not varying:
        return base, {}, []
    values = {k: list({json.dumps(r[k]): r[k] for r in rest if k in r}.values()) for k in varying}
    product = {json.dumps(dict(zip(varying, v)), sort_keys=True)
               for v in itertools.product(*values.values())}
    if all(len(r) == len(varying) for r in rest) and product == {
            json.dumps(r, sort_keys=True) for r in rest}:
        return base, values, []
    return base, {}, rest


def metric_of(sweep: dict[str, Any], notes: Notes) -> dict[str, str]:
    """The grid's metric from the sweep's `metric: {goal, name}`."""
    metric = sweep.get("metric") or {}
    name = str(metric.get("name", "")).lower()
    mode = "max" if str(metric.get("goal", "minimize")).lower().startswith("max") else "min"
    if "perplexity" in name or "ppl" in name:
        return {"name": "final_eval_perplexity", "mode": mode}
    if name and "loss" not in name:
        notes.add(f"metric.name: {metric.get('name')!r} has no equivalent; ranking by the "
                  "final eval loss")
        mode = "min"
    return {"name": "final_eval_loss", "mode": mode}


def convert_sweep(sweep: dict[str, Any], source: str = "sweep") -> tuple[dict[str, Any], Notes]:
    """(grid file mapping, what to tell about it) for a W&B sweep mapping."""
    notes = Notes()
    unknown_top = sorted(set(sweep) - SWEEP_KEYS)
    if unknown_top:
        notes.add(f"unknown sweep keys left out: {', '.join(unknown_top)}")
    method = sweep.get("method", "grid")
    if method != "grid":
        notes.add(f"method: {method!r}; converted as a grid over every listed value")
    parameters = sweep_parameters(sweep)
    unknown = sorted(set(parameters) - KNOWN_KEYS)
    if unknown:
        notes.add(f"unknown sweep parameters left out: {', '.join(unknown)}")
        parameters = {k: v for k, v in parameters.items() if k not in unknown}
    nproc = nproc_per_node(sweep.get("command"), notes)
    combos = [convert_combination(dict(zip(parameters, values)), nproc, notes)
              for values in itertools.product(*parameters.values())]
    if "shards_path" not in parameters:
        for combo in combos:
            combo["data.path"] = DEFAULT_SHARDS_PATH
        notes.header.append(f"data.path: the sweep sets no shards_path; {DEFAULT_SHARDS_PATH}, "
                            "the research code's default, is used")
    base, grid, trials = factor(combos)
    distinct = len({json.dumps(c, sort_keys=True) for c in combos})
    if distinct < len(combos):
        notes.add(f"{len(combos)} combinations of the sweep are {distinct} distinct trials "
                  "(settings that do not apply to a strategy were left out)")
    base_nested = nest(base)
    if sweep.get("project"):
        run = base_nested.setdefault("run", {})
        run["wandb"] = {"project": str(sweep["project"])}
        if sweep.get("entity"):
            run["wandb"]["entity"] = str(sweep["entity"])
    grid_file: dict[str, Any] = {}
    if sweep.get("name"):
        grid_file["name"] = re.sub(r"[^A-Za-z0-9._-]", "_", str(sweep["name"])).lstrip("._-")
    grid_file["metric"] = metric_of(sweep, notes)
    grid_file["base"] = base_nested
    if grid:
        grid_file["grid"] = grid
    if trials:
        grid_file["trials"] = trials
    return grid_file, notes


def to_yaml(grid_file: dict[str, Any], source: str, notes: list[str] = ()) -> str:
    """The grid file as YAML, with a header saying where it came from and `notes`."""
    import yaml

    header = (f"# Converted from the W&B sweep {source} by\n"
              f"#   python -m isoloco_ray.tune --from-wandb-sweep {source}\n"
              + "".join(f"# {note}\n" for note in notes)
              + "# $VARIABLES in paths are expanded when the grid runs. Check the values, then:\n"
              "#   python -m isoloco_ray.tune THIS_FILE.yaml --dry-run\n")
    return header + yaml.safe_dump(grid_file, sort_keys=False, default_flow_style=None,
                                   width=100)


def convert_main(path: Path) -> int:
    """Print the grid file converted from the sweep at `path`; 2 on errors."""
    try:
        sweep = read_yaml_config(path)
        grid_file, notes = convert_sweep(sweep, str(path))
    except SweepError as exc:
        print(f"error: {path}: {exc}", file=sys.stderr)
        return 2
    except ConfigError as exc:  # unreadable file: the message names it
        print(f"error: {exc}", file=sys.stderr)
        return 2
    for line in notes.all_lines():
        print(line, file=sys.stderr)
    sys.stdout.write(to_yaml(grid_file, str(path), notes.header))
    return 0
