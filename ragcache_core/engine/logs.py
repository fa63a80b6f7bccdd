"""vLLM's own output (its log lines, its processes' warnings and progress bars) into a file.

vLLM logs INFO lines to stdout from three processes (the app, the engine core, the worker),
and its engine processes also write warnings, C++ messages and a weight-loading bar straight
to file descriptors 1 and 2. `quiet_vllm(path)` sends all of it to `path` instead, so the
terminal (or a notebook) shows the application's own output only:

    this process          the `vllm` logger gets a file handler (and stops propagating)
    engine processes      VLLM_LOGGING_CONFIG_PATH: the same handler, in vLLM's dictConfig;
                          while an engine starts (`engine_output`, around `AsyncLLM` / `LLM`)
                          fds 1 and 2 point at the file, so its processes inherit it

The switch is the environment variable `RAGCACHE_VLLM_LOG` (the file's path): `quiet_vllm`
sets it, and a user may set it in the shell (`RAGCACHE_VLLM_LOG=vllm.log ragcache serve ...`).
Without it nothing changes: vLLM prints as it always does.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import sys
import threading
from collections.abc import Iterator
from pathlib import Path

__all__ = ["LOG_ENV", "default_log_file", "engine_output", "quiet_vllm", "vllm_log_file"]

LOG_ENV = "RAGCACHE_VLLM_LOG"
"""The environment variable that turns the redirection on: the log file's path."""

_HANDLER = "ragcache_vllm_file"
_FORMAT = (
    "(%(processName)s pid=%(process)d) %(levelname)s %(asctime)s "
    "[%(filename)s:%(lineno)d] %(message)s"
)

# File descriptors 1 and 2 belong to the whole process: two engines starting at once in two
# threads must not save and restore them interleaved (that could leave them on the file).
_FD_LOCK = threading.RLock()


def default_log_file(name: str = "vllm") -> Path:
    """`$RAGCACHE_VLLM_LOG` when set, else `$RAGCACHE_HOME/logs/<name>.log` (default home
    `~/.cache/ragcache`, where the built models are cached too)."""
    if given := os.environ.get(LOG_ENV):
        return Path(given)
    home = Path(os.environ.get("RAGCACHE_HOME", Path.home() / ".cache" / "ragcache"))
    return home / "logs" / f"{name}.log"


def vllm_log_file() -> Path | None:
    """Where vLLM's output goes (`$RAGCACHE_VLLM_LOG`), or None: vLLM prints as usual."""
    given = os.environ.get(LOG_ENV)
    return Path(given) if given else None


def quiet_vllm(log_file: str | Path | None = None) -> Path:
    """Send vLLM's output to `log_file` (default `default_log_file()`) from now on: this
    process's `vllm` logger, and every engine started after this call (its processes' log
    lines, warnings and progress bars). Returns the file's absolute path, to tell the user.

    Mutates process state on purpose: sets `RAGCACHE_VLLM_LOG` and vLLM's logging variables
    (inherited by child processes), and the `vllm` logger's handlers. The file is emptied at
    the first call for it in this process; later calls with the same file keep it.
    """
    path = Path(log_file).expanduser() if log_file is not None else default_log_file()
    path = path.absolute()
    fresh = os.environ.get(LOG_ENV) != str(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    if fresh:
        path.write_text("")
    os.environ[LOG_ENV] = str(path)
    _configure(path)
    return path


@contextlib.contextmanager
def engine_output() -> Iterator[None]:
    """Around the start of a vLLM engine: with `RAGCACHE_VLLM_LOG` set, point fds 1 and 2 at
    the log meanwhile, so the engine processes started now write there for their whole life;
    restored after. Without it: nothing."""
    path = vllm_log_file()
    if path is None:
        yield
        return
    path.parent.mkdir(parents=True, exist_ok=True)
    _configure(path)
    with _FD_LOCK, _fds_to(path):
        yield


@contextlib.contextmanager
def _fds_to(path: Path) -> Iterator[None]:
    _flush()
    try:
        target = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
        saved = (os.dup(1), os.dup(2))
    except OSError:  # no usable fds 1/2 (a daemon): nothing to redirect
        yield
        return
    try:
        os.dup2(target, 1)
        os.dup2(target, 2)
        yield
    finally:
        _flush()
        os.dup2(saved[0], 1)
        os.dup2(saved[1], 2)
        for fd in (target, *saved):
            os.close(fd)


def _flush() -> None:
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(Exception):
            stream.flush()


def _configure(path: Path) -> None:
    """vLLM's logging to `path`: a dictConfig file for its processes (unless logging
    configuration is off, or the user gave vLLM a config of their own), and the same handler
    on this process's `vllm` logger."""
    level = os.environ.get("VLLM_LOGGING_LEVEL", "INFO").upper()
    config_file = path.with_name(path.name + ".config.json")
    current = os.environ.get("VLLM_LOGGING_CONFIG_PATH")
    ours = not current or current == str(config_file) or _written_here(current)
    if ours and os.environ.get("VLLM_CONFIGURE_LOGGING", "1") != "0":
        config_file.write_text(json.dumps(_dict_config(path, level), indent=1))
        os.environ["VLLM_LOGGING_CONFIG_PATH"] = str(config_file)
    logger = logging.getLogger("vllm")
    if any(getattr(h, "baseFilename", None) == str(path) for h in logger.handlers):
        return
    for handler in list(logger.handlers):
        logger.removeHandler(handler)
    handler = logging.FileHandler(path, mode="a", encoding="utf-8")
    handler.set_name(_HANDLER)
    handler.setFormatter(logging.Formatter(_FORMAT, "%m-%d %H:%M:%S"))
    logger.addHandler(handler)
    logger.setLevel(level)
    logger.propagate = False


def _written_here(config_file: str) -> bool:
    """Whether `config_file` is one of ours (inherited from a parent that called
    `quiet_vllm`): then this process's own choice replaces it."""
    try:
        config = json.loads(Path(config_file).read_text())
    except (OSError, ValueError):
        return False
    return isinstance(config, dict) and _HANDLER in config.get("handlers", {})


def _dict_config(path: Path, level: str) -> dict[str, object]:
    return {
        "version": 1,
        "disable_existing_loggers": False,
        "formatters": {"ragcache_vllm": {"format": _FORMAT, "datefmt": "%m-%d %H:%M:%S"}},
        "handlers": {
            _HANDLER: {
                "class": "logging.FileHandler",
                "filename": str(path),
                "mode": "a",
                "encoding": "utf-8",
                "formatter": "ragcache_vllm",
                "level": level,
            }
        },
        "loggers": {"vllm": {"handlers": [_HANDLER], "level": level, "propagate": False}},
    }
