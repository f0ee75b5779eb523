"""JSON files that every reader accepts: non-finite floats are written as null, and files are
replaced atomically.

Python's json writes NaN and Infinity, which are not JSON: strict parsers (jq, JavaScript,
W&B's tooling) reject the whole file. Every JSON file the project writes goes through here.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

from isoloco_ray.own_files import replace_file


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


def write(path: Path, value: Any, *, indent: int | None = None) -> None:
    """Write `value` to `path` as strict JSON (and a final newline), atomically: through a
    temporary file beside it and a rename, so a reader never sees half a file (a torn
    summary.json would look like a finished run), which replaces a link planted at the name
    rather than writing through it (own_files.replace_file)."""
    replace_file(path, dumps(value, indent=indent) + "\n")
