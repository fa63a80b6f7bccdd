"""`ragcache search-stats`: how a staged search behaves on a request stream (speculation chance)."""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any


def register(subparsers: Any) -> None:
    parser = subparsers.add_parser(
        "search-stats",
        help="per-stage search time, recall, first stage with the final top-k, popularity skew",
        description=(
            "Search each question alone, stage by stage, and report the mean time of each stage "
            "and in all, the recall of each stage's top-k against the final one, how many "
            "questions had their final top-k at each stage (the speculation chance) and the "
            "share of retrievals going to the top 1/5/10%% of documents."
        ),
    )
    parser.add_argument("--index", type=Path, required=True, metavar="DIR")
    parser.add_argument("--questions", type=Path, required=True, metavar="JSONL")
    parser.add_argument("--question-field", default="question,input,text", help="%(default)s")
    parser.add_argument("--top-k", type=int, default=2, help="(%(default)s)")
    parser.add_argument("--limit", type=int, default=None, help="use the first N questions")
    parser.add_argument("--nprobe", type=int, default=None, help="IVF: override the index's")
    parser.add_argument("--lists-per-stage", type=int, default=None, help="IVF: override")
    parser.add_argument("--ef-search", type=int, default=None, help="HNSW: override")
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    parser.set_defaults(func=_run)


def _run(args: argparse.Namespace) -> int:
    from ragcache_core.retrieval.corpus import load_questions
    from ragcache_core.retrieval.index_store import LocalIndex
    from ragcache_core.retrieval.ivf import ListsPerStage
    from ragcache_core.retrieval.stats import record_queries, summarize

    index = LocalIndex.load(args.index)
    questions = load_questions(
        args.questions, question_fields=args.question_field, limit=args.limit
    )
    sizing = ListsPerStage(args.lists_per_stage) if args.lists_per_stage else None
    staged = index.staged(nprobe=args.nprobe, sizing=sizing, ef_search=args.ef_search)
    vectors = index.embedder.embed([q.text for q in questions])  # [n, d]
    index.embedder.embed_query("warm-up")  # first-call costs stay out of the timings
    records = record_queries(staged, vectors, args.top_k)
    stats = summarize(
        records, args.top_k, len(index.documents), higher_is_better=staged.metric.higher_is_better
    )
    if args.json:
        print(json.dumps(stats.to_json()))
        return 0
    print(f"{stats.queries} questions, top-{stats.k}, {index.settings.kind} index")
    print(
        f"search time: mean {stats.total_time_mean_s * 1e3:.3f} ms, p50 "
        f"{stats.total_time_p50_s * 1e3:.3f} ms, p99 {stats.total_time_p99_s * 1e3:.3f} ms"
    )
    print("stage  mean_ms  recall@final  first_final(order)  first_final(set)")
    for i in range(stats.stages_max):
        print(
            f"{i:5d}  {stats.stage_time_mean_s[i] * 1e3:7.3f}  {stats.recall_at_stage[i]:12.3f}"
            f"  {stats.first_final_stage[i]:18d}  {stats.first_final_set_stage[i]:16d}"
        )
    print(
        f"final top-k before the last stage: {stats.final_before_last_share:.1%}; "
        f"search time after it appeared: {stats.hideable_time_share:.1%}; "
        f"monotonicity violations: {stats.monotone_violations}"
    )
    skew = ", ".join(f"{name} {share:.1%}" for name, share in stats.skew.items())
    print(f"skew (share of retrievals): {skew}; distinct documents {stats.distinct_docs}")
    return 0
