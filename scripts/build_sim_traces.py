"""Build simulator traces from the benchmark data (--data-dir) with a TF-IDF retriever (no model).

Corpus: the 12,100 documents (10,033 vital-article leads + 2,067 SQuAD dev paragraphs), each
wrapped as "Title: {title}\\n{text}\\n\\n" as the prompt renders it. Request streams: NQ-open
dev (3,610 questions) and MMLU val (1,531; the question part of the zero-shot prompt), and on
request (`--streams squad`) SQuAD v1.1 dev (10,570 questions, the question text, in the
file's order: grouped by paragraph).
Retriever: scikit-learn TF-IDF (English stop words, sublinear tf, unigrams+bigrams, min_df 2)
with cosine similarity; documents in prompt order = descending score. Token counts: an
estimate, ceil(1.3 x whitespace words), for documents and questions alike. Arrivals: seeded
Poisson at --rate requests/s, in dataset order.

    .venv/bin/python scripts/build_sim_traces.py --out /tmp/ragcache-traces
"""

from __future__ import annotations

import argparse
import json
import math
from pathlib import Path

import numpy as np
from sklearn.feature_extraction.text import TfidfVectorizer

from ragcache_core.bench.data_dir import DATA_HELP, SQUAD_QUESTIONS, script_data_dir


def estimate_tokens(text: str) -> int:
    return math.ceil(1.3 * len(text.split()))


def load_corpus(data: Path) -> tuple[list[str], list[str]]:
    ids, texts = [], []
    with (data / "vital_articles_en_corpus.jsonl").open(encoding="utf-8") as f:
        for line in f:
            r = json.loads(line)
            ids.append(f"va:{r['doc_id']}")
            texts.append(f"Title: {r['title']}\n{r['text']}\n\n")
    with (data / "squad_v1.1_dev_paragraphs.jsonl").open(encoding="utf-8") as f:
        for line in f:
            r = json.loads(line)
            ids.append(f"sq:{r['paragraph_id']}")
            texts.append(f"Title: {r['title'].replace('_', ' ')}\n{r['context']}\n\n")
    return ids, texts


def load_questions(data: Path, stream: str) -> list[str]:
    if stream == "squad":
        with (data / SQUAD_QUESTIONS).open(encoding="utf-8") as f:
            return [json.loads(line)["question"] for line in f]
    if stream == "nq":
        with (data / "NQ-open.dev.jsonl").open(encoding="utf-8") as f:
            return [json.loads(line)["question"] for line in f]
    out = []
    with (data / "mmlu_val.jsonl").open(encoding="utf-8") as f:
        for line in f:
            prompt = json.loads(line)["input"]
            # Drop the "The following are multiple choice questions ..." header paragraph.
            out.append(prompt.split("\n\n", 1)[-1])
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--data-dir",
        "--data",
        dest="data",
        type=Path,
        default=None,
        help=DATA_HELP,
    )
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--top-k", type=int, nargs="+", default=[2, 3])
    parser.add_argument("--rate", type=float, default=1.0)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--streams", nargs="+", choices=("nq", "mmlu", "squad"), default=["nq", "mmlu"]
    )
    args = parser.parse_args()
    args.data = script_data_dir(args.data)
    args.out.mkdir(parents=True, exist_ok=True)

    ids, texts = load_corpus(args.data)
    doc_tokens = [estimate_tokens(t) for t in texts]
    vectorizer = TfidfVectorizer(
        stop_words="english", sublinear_tf=True, ngram_range=(1, 2), min_df=2
    )
    docs = vectorizer.fit_transform(texts)  # [12100, V], rows L2-normalised
    kmax = max(args.top_k)
    for stream in args.streams:
        questions = load_questions(args.data, stream)
        queries = vectorizer.transform(questions)  # [n, V]
        top = np.zeros((len(questions), kmax), dtype=np.int64)
        for start in range(0, len(questions), 512):
            scores = (queries[start : start + 512] @ docs.T).toarray()  # [<=512, 12100]
            best = np.argpartition(-scores, kmax, axis=1)[:, :kmax]
            order = np.argsort(-np.take_along_axis(scores, best, axis=1), axis=1, kind="stable")
            top[start : start + 512] = np.take_along_axis(best, order, axis=1)
        rng = np.random.default_rng(args.seed)
        arrivals = np.cumsum(rng.exponential(1.0 / args.rate, size=len(questions)))
        for k in args.top_k:
            path = args.out / f"{stream}_top{k}.jsonl"
            with path.open("w", encoding="utf-8") as out:
                for i, question in enumerate(questions):
                    picked = [int(j) for j in top[i, :k]]
                    record = {
                        "id": f"{stream}-{i}",
                        "arrival_s": round(float(arrivals[i]), 6),
                        "docs": [ids[j] for j in picked],
                        "doc_tokens": [doc_tokens[j] for j in picked],
                        "question_tokens": estimate_tokens(question),
                    }
                    out.write(json.dumps(record) + "\n")
            print(f"wrote {path} ({len(questions)} requests)")


if __name__ == "__main__":
    main()
