"""The simulated engine (`sim.blocks`, `sim.engine`): its block pool against vLLM's own, the
host tier written at compute or at eviction on small streams whose outcome is known, and the
runtime's protocol that drives its tree."""

from __future__ import annotations

import json
import random
from pathlib import Path
from typing import Any

import pytest

from ragcache_core.errors import ConfigError, InputError
from ragcache_core.sim.blocks import BlockHasher, BlockPool, TokenIds
from ragcache_core.sim.engine import EngineConfig, EngineRequest, EngineSimulator
from ragcache_core.tree import DocKey, DocSpec


def _state(pool: Any, names: dict[Any, int]) -> tuple[list[int], list[int], list[int | None]]:
    """Free-queue order, reference counts and each block's hash (as the test named them)."""
    queue = [b.block_id for b in pool.free_block_queue.iter_blocks_after(None)]
    refs = [b.ref_cnt for b in pool.blocks[1:]]
    named = [None if b.block_hash is None else names[b.block_hash] for b in pool.blocks[1:]]
    return queue, refs, named


def test_the_block_pool_moves_as_vllms_own_under_random_operations() -> None:
    """Allocation, caching, hits, frees (cached to the tail, uncached to the head) and moves to
    the head: after every operation the free queue's order, the reference counts and the cached
    hashes of our pool equal those of vLLM's `BlockPool` given the same operations."""
    from vllm.v1.core.block_pool import BlockPool as VllmPool
    from vllm.v1.core.kv_cache_utils import BlockHash, make_block_hash_with_group_id

    rng = random.Random(7)
    ours, theirs = BlockPool(24), VllmPool(24, enable_caching=True, hash_block_size=4)
    vllm_hashes = {n: make_block_hash_with_group_id(BlockHash(bytes([n])), 0) for n in range(12)}
    names = {h: n for n, h in vllm_hashes.items()}
    owned: list[list[int]] = []
    for _ in range(600):
        op = rng.random()
        if op < 0.35 and ours.num_free:
            count = rng.randint(1, min(5, ours.num_free))
            got = [b.block_id for b in ours.get_new_blocks(count)]
            assert got == [b.block_id for b in theirs.get_new_blocks(count)]
            owned.append(got)
        elif op < 0.55 and owned:
            request = rng.choice(owned)
            block_id, n = rng.choice(request), rng.randrange(12)
            if ours.blocks[block_id].block_hash is None and not ours.cached.get(n):
                ours.cache(ours.blocks[block_id], n)
                theirs._insert_block_hash(vllm_hashes[n], theirs.blocks[block_id], num_tokens=4)
        elif op < 0.7:
            cached = [b.block_id for b in ours.blocks if b.block_hash is not None]
            if cached:
                hit = rng.sample(cached, rng.randint(1, min(3, len(cached))))
                ours.touch([ours.blocks[i] for i in hit])
                theirs.touch([theirs.blocks[i] for i in hit])
                owned.append(hit)
        elif op < 0.9 and owned:
            request = owned.pop(rng.randrange(len(owned)))
            ours.free_blocks(reversed([ours.blocks[i] for i in request]))
            theirs.free_blocks(reversed([theirs.blocks[i] for i in request]))
        else:
            free = [b.block_id for b in ours.free_block_queue.iter_blocks_after(None)]
            moved = rng.sample(free, min(len(free), rng.randint(1, 3)))
            for pool in (ours, theirs):
                blocks = [pool.blocks[i] for i in moved]
                for block in blocks:
                    pool.free_block_queue.remove(block)
                pool.free_block_queue.prepend_n(blocks)
        assert _state(ours, {n: n for n in range(12)}) == _state(theirs, names)


def test_block_names_chain_on_the_prefix() -> None:
    hasher = BlockHasher(4)
    a = hasher.hashes([("root", 2), ("doc", 6)])
    b = hasher.hashes([("root", 2), ("doc", 6), ("q", 3)])
    c = hasher.hashes([("other", 2), ("doc", 6)])
    assert len(a) == 2 and b[:2] == a and len(b) == 2  # a partial block has no name
    assert not set(a) & set(c)  # the same document after another root: other blocks
    # Known ids are named by the ids: two questions after the same fixed text share its block.
    q1 = hasher.hashes([("doc", 6), (TokenIds((1, 2, 3, 4, 5, 9)), 6)])
    q2 = hasher.hashes([("doc", 6), (TokenIds((1, 2, 3, 4, 5, 8)), 6)])
    assert q1[:2] == q2[:2] and q1[2] != q2[2]


def _doc(name: str, tokens: int) -> DocSpec:
    return DocSpec(DocKey(name, "h"), tokens)


def _request(doc: DocSpec, i: int) -> EngineRequest:
    return EngineRequest(root_tokens=40, docs=(doc,), question_tokens=20, question=i)


def _config(**changes: object) -> EngineConfig:
    # 24 usable blocks of 32 tokens: two ~300-token documents fit, not three with answers.
    settings: dict[str, object] = {
        "vllm_blocks": 25,
        "host_tokens": 4096,
        "max_num_batched_tokens": 256,  # a prompt takes two steps
        "window_tokens": 512,  # 16 blocks; a lease of 32 slots: the root and one document
        "max_tokens": 4,
    }
    return EngineConfig(**{**settings, **changes})  # type: ignore[arg-type]


def test_a_repeat_hits_vllms_blocks_up_to_its_last_full_block() -> None:
    sim = EngineSimulator(_config(host_tokens=0))
    doc = _doc("a", 300)
    first, second = sim.serve(_request(doc, 0)), sim.serve(_request(doc, 1))
    assert first.cached_tokens == 0
    # root 40 + doc 300 = 340 tokens: 10 full blocks of 32 are the same tokens
    assert second.gpu_tokens == 320 and second.loaded_tokens == 0
    # A GPU hit as `served_hits` counts it: only its tail, in the block it shares with the
    # question, was recomputed.
    assert second.cached_doc_tokens == 280 and second.gpu_docs == 1
    # A document inside one block with the question is no hit at all.
    short = _doc("s", 10)
    sim.serve(_request(short, 2))
    assert sim.serve(_request(short, 3)).gpu_docs == 0


def test_write_through_copies_every_computed_document_and_serves_it_back() -> None:
    sim = EngineSimulator(_config(host_write="compute"))
    docs = [_doc(name, 300) for name in "abc"]
    for i, doc in enumerate(docs):
        sim.serve(_request(doc, i))
        assert sim.tree.counters.host_slots_written == (i + 1) * 19 + 3  # root 3 slots, doc 19
    again = sim.serve(_request(docs[0], 9))  # pushed out of vLLM's blocks by b and c
    assert again.loaded_tokens > 0 and again.gpu_tokens + again.loaded_tokens == 340
    assert again.host_docs == 1 and again.cached_doc_tokens == 300


@pytest.mark.parametrize("back", ["head", "tail"])
def test_eviction_time_writes_copy_a_document_only_as_it_leaves_vllms_blocks(back: str) -> None:
    sim = EngineSimulator(_config(host_write="eviction", host_write_return=back))
    docs = [_doc(name, 300) for name in "abc"]
    sim.serve(_request(docs[0], 0))
    assert sim.tree.counters.host_slots_written == 0  # still in vLLM's blocks: nothing copied
    sim.serve(_request(docs[1], 1))
    sim.serve(_request(docs[2], 2))
    written = sim.tree.counters.host_slots_written
    assert written >= 3 + 19  # the root and `a` reached the head of the free queue: copied
    again = sim.serve(_request(docs[0], 3))
    assert again.cached_doc_tokens == 300 and again.host_docs == 1
    nodes = {n.key.doc_id for n in sim.tree.iter_nodes() if isinstance(n.key, DocKey)}
    assert "a" in nodes


def test_the_store_policy_applies_to_eviction_time_writes() -> None:
    """ "second": a document met once is never kept, so only the root is copied (more than once,
    as in the engine: plans made before its first copy was applied keep it too; the tree uses
    one copy and frees the others' slots)."""
    sim = EngineSimulator(_config(host_write="eviction", store_policy="second"))
    for i, name in enumerate("abcd"):
        sim.serve(_request(_doc(name, 300), i))
    assert sim.tree.counters.host_slots_written % 3 == 0  # root copies, 3 slots each
    assert sim.tree.host_writes is not None and sim.tree.host_writes.copies == 1
    assert not [n for n in sim.tree.iter_nodes() if isinstance(n.key, DocKey)]


def test_settings_out_of_range_are_refused_by_name() -> None:
    with pytest.raises(ConfigError, match="host_write"):
        EngineConfig(vllm_blocks=10, host_tokens=0, host_write="eviction")
    with pytest.raises(ConfigError, match="host_write_return"):
        EngineConfig(vllm_blocks=10, host_tokens=10, host_write_return="middle")
    with pytest.raises(ConfigError, match="2 blocks"):
        EngineSimulator(EngineConfig(vllm_blocks=1, host_tokens=0))


def test_simulate_on_a_trace(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from ragcache_core.cli import main

    trace = tmp_path / "t.jsonl"
    lines = [
        {"id": str(i), "arrival_s": i, "docs": [d], "doc_tokens": [300], "question_tokens": 20}
        for i, d in enumerate("ababcab")
    ]
    trace.write_text("".join(json.dumps(line) + "\n" for line in lines))
    args = ["simulate", "--trace", str(trace), "--vllm-blocks", "25"]
    args += ["--host-tokens", "4096", "--system-tokens", "40", "--host-write", "eviction", "--json"]
    assert main(args) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["requests"] == 7 and out["host_write"] == "eviction"
    assert 0 < out["token_hit_rate"] <= 1 and out["host_doc_hit_rate"] > 0


def test_the_tree_is_driven_through_the_runtimes_lifecycle(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Each request is opened (planned and checked), confirmed at its first token and settled
    with the connector's report, in that order, through `runtime.lifecycle.Lifecycle`: the
    window's copies reach the tree by the reports, as in the engine."""
    from ragcache_core.runtime.lifecycle import Lifecycle

    calls: list[str] = []
    for name in ("open", "first_token", "settle"):
        method = getattr(Lifecycle, name)

        def spy(self: Lifecycle, *args: Any, _m: Any = method, _n: str = name, **kw: Any) -> Any:
            calls.append(_n)
            return _m(self, *args, **kw)

        monkeypatch.setattr(Lifecycle, name, spy)
    sim = EngineSimulator(_config(host_write="eviction"))
    for i, name in enumerate("abca"):
        sim.serve(_request(_doc(name, 300), i))
    assert calls == ["open", "first_token", "settle"] * 4
    assert sim.tree.host_writes is not None and sim.tree.host_writes.copies > 0


def test_the_reuse_ceiling_counts_a_document_only_after_the_same_prefix() -> None:
    """A document is cached at best when an earlier request had the same documents before it:
    b after a (request 2) is new although b came before (request 1, first); the warm-up's
    requests count as seen but not as measured."""
    from ragcache_core.bench.replay import reuse_ceiling

    a, b, c = _doc("a", 100), _doc("b", 300), _doc("c", 50)

    def req(i: int, *docs: DocSpec) -> EngineRequest:
        return EngineRequest(root_tokens=40, docs=docs, question_tokens=20, question=i)

    stream = [req(0, a), req(1, b, a), req(2, a, b), req(3, a, b), req(4, c)]
    # Measured (after 2 warm-up requests): [a, b] (a seen: 100; b after a new: 0),
    # [a, b] again (400), [c] (0): 500 of 850.
    assert reuse_ceiling(stream, 2) == pytest.approx(500 / 850)
    assert reuse_ceiling(stream, 0) == pytest.approx(500 / (100 + 400 + 400 + 400 + 50))
    assert reuse_ceiling(stream, 5) == 0.0  # nothing measured
    # A simulated engine with memory to spare reaches it; none exceeds it.
    roomy = EngineSimulator(_config(vllm_blocks=400))
    served = [roomy.serve(r) for r in stream]
    assert roomy.result(served[2:]).doc_token_hit_rate <= reuse_ceiling(stream, 2) + 1e-9


def test_replay_rebuilds_a_bench_runs_stream_and_prints_both_rates(
    tiny_model: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """A `bench serve` JSON of the shipped `demo` workload (its points written here, as the
    engine would have): the replay rebuilds the stream from the workload, seed and model (the
    mean prompt equals the one given, measured by the same prompts), simulates each caching
    system, and derives the engine's document-token rate from its token rate."""
    from ragcache_core.bench.replay import replay
    from ragcache_core.cli import main

    def point(system: str, rate: float) -> dict[str, object]:
        return {"system": system, "token_hit_rate": rate, "prompt_tokens_mean": 0.0}

    settings = {
        "mode": {"warmup": 16, "requests": 8},
        "model": str(tiny_model),
        "kv_bytes_per_token": 2048,
        "max_tokens": 4,
        "vllm_kv_gib": 0.003,
        "host_pool_tokens": 4096,
        "policy": "pgdsf",
        "seed": 0,
    }
    run = {"name": "demo", "top_k": 1, "retriever": "", "points": []}
    run["points"] = [point("vllm", 0.0), point("vllm-apc", 0.1), point("ragcache", 0.3)]
    path = tmp_path / "serve.json"
    path.write_text(json.dumps({"settings": settings, "workloads": [run]}))
    rows = {r.system: r for r in replay(path)}
    assert set(rows) == {"vllm-apc", "ragcache"}  # plain vLLM caches nothing: not simulated
    apc, ours = rows["vllm-apc"], rows["ragcache"]
    assert apc.config.host_tokens == 0 and ours.config.host_tokens == 4096
    assert apc.config.vllm_blocks == int(0.003 * 2**30) // (32 * 2048)
    assert apc.sim.requests == 8 and apc.sim_prompt_tokens_mean > 100
    # The engine's document tokens cached: its cached tokens less the roots'.
    assert ours.engine_doc_token_hit_rate > apc.engine_doc_token_hit_rate
    # The host tier's tokens, and the share vLLM's blocks hold too, within it.
    assert apc.sim_host_tokens_mean == 0 and ours.sim_host_tokens_mean > 0
    assert 0 <= ours.sim_both_tiers_tokens_mean <= ours.sim_host_tokens_mean
    assert main(["simulate", "--replay", str(path)]) == 0
    out = capsys.readouterr().out
    assert "ragcache" in out and "vllm-apc" in out and "30.0%/" in out
    # The stream's ceiling bounds every system's simulated document-token rate.
    assert ours.ceiling_doc_token_hit_rate > 0
    assert all(
        r.sim.doc_token_hit_rate <= r.ceiling_doc_token_hit_rate + 1e-9 for r in rows.values()
    )
    assert f"{ours.ceiling_doc_token_hit_rate:.1%}" in out
    with pytest.raises(InputError, match="no workload"):
        replay(path, ("long",))
    # A capacity-constrained workload's host tier is its own (`host_sizing`), not the run's.
    run["host_sizing"] = {"host_tokens": 1024}
    path.write_text(json.dumps({"settings": settings, "workloads": [run]}))
    rows = {r.system: r for r in replay(path)}
    assert rows["ragcache"].config.host_tokens == 1024
    assert rows["vllm-apc"].config.vllm_blocks == apc.config.vllm_blocks
    # --replay-policy: the simulator's host tier under another policy; the engine's columns
    # stay the run's.
    assert rows["ragcache"].config.policy == "pgdsf"  # the run's
    swapped = {r.system: r for r in replay(path, policy="lru")}
    assert swapped["ragcache"].config.policy == "lru"
    assert (
        swapped["ragcache"].engine_doc_token_hit_rate == rows["ragcache"].engine_doc_token_hit_rate
    )
    with pytest.raises(InputError, match="unknown replacement policy 'nope'"):
        replay(path, policy="nope")
    assert main(["simulate", "--replay", str(path), "--replay-policy", "dgdsf"]) == 0


def test_without_copies_at_hand_out_the_look_ahead_alone_loses_what_a_step_takes_past_it() -> None:
    """vLLM's lazy offload (the proxy's setting): a document whose blocks a step takes from
    beyond the look-ahead (one block here; a prefill step takes eleven) leaves uncopied; with
    copies at hand-out (the default) it is kept."""
    kept = {}
    for handout in (True, False):
        config = _config(
            host_write="eviction",
            handout=handout,
            window_tokens=32,
            vllm_blocks=40,
            max_num_batched_tokens=1024,
        )
        sim = EngineSimulator(config)
        docs = [_doc(name, 300) for name in "abcd"]
        for i, doc in enumerate(docs):
            sim.serve(_request(doc, i))
        kept[handout] = sim.serve(_request(docs[0], 9)).host_docs
    assert kept == {True: 1, False: 0}
