"""The reuse ceiling of a `ragcache bench serve` point: of its measured requests (after the
warm-up), how many retrieve a chunk an earlier request of the same point retrieved. No cache
can hit more than that within the point (each point starts with empty caches).

    .venv/bin/python scripts/reuse_ceiling.py [--data-dir DIR] WARMUP MEASURED WORKLOAD [...]
    .venv/bin/python scripts/reuse_ceiling.py 80 24 long-shuffled long     # the full mode's points

(`--data-dir`: the benchmark data folder; default `$RAGCACHE_DATA_DIR`, else ../shared/data.)

Uses the bench model's tokenizer, the workload's own top-k and the offline TF-IDF retriever,
as `bench serve` does by default (seed 0).
"""

from __future__ import annotations

import sys
from pathlib import Path

from ragcache_core.bench.data_dir import script_data_dir
from ragcache_core.bench.workloads import index_source, load_workload, workload_files
from ragcache_core.models import build_tiny_model
from ragcache_core.retrieval.trace import tokenizer_counter
from ragcache_core.search import final_result


def main(argv: list[str]) -> int:
    data_dir = None
    if argv[:1] == ["--data-dir"] and len(argv) > 1:
        data_dir, argv = Path(argv[1]), argv[2:]
    if len(argv) < 3:
        print(__doc__, file=sys.stderr)
        return 2
    warmup, measured = int(argv[0]), int(argv[1])
    script_data_dir(data_dir, sorted({f for name in argv[2:] for f in workload_files(name)}))
    model = build_tiny_model(size="bench")
    for name in argv[2:]:
        workload = load_workload(
            name, tokenizer_counter(str(model)), seed=0, top_k=None, data_dir=data_dir
        )
        workload, source = index_source(workload, "tfidf")
        seen: set[str] = set()
        repeats = 0
        for position, request in enumerate(workload.stream(warmup + measured)):
            if request.documents is not None:
                ids = [d.id for d in request.documents]
            else:
                assert source is not None
                found = final_result(source, request.question, workload.top_k)
                ids = [d.id for d in found.documents]
            if position >= warmup and ids[0] in seen:
                repeats += 1
            seen.update(ids)
        print(
            f"{name}: {repeats} of the {measured} measured requests (after {warmup}) retrieve "
            f"a first chunk seen before in the point ({repeats / measured:.0%}); "
            f"{len(seen)} distinct chunks in all {warmup + measured}"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
