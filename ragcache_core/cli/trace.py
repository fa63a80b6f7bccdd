"""`ragcache trace`: retrieve questions against an index and write a request trace (JSONL)."""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any


def register(subparsers: Any) -> None:
    parser = subparsers.add_parser(
        "trace",
        help="build a request trace: top-k documents, token counts, Poisson arrivals",
        description=(
            "Search every question's final top-k in the index and write one JSON per line: "
            '{"id", "arrival_s", "docs", "doc_tokens", "question_tokens"}. Token counts come '
            "from the model's tokenizer (documents as the prompt wraps them); arrivals are a "
            "seeded Poisson process at --rate requests per second."
        ),
    )
    parser.add_argument("--index", type=Path, required=True, metavar="DIR")
    parser.add_argument("--questions", type=Path, required=True, metavar="JSONL")
    parser.add_argument("--question-field", default="question,input,text", help="%(default)s")
    parser.add_argument("--top-k", type=int, required=True)
    parser.add_argument("--model", required=True, help="model folder (or name) for its tokenizer")
    parser.add_argument("--rate", type=float, required=True, help="requests per second")
    parser.add_argument("--out", type=Path, required=True, metavar="JSONL")
    parser.add_argument("--seed", type=int, default=0, help="arrival seed (%(default)s)")
    parser.add_argument("--limit", type=int, default=None, help="use the first N questions")
    parser.set_defaults(func=_run)


def _run(args: argparse.Namespace) -> int:
    from ragcache_core.retrieval.corpus import load_questions
    from ragcache_core.retrieval.index_store import LocalIndex
    from ragcache_core.retrieval.trace import build_trace, tokenizer_counter
    from ragcache_core.trace import write_trace

    index = LocalIndex.load(args.index)
    questions = load_questions(
        args.questions, question_fields=args.question_field, limit=args.limit
    )
    count = tokenizer_counter(args.model)
    records = build_trace(index, questions, args.top_k, count, rate=args.rate, seed=args.seed)
    write_trace(args.out, records)
    span = records[-1].arrival_s if records else 0.0
    print(f"wrote {len(records)} requests over {span:.1f} s (top-{args.top_k}) -> {args.out}")
    return 0
