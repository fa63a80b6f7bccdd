"""What finding known documents in a plain request costs `ragcache serve`, against prompt size.

A plain chat request (no `documents` field) with k documents of the shipped samples pasted in
its user message ("Context:\\n\\n" + documents joined by blank lines + the question), the
server knowing the whole shipped corpus (and, in the second setting, 50,000 more synthetic
documents). Per request, side by side in one run, each point repeated 3 times with the order
of the two measurements alternated:

- `find ms`: `KnownDocuments.find` over every message (what the found path adds);
- `chat ms`: rendering the chat template and tokenizing it (`PromptRenderer.chat`: what the
  server does for every plain request anyway);
- `ids equal`: prompts whose found-path ids equal the uncached ids (what `vllm serve` makes of
  the same messages); by construction all of them.

Usage: python scripts/found_documents_cost.py [--rounds 3] [--json OUT]
Model: the offline tiny model's tokenizer and chat template (`ragcache_core.models`).
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import time
from importlib import resources
from pathlib import Path
from typing import Any

from ragcache_core.config import CacheConfig
from ragcache_core.documents import Document
from ragcache_core.models import build_tiny_model
from ragcache_core.retrieval.corpus import load_corpus
from ragcache_core.serve.jobs import CachedJob, PromptRenderer, chat_job
from ragcache_core.serve.known import KnownDocuments
from ragcache_core.serve.schemas import ChatRequest

SIZES = (1, 2, 4, 8, 16)
PROMPTS_PER_POINT = 20


def _corpus() -> list[Document]:
    data = Path(str(resources.files("ragcache_core") / "data"))
    return list(load_corpus([data / "demo_corpus.jsonl", data / "demo_long_corpus.jsonl"]))


def _synthetic(count: int, rng: random.Random) -> list[Document]:
    words = ["river", "city", "empire", "music", "league", "island", "treaty", "film"]
    return [
        Document(f"syn-{i}", " ".join(rng.choice(words) for _ in range(40)) + f" ({i})")
        for i in range(count)
    ]


def _request(docs: list[Document]) -> ChatRequest:
    context = "\n\n".join(d.text for d in docs)
    content = f"Context:\n\n{context}\n\nQuestion: what is this about?"
    return ChatRequest.model_validate(
        {
            "messages": [
                {"role": "system", "content": "Answer from the context."},
                {"role": "user", "content": content},
            ]
        }
    )


def _time(work: Any) -> float:
    started = time.perf_counter()
    work()
    return (time.perf_counter() - started) * 1000


def measure(rounds: int, extra: int) -> list[dict[str, Any]]:
    from transformers import AutoTokenizer

    model = build_tiny_model(size="tiny", attention="mha")
    tokenizer = AutoTokenizer.from_pretrained(model)
    corpus = _corpus()
    rng = random.Random(0)
    known = KnownDocuments()
    known.add_index(corpus)
    known.add_index(_synthetic(extra, rng))
    renderer = PromptRenderer(tokenizer, CacheConfig().prompt, str(model), "float32", known=known)
    rows = []
    for k in SIZES:
        requests = [_request(rng.sample(corpus, k)) for _ in range(PROMPTS_PER_POINT)]
        finds: list[list[float]] = [[] for _ in range(rounds)]
        chats: list[list[float]] = [[] for _ in range(rounds)]
        equal, tokens = 0, []
        for request in requests:
            messages = [{"role": m.role, "content": str(m.content)} for m in request.messages]
            job = chat_job(request, renderer)
            plain = renderer.chat(messages)
            equal += isinstance(job, CachedJob) and list(job.prompt_ids) == plain
            tokens.append(len(plain))
            for r in range(rounds):
                texts = [str(m["content"]) for m in messages]

                def find(texts: list[str] = texts) -> None:
                    for text in texts:
                        known.find(text, None)

                def chat(messages: list[dict[str, str]] = messages) -> None:
                    renderer.chat(messages)

                order = (find, chat) if r % 2 == 0 else (chat, find)
                for work in order:
                    (finds if work is find else chats)[r].append(_time(work))
        find_ms = [statistics.median(f) for f in finds]
        chat_ms = [statistics.median(c) for c in chats]
        rows.append(
            {
                "docs": k,
                "known": len(known),
                "prompt_tokens": int(statistics.median(tokens)),
                "find_ms": _spread(find_ms),
                "chat_ms": _spread(chat_ms),
                "ratio": _spread([f / c for f, c in zip(find_ms, chat_ms, strict=True)]),
                "ids_equal": f"{equal}/{len(requests)}",
            }
        )
    return rows


def _spread(values: list[float]) -> tuple[float, float, float]:
    ordered = sorted(values)
    return ordered[0], statistics.median(ordered), ordered[-1]


def _fmt(spread: tuple[float, float, float], digits: int = 2) -> str:
    low, mid, high = spread
    return f"{mid:.{digits}f} ({low:.{digits}f}..{high:.{digits}f})"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    results = []
    for extra in (0, 50_000):
        results.extend(measure(args.rounds, extra))
    print("docs  known   tokens  find ms (min..max)   chat ms (min..max)   find/chat   ids equal")
    for row in results:
        print(
            f"{row['docs']:>4}  {row['known']:>6}  {row['prompt_tokens']:>6}  "
            f"{_fmt(row['find_ms'], 3):>19}  {_fmt(row['chat_ms']):>19}  "
            f"{_fmt(row['ratio'], 3):>10}  {row['ids_equal']:>9}"
        )
    if args.json:
        args.json.write_text(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
