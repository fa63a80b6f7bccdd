"""Build a long-document RAG workload from the benchmark data (--data-dir; derived, not committed).

Documents: consecutive SQuAD v1.1 dev paragraphs of one article joined in groups of `--join`
(real RAG chunks are often 512-1,024 tokens; the SQuAD paragraphs average ~160). Questions:
SQuAD dev questions (real user-style questions about those articles), sampled with a seed.

    .venv/bin/python scripts/build_long_docs.py --out /tmp/longdocs --join 4 --questions 400
    ragcache demo --corpus /tmp/longdocs/corpus.jsonl --questions /tmp/longdocs/questions.jsonl

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
            for start in range(0, len(paragraphs), args.join):
                group = paragraphs[start : start + args.join]
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


if __name__ == "__main__":
    main()
