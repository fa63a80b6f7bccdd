"""Build the long-chunk demo sample shipped in ragcache_core/data/ from the benchmark
data (--data-dir, default ../shared/data).

Three SQuAD v1.1 dev articles (Wikipedia), whole: their paragraphs joined into ~1,024-token
chunks of the bench model's tokenizer (`bench.workloads.chunk_articles`), and a seeded 22% of
each article's SQuAD dev questions, so that articles with more questions stay more popular (the
skew of the real question set, not an invented one).

    .venv/bin/python scripts/build_demo_long.py

Writes demo_long_corpus.jsonl and demo_long_questions.jsonl (CC BY-SA 4.0, see ATTRIBUTION.md).
"""

from __future__ import annotations

import argparse
import json
import random
from pathlib import Path

from ragcache_core.bench.data_dir import (
    DATA_HELP,
    SQUAD_PARAGRAPHS,
    SQUAD_QUESTIONS,
    script_data_dir,
)
from ragcache_core.bench.workloads import chunk_articles, read_jsonl
from ragcache_core.models import build_tiny_model
from ragcache_core.retrieval.trace import tokenizer_counter

ARTICLES = ("Super_Bowl_50", "Nikola_Tesla", "Martin_Luther")
OUT = Path(__file__).resolve().parents[1] / "ragcache_core" / "data"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--share", type=float, default=0.22, help="questions kept per article")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--data-dir",
        type=Path,
        default=None,
        help=DATA_HELP,
    )
    args = parser.parse_args()
    data = script_data_dir(args.data_dir, (SQUAD_PARAGRAPHS, SQUAD_QUESTIONS))
    count = tokenizer_counter(str(build_tiny_model(size="bench")))
    paragraphs = [p for p in read_jsonl(data / SQUAD_PARAGRAPHS) if p["title"] in ARTICLES]
    chunks = chunk_articles(paragraphs, count)
    rng = random.Random(args.seed)
    questions = []
    for title in ARTICLES:
        mine = [q for q in read_jsonl(data / SQUAD_QUESTIONS) if q["title"] == title]
        questions += rng.sample(mine, round(args.share * len(mine)))
    with (OUT / "demo_long_corpus.jsonl").open("w", encoding="utf-8") as out:
        for c in chunks:
            out.write(json.dumps(c, ensure_ascii=False) + "\n")
    with (OUT / "demo_long_questions.jsonl").open("w", encoding="utf-8") as out:
        for q in questions:
            record = {k: q[k] for k in ("id", "question", "answers", "title", "paragraph_id")}
            out.write(json.dumps(record, ensure_ascii=False) + "\n")
    print(f"{len(chunks)} chunks, {len(questions)} questions -> {OUT}")


if __name__ == "__main__":
    main()
