"""Read the samples of `scripts/sample_profile` (one file per process): per process, where its
busy samples went, by the parts of a request's path.

    .venv/bin/python scripts/sample_profile_report.py /tmp/prof [--top 15]

A sample is busy unless its leaf frame waits (a selector, a lock, a queue, a sleep, the
executor's spin on the worker's reply). A wait called straight from Python code (a
`time.sleep` in a loop) leaves its caller as the leaf, so it counts as busy: read the leaf
list before a share. A part counts the busy samples whose stack passes
through it (inclusive), so parts can overlap (the connector's copies run inside
`execute_model`). The process kind comes from its frames: vLLM's engine core, its worker, or
the driver (the benchmark or the app, with RAGCache's runtime).
"""

from __future__ import annotations

import argparse
import collections
import re
from pathlib import Path
from typing import NamedTuple

IDLE_LEAF = re.compile(
    r"^(select|poll|wait|acquire|sleep|get|_worker|recv|_recv|recv_multipart|read|readinto|"
    r"accept|dequeue|sched_yield|epoll|_wait_for_tstate_lock|wait_for) \("
)
PARTS: dict[str, dict[str, str]] = {
    "Worker": {
        "execute_model": r"execute_model \(gpu_model_runner",
        "model forward": r"_model_forward \(",
        "connector: loads": r"\bload \(worker_side",
        "connector: after the forward (stores, eviction-time copies)": r"\bstore \(worker_side",
        "connector: of which eviction-time copies": r"write_evicted \(worker_side",
        "sampling": r"sample \(|_sample \(",
    },
    "EngineCore": {
        "schedule": r"schedule \(scheduler\.py",
        "connector: scheduler side": r"scheduler_side\.py|window\.py",
        "update_from_output": r"update_from_output \(",
        "input/output queues": (
            r"process_input_sockets|process_output_sockets|_handle_client_request"
        ),
    },
    "driver": {
        "knowledge tree (plan, confirm)": r"knowledge_tree\.py|planner\.py|host_writes\.py",
        "admission and reordering": r"admission\.py|reorder\.py",
        "prompt and tokenizer": r"prompt\.py|app_prompt\.py|tokenization_utils",
        "search": r"search\.py|swigfaiss|retrieval/",
        "vLLM front end (AsyncLLM)": r"async_llm\.py|output_processor\.py|core_client\.py",
    },
}


class Process(NamedTuple):
    pid: str
    argv: str
    kind: str
    total: int
    busy: list[tuple[str, int]]


def read(path: Path) -> Process:
    lines = path.read_text(encoding="utf-8").splitlines()
    argv, stacks = lines[0], [line.rsplit(" ", 1) for line in lines[1:] if line]
    rows = [(stack.split(";", 1)[1] if ";" in stack else "", int(n)) for stack, n in stacks]
    joined = " ".join(stack for stack, _ in rows)
    kind = "driver"
    if "worker_busy_loop" in joined:
        kind = "Worker"
    elif "run_engine_core" in joined:
        kind = "EngineCore"
    elif sum(n for stack, n in rows if "resource_tracker" in stack) > sum(n for _, n in rows) / 2:
        kind = "resource tracker"
    busy = [(stack, n) for stack, n in rows if not IDLE_LEAF.match(stack.rsplit(";", 1)[-1])]
    return Process(path.stem, argv, kind, sum(n for _, n in rows), busy)


def report(process: Process, top: int) -> list[str]:
    busy = sum(n for _, n in process.busy)
    out = [f"pid {process.pid} ({process.kind}): {busy} busy samples of {process.total}"]
    for name, pattern in PARTS.get(process.kind, {}).items():
        regex = re.compile(pattern)
        count = sum(n for stack, n in process.busy if regex.search(stack))
        out.append(f"  {count:7d} {100 * count / max(busy, 1):5.1f}%  {name}")
    leaves: collections.Counter[str] = collections.Counter()
    for stack, n in process.busy:
        leaves[stack.rsplit(";", 1)[-1]] += n
    out.append("  top leaf frames:")
    out += [
        f"  {n:7d} {100 * n / max(busy, 1):5.1f}%  {leaf}" for leaf, n in leaves.most_common(top)
    ]
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("folder", type=Path)
    parser.add_argument("--top", type=int, default=10)
    args = parser.parse_args()
    for path in sorted(args.folder.glob("*.txt"), key=lambda p: int(p.stem)):
        process = read(path)
        if process.kind != "resource tracker":
            print("\n".join(report(process, args.top)))


if __name__ == "__main__":
    main()
