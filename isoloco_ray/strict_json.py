"""JSON files that every reader accepts: non-finite floats are written as null.

Python's json writes NaN and Infinity, which are not JSON: strict parsers (jq, JavaScript,
W&B's tooling) reject the whole file. Every JSON file the project writes goes through here.
"""

from __future__ import annotations

import json
import math
from typing import Any


def finite_or_none(value: Any) -> Any:
    """`value` with every non-finite float (NaN, ±inf), at any depth, replaced by None."""
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, dict):
        return {key: finite_or_none(item) for key, item in value.items()}
    if isinstance(value, (list, tuple)):
        return [finite_or_none(item) for item in value]
    return value


def dumps(value: Any, **kwargs: Any) -> str:
    """Strict JSON text of `value` (json.dumps keywords apply); non-finite floats become null."""
    return json.dumps(finite_or_none(value), allow_nan=False, **kwargs)
