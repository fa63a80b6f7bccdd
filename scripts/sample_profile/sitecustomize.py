"""A sampling profiler for every Python process of a run, vLLM's engine core and workers
included (they are spawned, so a profiler that attaches from outside needs ptrace rights
this machine does not give).

Python imports `sitecustomize` at start-up from any folder on `PYTHONPATH`, and spawned
children inherit it. With `RAGCACHE_SAMPLE_DIR` set, each process starts a daemon thread that
samples every thread's Python stack every `RAGCACHE_SAMPLE_INTERVAL_S` (default 0.01 s) and
rewrites `DIR/<pid>.txt` every `RAGCACHE_SAMPLE_FLUSH_S` (default 5 s): its command line,
then one `thread;frame;...;frame count` line per distinct stack (root first). Time in C
(torch ops, a wait) counts for the Python frame that called it. The sampler needs the GIL to
read a stack, so a Python burst shorter than the interpreter's switch interval (5 ms) is mostly
seen at the wait that follows it: it under-counts short bursts. The last samples are written at
exit too. Read the files with `scripts/sample_profile_report.py`.

    RAGCACHE_SAMPLE_DIR=/tmp/prof PYTHONPATH=scripts/sample_profile \\
        .venv/bin/ragcache bench serve --workloads long-shuffled \\
        --systems vllm-apc-total,ragcache --ablations none --repeats 1 --max-points 1 \\
        --rate 3.52 --vllm-kv-gib 1
"""

from __future__ import annotations

import atexit
import collections
import os
import sys
import threading
import time
from types import FrameType


def _stack(frame: FrameType | None) -> str:
    names: list[str] = []
    while frame is not None:
        code = frame.f_code
        # The leaf with its line, callers with their function's first line (one name each).
        line = frame.f_lineno if not names else code.co_firstlineno
        names.append(f"{code.co_name} ({os.path.basename(code.co_filename)}:{line})")
        frame = frame.f_back
    return ";".join(reversed(names))


def _flush(path: str, counts: collections.Counter[str]) -> None:
    with open(path + ".tmp", "w", encoding="utf-8") as out:
        out.write(" ".join(sys.argv)[:300].replace("\n", " ") + "\n")
        for stack, count in counts.items():
            out.write(f"{stack} {count}\n")
    os.replace(path + ".tmp", path)


def _flush_at_exit(path: str, counts: collections.Counter[str]) -> None:
    for _ in range(3):  # the sampler may still be adding a stack while this copies
        try:
            _flush(path, collections.Counter(counts))
            return
        except RuntimeError:
            time.sleep(0.001)


def _sample(folder: str, interval_s: float, flush_s: float) -> None:
    counts: collections.Counter[str] = collections.Counter()
    me = threading.get_ident()
    path = os.path.join(folder, f"{os.getpid()}.txt")
    atexit.register(_flush_at_exit, path, counts)
    flushed = time.monotonic()
    while True:
        time.sleep(interval_s)
        for thread, frame in sys._current_frames().items():
            if thread != me:
                counts[f"{thread};{_stack(frame)}"] += 1
        if time.monotonic() - flushed > flush_s:
            flushed = time.monotonic()
            _flush(path, counts)


_FOLDER = os.environ.get("RAGCACHE_SAMPLE_DIR")
if _FOLDER:
    os.makedirs(_FOLDER, exist_ok=True)
    _INTERVAL = float(os.environ.get("RAGCACHE_SAMPLE_INTERVAL_S", "0.01"))
    _FLUSH = float(os.environ.get("RAGCACHE_SAMPLE_FLUSH_S", "5"))
    threading.Thread(
        target=_sample, args=(_FOLDER, _INTERVAL, _FLUSH), daemon=True, name="sampler"
    ).start()
