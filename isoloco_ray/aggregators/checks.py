"""Argument checks shared by the public functions: one clear ValueError per bad value."""

from __future__ import annotations

from collections.abc import Sequence
from numbers import Real

import torch


def check_choice(name: str, value: object, choices: Sequence[str]) -> str:
    """`value` must be one of `choices`."""
    if not isinstance(value, str) or value not in choices:
        allowed = ", ".join(repr(c) for c in choices)
        raise ValueError(f"{name} must be one of {allowed}; got {value!r}")
    return value


def check_fraction(name: str, value: object, low: float, high: float, *,
                   low_open: bool = False, high_open: bool = False) -> float:
    """`value` must be a real number in the interval given (open or closed at each end)."""
    interval = f"{'(' if low_open else '['}{low:g}, {high:g}{')' if high_open else ']'}"
    if isinstance(value, bool) or not isinstance(value, Real):
        raise ValueError(f"{name} must be a number in {interval}; got {value!r}")
    v = float(value)
    if not ((low < v if low_open else low <= v) and (v < high if high_open else v <= high)):
        raise ValueError(f"{name} must be in {interval}; got {value!r}")
    return v


def check_bool(name: str, value: object) -> bool:
    """`value` must be True or False."""
    if not isinstance(value, bool):
        raise ValueError(f"{name} must be True or False; got {value!r}")
    return value


def check_generator(name: str, value: object) -> torch.Generator:
    """`value` must be a torch.Generator."""
    if not isinstance(value, torch.Generator):
        raise ValueError(f"{name} must be a torch.Generator; got {type(value).__name__}")
    return value
