"""Loading a run's settings: defaults < YAML file < --section.field=value flags, and the
one-line errors that name the field (`ConfigError`)."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

from pydantic import BaseModel

from isoloco_ray.config.schema import OuterConfig
from isoloco_ray.config.train_config import TrainConfig
from isoloco_ray.strategies import STRATEGIES, option_strategies


class ConfigError(ValueError):
    """A configuration the run cannot use; its message names the field and the fix."""


def format_validation_error(error: Any) -> str:
    """One line per problem: `section.field: what is wrong`."""
    lines = []
    for item in error.errors():
        location = ".".join(str(part) for part in item["loc"])
        message = item["msg"].removeprefix("Value error, ")
        if item["type"] == "extra_forbidden":
            message = "unknown field; see --help for the fields of each section"
        elif item["type"] == "finite_number":
            message = f"must be a finite number (got {item.get('input')!r})"
        elif item["type"] in ("literal_error", "enum"):
            message = f"{message} (got {item.get('input')!r})"
        lines.append(message if not location or message.startswith(location)
                     else f"{location}: {message}")
    return "\n".join(lines)


def read_yaml_config(path: Path) -> dict[str, Any]:
    """The mapping in a YAML config file (sections as in TrainConfig)."""
    import yaml

    if not path.is_file():
        raise ConfigError(f"config file {path} does not exist")
    raw = path.read_bytes()
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        line = raw[:exc.start].count(b"\n") + 1
        raise ConfigError(f"config file {path} is not UTF-8 text (line {line}, byte "
                          f"{exc.start}); save it as UTF-8") from None
    try:
        loaded = yaml.safe_load(text) or {}
    except yaml.YAMLError as exc:
        raise ConfigError(f"config file {path} is not valid YAML: {exc}") from None
    if not isinstance(loaded, dict):
        raise ConfigError(f"config file {path} must hold a mapping of sections "
                          "(model:, data:, scaling:, inner:, outer:, run:)")
    return loaded


def merge_nested(base: dict[str, Any], override: dict[str, Any]) -> dict[str, Any]:
    """`base` updated by `override`, section by section (override wins)."""
    merged = dict(base)
    for key, value in override.items():
        if isinstance(value, dict) and isinstance(merged.get(key), dict):
            merged[key] = merge_nested(merged[key], value)
        else:
            merged[key] = value
    return merged


def build_config(values: dict[str, Any]) -> TrainConfig:
    """Validate `values` into a TrainConfig, raising ConfigError with readable lines."""
    from pydantic import ValidationError

    try:
        return TrainConfig.model_validate(values)
    except ValidationError as exc:
        raise ConfigError(format_validation_error(exc)) from None


# What the command line accepts for "unset" in an optional field: YAML's null and Python's None,
# in any case. pydantic-settings takes one spelling (cli_parse_none_str); the others are mapped
# to it before parsing.
NULL_SPELLINGS = ("null", "none")
CLI_NONE = "None"

# The --help description; shown as written (pydantic-settings keeps its line breaks).
CLI_DESCRIPTION = """\
Every field can also be set in a YAML file given as the first argument; the
command line wins.

Optional fields (those that may be left unset: a preset's, the strategy's or the
data's value, or off) are unset again with null, None or none, as `field: null`
does in YAML: e.g. --inner.clip=null (no clipping), --outer.lr=null (the
strategy's paper value). The other fields always take a value."""


def parse_cli_overrides(args: list[str], prog: str) -> dict[str, Any]:
    """`--section.field=value` flags as a nested dict of the fields given, unvalidated.

    Parsed by pydantic-settings' CLI: `--help` prints every field with its default and
    description and exits; an unknown flag exits with status 2 and argparse's message. An
    optional field takes null, None or none (any case) for "unset" (`_unset_spellings`).
    """
    from pydantic_settings import BaseSettings, CliSettingsSource, SettingsConfigDict
    from pydantic_settings.exceptions import SettingsError

    class CommandLine(TrainConfig, BaseSettings):
        model_config = SettingsConfigDict(cli_prog_name=prog, cli_avoid_json=True,
                                          cli_parse_none_str=CLI_NONE, cli_hide_none_type=True,
                                          cli_exit_on_error=False)

    CommandLine.__doc__ = CLI_DESCRIPTION + "\n\n" + strategy_options_help()
    args, options = _strategy_option_flags(args)
    try:
        parsed = CliSettingsSource(CommandLine, cli_parse_args=_unset_spellings(args))()
    except SettingsError as exc:
        raise ConfigError(_explain_cli_error(str(exc))) from None
    return merge_nested(parsed, {"outer": options}) if options else parsed


def setting_paths() -> list[str]:
    """Dotted paths of every setting of a run: TrainConfig's fields and the strategies'
    options."""
    return field_paths(TrainConfig) + strategy_option_paths()


def strategy_option_paths() -> list[str]:
    """`outer.<option>` of every option a strategy of the registry takes beyond OuterConfig's
    own fields (strategies.py: each strategy's options model)."""
    return [f"outer.{name}" for name in option_strategies()
            if name not in OuterConfig.model_fields]


def strategy_options_help() -> str:
    """The strategies' options for --help: each with the strategies that take it."""
    lines = ["Each strategy's options (--outer.NAME=VALUE; only for the strategies named,"
             " defaults: docs/strategies.md):"]
    takers = option_strategies()
    for path in strategy_option_paths():
        name = path.removeprefix("outer.")
        fields = {strategy: STRATEGIES[strategy].options_model.model_fields[name]
                  for strategy in takers[name]}
        defaults = {strategy: field.default for strategy, field in fields.items()}
        if len(set(map(repr, defaults.values()))) == 1:
            default = next(iter(defaults.values()))
            who = ", ".join(takers[name]) + ("" if default is None else f"; default {default}")
        else:  # e.g. prune: ties drops the smallest, dare at random
            who = "; ".join(f"{strategy}: default {value}" for strategy, value in defaults.items())
        lines.append(f"  --{path}  ({who}) {next(iter(fields.values())).description}")
    return "\n".join(lines)


def _strategy_option_flags(args: list[str]) -> tuple[list[str], dict[str, Any]]:
    """`args` without the strategy options' flags (`--outer.sparsity=0.2` or `--outer.sparsity
    0.2`), and those options' values as given (text; "unset" spellings as None), which the
    strategy's options model checks. pydantic-settings knows only OuterConfig's own fields."""
    options = {path.removeprefix("outer.") for path in strategy_option_paths()}
    rest: list[str] = []
    given: dict[str, Any] = {}
    i = 0
    while i < len(args):
        flag, eq, value = args[i].partition("=")
        name = flag.removeprefix("--outer.") if flag.startswith("--outer.") else None
        if name not in options:
            rest.append(args[i])
            i += 1
            continue
        if not eq:
            if i + 1 >= len(args) or args[i + 1].startswith("--"):
                raise ConfigError(f"{flag}: give it a value, e.g. {flag}=VALUE (see --help)")
            i, value = i + 1, args[i + 1]
        given[name] = None if value.lower() in NULL_SPELLINGS else value
        i += 1
    return rest, given


def _unset_spellings(args: list[str]) -> list[str]:
    """`args` with every spelling of "unset" (NULL_SPELLINGS, any case) given to an optional
    field turned into the one pydantic-settings parses (CLI_NONE), in both the `--f=value` and
    the `--f value` form. The same word given to a field that always has a value is a
    ConfigError naming the field (rather than a type error about the word)."""
    optional = set(optional_field_paths(TrainConfig))
    known = set(field_paths(TrainConfig))
    out = list(args)
    for i, arg in enumerate(args):
        if not arg.startswith("--"):
            continue
        flag, eq, value = arg.partition("=")
        at = i
        if not eq:
            if i + 1 >= len(args) or args[i + 1].startswith("--"):
                continue
            at, value = i + 1, args[i + 1]
        path = flag[2:]
        if value.lower() not in NULL_SPELLINGS or path not in known:
            continue
        if path not in optional:
            raise ConfigError(f"{path}: cannot be unset ({value!r}); it always takes a value, "
                              "see --help")
        out[at] = f"{flag}={CLI_NONE}" if eq else CLI_NONE
    return out


def _explain_cli_error(message: str) -> str:
    """argparse's complaint, with the closest real flag suggested for a misspelt one."""
    import difflib

    unknown = re.search(r"unrecognized arguments: (\S+)", message)
    if not unknown:
        return message.removeprefix("error parsing CLI: ")
    flag = unknown.group(1).split("=", 1)[0]
    known = [f"--{path}" for path in setting_paths()]
    close = difflib.get_close_matches(flag, known, n=1)
    hint = f"; did you mean {close[0]}?" if close else "; see --help for every field"
    return f"{flag}: unknown option{hint}"


def field_paths(model: type[BaseModel], prefix: str = "") -> list[str]:
    """Dotted paths of every leaf field of `model` (sections and sub-sections walked)."""
    paths = []
    for name, spec in model.model_fields.items():
        if isinstance(spec.annotation, type) and issubclass(spec.annotation, BaseModel):
            paths += field_paths(spec.annotation, f"{prefix}{name}.")
        else:
            paths.append(f"{prefix}{name}")
    return paths


def optional_field_paths(model: type[BaseModel], prefix: str = "") -> list[str]:
    """Dotted paths of the leaf fields of `model` that accept None (their "unset" value)."""
    import types
    import typing

    paths = []
    for name, spec in model.model_fields.items():
        if isinstance(spec.annotation, type) and issubclass(spec.annotation, BaseModel):
            paths += optional_field_paths(spec.annotation, f"{prefix}{name}.")
        elif (typing.get_origin(spec.annotation) in (typing.Union, types.UnionType)
              and type(None) in typing.get_args(spec.annotation)):
            paths.append(f"{prefix}{name}")
    return paths


def flatten(values: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    """Nested sections as dotted paths: {"inner": {"lr": 1}} -> {"inner.lr": 1}."""
    flat: dict[str, Any] = {}
    for key, value in values.items():
        if isinstance(value, dict):
            flat.update(flatten(value, f"{prefix}{key}."))
        else:
            flat[f"{prefix}{key}"] = value
    return flat


def nest(flat: dict[str, Any]) -> dict[str, Any]:
    """Dotted paths as nested sections: {"inner.lr": 1} -> {"inner": {"lr": 1}}."""
    nested: dict[str, Any] = {}
    for path, value in flat.items():
        *sections, name = path.split(".")
        node = nested
        for section in sections:
            node = node.setdefault(section, {})
        node[name] = value
    return nested


def load_config(args: list[str], prog: str = "python -m isoloco_ray.train") -> TrainConfig:
    """The TrainConfig of a command line `[CONFIG.yaml] [--section.field=value ...]`."""
    values: dict[str, Any] = {}
    if args and not args[0].startswith("-"):
        values = read_yaml_config(Path(args[0]))
        args = args[1:]
    return build_config(merge_nested(values, parse_cli_overrides(args, prog)))
