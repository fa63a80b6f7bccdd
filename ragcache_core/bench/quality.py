"""`ragcache bench quality`: how well each system answers real questions, with intervals.

    stream (bench/quality_streams.py): N sampled questions, their gold answers, 3 documents each
          ▼  every system, one engine at a time (`sweep.Engines`, `serve.start_system`):
    vllm               plain vLLM, prefix caching off: the reference
    ragcache           RAGCache; its answers must be vllm's, token for token
    ragcache-docorder  RAGCache, document_order="cache": the model may read another order
          ▼  the replies decoded, scored against the gold answers (bench/scoring.py)
    EM, F1, contains per system, each with a 95% interval; agreement with vllm's replies;
    for the RAGCache systems the paired difference against vllm (bench/intervals.py)

Every system reads the same prompt token ids for a question in retrieval order: the short-answer
prompt (`QUALITY_PROMPT`, a system message through the model's chat template: the cache's
default `AppPrompt` layout) and greedy decoding up to `max_tokens`, stopping at the model's end
of turn.

**Warm caches.** A deployed cache has seen the documents it serves. The RAGCache systems take
the stream in windows of `WINDOW` questions: each window is sent once unmeasured (stopped at its
first token: `WARM_SAMPLING`), then again measured, so every measured request's documents were
served a window ago (hits: a window's documents fit the default host tier three times over; the
whole stream would not). `ragcache-docorder` serves a request out of retrieval order when the
documents it retrieved are cached in another order: on the warm pass when earlier requests
cached them so, on the measured pass as the warm pass served it; the count of reordered answers
is reported with it. vllm answers the measured pass only (no cache to warm). Requests go
`CONCURRENCY` at a time (a closed loop), in stream order.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, TextIO

from ragcache_core.bench.intervals import (
    BOOTSTRAP_RESAMPLES,
    mean_interval,
    paired_difference,
    wilson,
)
from ragcache_core.bench.quality_streams import TOP_K, QualityStream
from ragcache_core.bench.scoring import SCORES, normalize, retrieval_recall, score_reply
from ragcache_core.bench.serve import Outcome, ServedSystem, closed_loop
from ragcache_core.bench.sweep import Engines, describe_systems, git_commit, now_utc, reorders
from ragcache_core.bench.systems import QUALITY_SYSTEMS, SYSTEMS
from ragcache_core.bench.workloads import Request
from ragcache_core.config import CacheConfig, PromptConfig, SamplingConfig

SCHEMA = "ragcache-bench-quality/1"
REFERENCE = "vllm"
SHORT_ANSWER = "Answer the question using the context. Reply with a short answer only."
QUALITY_PROMPT = PromptConfig(system_prompt=SHORT_ANSWER)
"""The system message above; the documents and "Question: ...\\nAnswer:" in the user turn."""
WINDOW = 50
"""Questions per warm-up window: at most 150 documents, about 21k tokens of SmolLM2's
tokenizer, a third of the default host tier."""
CONCURRENCY = 4
WARM_SAMPLING = SamplingConfig(max_tokens=1, temperature=0.0)
"""A warm-up request stops at its first token: its prefill caches the documents, its answer
is not read (32 tokens each would double a RAGCache system's time for nothing)."""
FIGURES = tuple(SCORES)
"""The per-reply figures (exact_match, f1, contains), in table order."""


@dataclass(frozen=True)
class QualitySettings:
    """What one run measures (the command line's options)."""

    stream: str
    questions: int
    seed: int = 0
    max_tokens: int = 32
    systems: tuple[str, ...] = QUALITY_SYSTEMS
    vllm_kv_gib: float = 0.25
    host_pool_tokens: int = 65536
    resamples: int = BOOTSTRAP_RESAMPLES

    def cache_config(self) -> CacheConfig:
        """What every system shares: the prompt, greedy sampling and the memory (RAGCache's
        pools size the baselines')."""
        return CacheConfig(
            prompt=QUALITY_PROMPT,
            sampling=SamplingConfig(max_tokens=self.max_tokens, temperature=0.0),
            host_pool_tokens=self.host_pool_tokens,
            vllm_kv_cache_gib=self.vllm_kv_gib,
        )


@dataclass(frozen=True)
class SystemRun:
    """One system's measured answers, one per question of the stream, in stream order."""

    name: str
    outcomes: tuple[Outcome, ...]
    replies: tuple[str, ...]
    wall_s: float
    own_prompts: tuple[int, int] | None = None
    """A reordering system: (answers equal to plain vLLM's on its own ordered prompt,
    answers checked) (`serve.same_as_plain_vllm`)."""


Progress = Callable[[str, int], Callable[[int], None]]
"""(label, total) -> a callback given the requests done (a tqdm bar in the CLI)."""


def answer_stream(
    engines: Engines,
    name: str,
    stream: QualityStream,
    decode: Callable[[Sequence[int]], str],
    progress: Progress,
    reference: SystemRun | None = None,
) -> SystemRun:
    """Start system `name`, answer the stream (warm windows first for RAGCache's systems: the
    module doc), check a reordering system against plain vLLM on its own prompts, stop it.
    With `reference` (vllm's run: plain vLLM, prefix caching off, the same prompt ids in
    retrieval order), its answers stand for plain vLLM's on the prompts a reordering system
    kept in retrieval order, so only the reordered prompts are generated again."""
    engines.start([name], None)
    system = engines.systems[name]
    warm = SYSTEMS[name].kind == "ragcache"
    requests = stream.requests()
    bar = progress(name, len(requests) * (2 if warm else 1))
    started = time.perf_counter()
    outcomes = engines.run(serve_windows(system, requests, warm, bar))
    wall = time.perf_counter() - started
    own = None
    if reorders(name):
        from ragcache_core.bench.serve import RAGCacheSystem, same_as_plain_vllm

        assert isinstance(system, RAGCacheSystem)
        build = system.cache.prompts.build
        answered = zip(requests, reference.outcomes, strict=True) if reference else ()
        known = {  # same_as_plain_vllm's memo of plain answers, by prompt ids
            tuple(build(r.question, r.documents).token_ids): o.token_ids
            for r, o in answered
            if r.documents is not None  # a quality stream's requests bring theirs
        }
        own = engines.run(same_as_plain_vllm(system.cache, requests, outcomes, known))
    engines.stop([name])
    replies = tuple(decode(o.token_ids) for o in outcomes)
    print(f"{name}: {len(outcomes)} answers in {wall:.0f} s", file=engines.log, flush=True)
    return SystemRun(name, tuple(outcomes), replies, wall, own)


async def serve_windows(
    system: ServedSystem,
    requests: Sequence[Request],
    warm: bool,
    progress: Callable[[int], None],
    window: int = WINDOW,
    concurrency: int = CONCURRENCY,
) -> list[Outcome]:
    """The measured outcome of every request, in order, from an emptied cache; with `warm`
    each window of `window` requests is sent once unmeasured (`WARM_SAMPLING`: one token)
    before it is measured."""
    await system.reset()
    measured: dict[int, Outcome] = {}
    done = 0

    async def warm_one(i: int) -> None:
        nonlocal done
        await system.serve(requests[i], f"{system.name}-warm-{i}", WARM_SAMPLING)
        done += 1
        progress(done)

    async def measure_one(i: int) -> None:
        nonlocal done
        measured[i] = await system.serve(requests[i], f"{system.name}-q-{i}")
        done += 1
        progress(done)

    for start in range(0, len(requests), window):
        indices = range(start, min(start + window, len(requests)))
        if warm:
            await closed_loop(warm_one, indices, concurrency)
        await closed_loop(measure_one, indices, concurrency)
    return [measured[i] for i in range(len(requests))]


# --------------------------------------------------------------------------- figures


def question_scores(stream: QualityStream, replies: Sequence[str]) -> dict[str, list[float]]:
    """Each figure of `FIGURES` per question (the best over its gold answers)."""
    scores: dict[str, list[float]] = {name: [] for name in FIGURES}
    for item, reply in zip(stream.items, replies, strict=True):
        for name, value in score_reply(reply, item.answers).items():
            scores[name].append(value)
    return scores


def recalls(stream: QualityStream) -> list[float]:
    """Per question: 1 when a gold answer is in its documents (`scoring.retrieval_recall`)."""
    return [retrieval_recall([d.text for d in i.documents], i.answers) for i in stream.items]


def summarize(
    stream: QualityStream,
    runs: dict[str, SystemRun],
    settings: QualitySettings,
    meta: dict[str, Any],
) -> dict[str, Any]:
    """The JSON document: settings, the stream, each system's figures with intervals (and
    for each system but the reference: agreement with it, identical answers, the paired
    differences), and every question with every reply."""
    seed, resamples = settings.seed, settings.resamples
    scores = {name: question_scores(stream, run.replies) for name, run in runs.items()}
    reference = runs.get(REFERENCE)
    systems: dict[str, Any] = {}
    for name, run in runs.items():
        entry: dict[str, Any] = {"what": SYSTEMS[name].what, "wall_s": run.wall_s}
        for figure in FIGURES:
            entry[figure] = mean_interval(scores[name][figure], resamples, seed).to_json()
        if reference is not None and name != REFERENCE:
            entry |= _against(run, reference, scores[name], scores[REFERENCE], settings)
        if SYSTEMS[name].kind == "ragcache":
            entry["hits"] = _hits(run.outcomes)
        if run.own_prompts is not None:
            same, checked = run.own_prompts
            entry["same_as_plain_vllm_on_own_prompts"] = {"count": same, "of": checked}
        systems[name] = entry
    return {
        "schema": SCHEMA,
        "settings": meta,
        "stream": {
            "name": stream.name,
            "description": stream.description,
            "questions": len(stream.items),
            "seed": stream.seed,
            "top_k": TOP_K,
            "retriever": stream.retriever,
            "gold_in_retriever_top3": stream.gold_in_top3,
            "retrieval_recall": mean_interval(recalls(stream), resamples, seed).to_json(),
        },
        "systems": systems,
        "questions": _questions(stream, runs),
    }


def _against(
    run: SystemRun,
    reference: SystemRun,
    scores: dict[str, list[float]],
    reference_scores: dict[str, list[float]],
    settings: QualitySettings,
) -> dict[str, Any]:
    """A system against the reference on the same questions: its replies' agreement (equal
    once normalized), its identical answers (token ids), the paired differences of every
    figure, and for a reordering system the same differences on its reordered questions."""
    pairs = list(zip(run.outcomes, reference.outcomes, strict=True))
    agree = [
        float(normalize(a) == normalize(b))
        for a, b in zip(run.replies, reference.replies, strict=True)
    ]
    out: dict[str, Any] = {
        "agreement_with_vllm": wilson(agree).to_json(),
        "identical_to_vllm": {
            "count": sum(a.token_ids == b.token_ids for a, b in pairs),
            "of": len(pairs),
        },
        "difference_vs_vllm": _differences(scores, reference_scores, None, settings),
    }
    if reorders(run.name):
        moved = [i for i, o in enumerate(run.outcomes) if o.reordered]
        out["reordered"] = len(moved)
        out["difference_vs_vllm_reordered"] = (
            _differences(scores, reference_scores, moved, settings) if moved else None
        )
    return out


def _differences(
    scores: dict[str, list[float]],
    reference: dict[str, list[float]],
    only: Sequence[int] | None,
    settings: QualitySettings,
) -> dict[str, Any]:
    def pick(values: list[float]) -> list[float]:
        return values if only is None else [values[i] for i in only]

    return {
        figure: paired_difference(
            pick(scores[figure]), pick(reference[figure]), settings.resamples, settings.seed
        ).to_json()
        for figure in FIGURES
    }


def _hits(outcomes: Sequence[Outcome]) -> dict[str, float]:
    """The measured pass's document and token hit rates (what the warm windows bought)."""
    docs = max(1, sum(o.docs for o in outcomes))
    return {
        "doc_hit_rate": sum(o.gpu_docs + o.host_docs for o in outcomes) / docs,
        "token_hit_rate": sum(o.cached_tokens for o in outcomes)
        / max(1, sum(o.prompt_tokens for o in outcomes)),
    }


def _questions(stream: QualityStream, runs: dict[str, SystemRun]) -> list[dict[str, Any]]:
    rows = []
    for i, item in enumerate(stream.items):
        row: dict[str, Any] = {
            "id": item.id,
            "question": item.question,
            "answers": list(item.answers),
            "documents": [d.id for d in item.documents],
            "gold_position": item.gold_position,
            "replies": {name: run.replies[i] for name, run in runs.items()},
        }
        moved = {n: list(r.outcomes[i].retrieval_ranks) for n, r in runs.items() if reorders(n)}
        if any(ranks != sorted(ranks) for ranks in moved.values()):
            row["served_order"] = moved
        rows.append(row)
    return rows


# --------------------------------------------------------------------------- the run


def run_quality(
    model: Path,
    stream: QualityStream,
    settings: QualitySettings,
    progress: Progress,
    log: TextIO,
) -> dict[str, Any]:
    """Answer `stream` with every system of `settings` (one engine at a time, the reference
    first) and return `summarize`'s document."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(model))

    def decode(ids: Sequence[int]) -> str:
        return str(tokenizer.decode(list(ids), skip_special_tokens=True)).strip()

    started = time.perf_counter()
    meta = {
        "model": str(model),
        "stream": stream.name,
        "questions": len(stream.items),
        "seed": settings.seed,
        "git_commit": git_commit(),
        "started_utc": now_utc(),
        "max_tokens": settings.max_tokens,
        "sampling": "greedy, stops at the model's end of turn or max_tokens",
        "system_prompt": SHORT_ANSWER,
        "systems": describe_systems(settings.systems),
        "reference": REFERENCE,
        "warm": f"RAGCache systems: each window of {WINDOW} questions sent once unmeasured "
        "(stopped at its first token), then measured",
        "concurrency": CONCURRENCY,
        "vllm_kv_gib": settings.vllm_kv_gib,
        "host_pool_tokens": settings.host_pool_tokens,
        "intervals": "95%: Wilson for shares, percentile bootstrap for F1, paired bootstrap "
        f"for differences ({settings.resamples:,} resamples, seed {settings.seed})",
        "settings": asdict(settings),
    }
    engines = Engines(model, settings.cache_config(), log)
    runs: dict[str, SystemRun] = {}
    try:
        ordered = sorted(settings.systems, key=lambda n: n != REFERENCE)
        for name in ordered:
            reference = runs.get(REFERENCE)
            runs[name] = answer_stream(engines, name, stream, decode, progress, reference)
    finally:
        engines.close()
    meta["wall_s"] = time.perf_counter() - started
    return summarize(stream, {n: runs[n] for n in settings.systems}, settings, meta)
