"""Where the benchmark data is: `--data-dir`, else `$RAGCACHE_DATA_DIR`, else `../shared/data`.

The benchmark data (SQuAD v1.1 dev, NQ-open dev, MMLU val, the Wikipedia vital articles) is
public but not shipped: docs/benchmarks.md, "Benchmark data", names each file's source and the
layout read here, so a user can rebuild the folder. Every command and script that reads it takes
`--data-dir DIR`; the environment variable serves when a flag cannot be passed (the tests). The
default is the folder next to the checkout where this project's machines keep it.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Iterable, Mapping
from pathlib import Path

from ragcache_core.errors import InputError

DATA_DIR_ENV = "RAGCACHE_DATA_DIR"
DEFAULT_DATA_DIR = Path(__file__).resolve().parents[2].parent / "shared" / "data"
"""`../shared/data` next to the checkout (this project's machines have it)."""

SQUAD_PARAGRAPHS = "squad_v1.1_dev_paragraphs.jsonl"
SQUAD_QUESTIONS = "squad_v1.1_dev_questions.jsonl"
VITAL_ARTICLES = "vital_articles_en_corpus.jsonl"
NQ_OPEN = "NQ-open.dev.jsonl"
MMLU = "mmlu_val.jsonl"
DATA_FILES = (VITAL_ARTICLES, SQUAD_PARAGRAPHS, SQUAD_QUESTIONS, NQ_OPEN, MMLU)
"""Every file of the folder (docs/benchmarks.md, "Benchmark data")."""
DATA_HELP = "the benchmark data folder (default: $RAGCACHE_DATA_DIR, else ../shared/data)"
"""The `--data-dir` option's help, the same in every command and script."""


def resolve_data_dir(
    flag: Path | str | None = None, environ: Mapping[str, str] | None = None
) -> Path:
    """The data folder: `flag` (a `--data-dir` value) if given, else `$RAGCACHE_DATA_DIR` if set
    and not empty, else `DEFAULT_DATA_DIR`. Checks nothing: `require_data` does."""
    if flag is not None and str(flag):
        return Path(flag)
    value = (os.environ if environ is None else environ).get(DATA_DIR_ENV, "")
    return Path(value) if value else DEFAULT_DATA_DIR


def require_data(folder: Path, files: Iterable[str] = DATA_FILES) -> Path:
    """`folder` when it holds every one of `files`; else `InputError` naming what is missing
    and how to point at the data."""
    missing = [name for name in files if not (folder / name).is_file()]
    if missing:
        what = "is absent" if not folder.is_dir() else f"lacks {', '.join(missing)}"
        raise InputError(
            f"benchmark data folder {folder} {what}: give the folder with --data-dir DIR or "
            f"{DATA_DIR_ENV}=DIR (its files and their public sources: docs/benchmarks.md, "
            '"Benchmark data")'
        )
    return folder


def script_data_dir(flag: Path | str | None, files: Iterable[str] = DATA_FILES) -> Path:
    """`require_data(resolve_data_dir(flag), files)` for the scripts in scripts/: a missing
    file exits with the one-line message (exit code 1) instead of a traceback."""
    try:
        return require_data(resolve_data_dir(flag), files)
    except InputError as exc:
        raise SystemExit(f"{Path(sys.argv[0]).name}: error: {exc}") from None
