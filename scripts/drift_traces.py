"""Traces whose popular documents change, built from `build_sim_traces.py`'s (issue 39: a
policy that never forgets is judged on them).

  * `drift_nq_mmlu`: the NQ top-2 stream, then the MMLU top-2 stream: what NQ made frequent
    stops being retrieved;
  * `drift_nq3`: the NQ top-2 stream in three equal parts, each part's document ids renamed
    (`id#part`): the popular set changes twice, the documents' sizes and the questions'
    pattern stay.

Arrivals are re-spaced at 2 requests/s (the policy table serves one request at a time, so
they do not change a cell).

    .venv/bin/python scripts/drift_traces.py /tmp/ragcache-traces --out /tmp/drift-traces
"""

from __future__ import annotations

import argparse
from dataclasses import replace
from pathlib import Path

from ragcache_core.trace import TraceRequest, load_trace, write_trace


def renamed(requests: list[TraceRequest], part: int) -> list[TraceRequest]:
    """The requests with every document id suffixed `#part`: other documents, same sizes."""
    return [replace(r, docs=tuple(f"{d}#{part}" for d in r.docs)) for r in requests]


def respaced(name: str, requests: list[TraceRequest]) -> list[TraceRequest]:
    """Fresh ids (`name-i`) and arrivals 0.5 s apart, in order."""
    return [replace(r, id=f"{name}-{i}", arrival_s=0.5 * (i + 1)) for i, r in enumerate(requests)]


def drift_traces(nq: list[TraceRequest], mmlu: list[TraceRequest]) -> dict[str, list[TraceRequest]]:
    third = len(nq) // 3
    parts = [nq[:third], nq[third : 2 * third], nq[2 * third :]]
    return {
        "drift_nq_mmlu": respaced("drift_nq_mmlu", nq + mmlu),
        "drift_nq3": respaced(
            "drift_nq3", [r for i, part in enumerate(parts) for r in renamed(part, i)]
        ),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("traces", type=Path, help="build_sim_traces.py's --out directory")
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()
    nq = load_trace(args.traces / "nq_top2.jsonl")
    mmlu = load_trace(args.traces / "mmlu_top2.jsonl")
    args.out.mkdir(parents=True, exist_ok=True)
    for name, requests in drift_traces(nq, mmlu).items():
        write_trace(args.out / f"{name}.jsonl", requests)
        print(f"{name}: {len(requests)} requests -> {args.out / f'{name}.jsonl'}")


if __name__ == "__main__":
    main()
