"""The environment variables isoloco_ray reads, read and checked in one place (`read_env`):
each CLI checks them before anything starts, so a bad value is one line naming the variable
and what it accepts (exit status 2), never a traceback after Ray has started."""

from __future__ import annotations

from pathlib import Path
from typing import Literal

from pydantic import Field, ValidationError, field_validator
from pydantic_settings import BaseSettings, SettingsConfigDict

from isoloco_ray.config import ConfigError

PREFIX = "ISOLOCO_RAY_"


class EnvSettings(BaseSettings):
    """ISOLOCO_RAY_<FIELD> for each field (docs/running.md, docs/fault_tolerance.md)."""

    model_config = SettingsConfigDict(env_prefix=PREFIX, extra="ignore", frozen=True)

    gpu_wait_seconds: float = Field(
        600.0, ge=0, allow_inf_nan=False,
        description="seconds ≥ 0; how long a run waits for its GPUs to join the cluster")
    ft_timeout_s: float = Field(
        30.0, gt=0, allow_inf_nan=False,
        description="seconds > 0; the bound on one collective of replica mode's quorum")
    ft_quorum_timeout_s: float = Field(
        600.0, gt=0, allow_inf_nan=False,
        description="seconds > 0; how long a replica-mode worker waits for a quorum")
    ft_heartbeat_timeout_s: float = Field(
        1.0, ge=0.5, allow_inf_nan=False,
        description="seconds ≥ 0.5; how long replica mode's lighthouse hears nothing from a "
                    "worker before the others go on without it")
    resize_check_seconds: float = Field(
        60.0, gt=0, allow_inf_nan=False,
        description="seconds > 0; how often an elastic run checks the cluster's size")
    cache: Path | None = Field(
        None, description="a directory, or a path where one can be made; the demo data's cache")
    verify_data: Literal["once", "always", "never"] = Field(
        "once", description="once, always or never; when datasets are verified")

    @field_validator("cache")
    @classmethod
    def _a_directory(cls, value: Path | None) -> Path | None:
        if value is not None:
            value = value.expanduser()
            if value.exists() and not value.is_dir():
                raise ValueError("it names a file, not a directory")
        return value


def read_env() -> EnvSettings:
    """The settings from the environment; ConfigError naming the first bad variable, its
    value and what it accepts."""
    try:
        return EnvSettings()
    except ValidationError as exc:
        error = exc.errors()[0]
        name = str(error["loc"][0])
        field = EnvSettings.model_fields[name]
        accepts, what = str(field.description).split("; ", 1)
        default = ("" if field.default is None else f", {field.default:g} when unset"
                   if isinstance(field.default, float) else f", {field.default} when unset")
        why = error["msg"].removeprefix("Value error, ")
        raise ConfigError(f"{PREFIX + name.upper()}={error.get('input')!r}: {why}; it takes "
                          f"{accepts} ({what}{default})") from None
