"""Build a long-document RAG workload from the benchmark data (--data-dir; derived, not committed).

Documents: consecutive SQuAD v1.1 dev paragraphs of one article joined in groups of `--join`
(real RAG chunks are often 512-1,024 tokens; the SQuAD paragraphs average ~160), or, with
`--words W`, as many consecutive paragraphs as fit in W words (a longer paragraph stands
alone), so no document outgrows a model's context. Questions: SQuAD dev questions (real
user-style questions about those articles), sampled with a seed.

    .venv/bin/python scripts/build_long_docs.py --out /tmp/longdocs --join 4 --questions 400
    ragcache demo --corpus /tmp/longdocs/corpus.jsonl --questions /tmp/longdocs/questions.jsonl

The long-document stream of the host-tier issue (docs/benchmarks.md, "Copies at hand-out"):
`--words 1600` gives 187 documents of 2,706 tokens on average (104-3,572) with the bench
model's tokenizer, none over its 4,096-token context.

Wikipedia text, CC BY-SA 4.0 (SQuAD v1.1, Rajpurkar et al.).
"""

from __future__ import annotations

import argparse
import json
import random
from collections import defaultdict
from pathlib import Path

from ragcache_core.bench.data_dir import (
    DATA_HELP,
    SQUAD_PARAGRAPHS,
    SQUAD_QUESTIONS,
    script_data_dir,
)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--join", type=int, default=4, help="paragraphs per document")
    parser.add_argument(
        "--words",
        type=int,
        default=None,
        help="instead of --join: as many consecutive paragraphs as fit in this many words",
    )
    parser.add_argument("--questions", type=int, default=400)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--data-dir",
        type=Path,
        default=None,
        help=DATA_HELP,
    )
    args = parser.parse_args()
    data = script_data_dir(args.data_dir, (SQUAD_PARAGRAPHS, SQUAD_QUESTIONS))
    articles: dict[str, list[dict[str, object]]] = defaultdict(list)
    with (data / SQUAD_PARAGRAPHS).open(encoding="utf-8") as f:
        for line in f:
            record = json.loads(line)
            articles[str(record["title"])].append(record)
    args.out.mkdir(parents=True, exist_ok=True)
    documents = 0
    with (args.out / "corpus.jsonl").open("w", encoding="utf-8") as out:
        for title, paragraphs in articles.items():
            paragraphs.sort(key=lambda r: int(r["paragraph_index"]))  # type: ignore[call-overload]
            for start, group in _groups(paragraphs, args.join, args.words):
                text = "\n".join(str(p["context"]) for p in group)
                doc = {
                    "doc_id": f"{title}::{start}",
                    "title": title.replace("_", " "),
                    "text": text,
                }
                out.write(json.dumps(doc, ensure_ascii=False) + "\n")
                documents += 1
    with (data / SQUAD_QUESTIONS).open(encoding="utf-8") as f:
        questions = [json.loads(line) for line in f]
    random.Random(args.seed).shuffle(questions)
    with (args.out / "questions.jsonl").open("w", encoding="utf-8") as out:
        for q in questions[: args.questions]:
            out.write(json.dumps({"id": q["id"], "question": q["question"]}) + "\n")
    print(f"{documents} documents, {min(args.questions, len(questions))} questions -> {args.out}")


def _groups(
    paragraphs: list[dict[str, object]], join: int, words: int | None
) -> list[tuple[int, list[dict[str, object]]]]:
    """(index of the first paragraph, the paragraphs) of each document of one article."""
    if words is None:
        return [(i, paragraphs[i : i + join]) for i in range(0, len(paragraphs), join)]
    groups: list[tuple[int, list[dict[str, object]]]] = []
    start, group, count = 0, [], 0
    for index, paragraph in enumerate(paragraphs):
        size = len(str(paragraph["context"]).split())
        if group and count + size > words:
            groups.append((start, group))
            start, group, count = index, [], 0
        group.append(paragraph)
        count += size
    if group:
        groups.append((start, group))
    return groups


if __name__ == "__main__":
    main()
