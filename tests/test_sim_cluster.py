"""Cluster simulator (N replicas behind a router): routing policies on hand-made traces with
known answers, the load bound, the imbalance metric, the resampler, the CLI."""

from __future__ import annotations

import json
import sys
from collections import Counter
from pathlib import Path

import numpy as np
import pytest

from ragcache_core.cli import main
from ragcache_core.errors import ConfigError
from ragcache_core.sim import (
    ClusterConfig,
    EngineConfig,
    SimConfig,
    TraceRequest,
    simulate,
    simulate_cluster,
    write_trace,
)
from ragcache_core.sim.cluster import HashRing, Loads, window_imbalance

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "scripts"))
from resample import fit_zipf, resample  # scripts/resample.py


def req(i: int, *docs: str, tokens: int = 10) -> TraceRequest:
    return TraceRequest(str(i), float(i), tuple(docs), tuple(tokens for _ in docs), 1)


def replica(memory: int) -> SimConfig:
    """A replica whose knowledge tree is its only cache: `memory` one-token host slots
    written at compute, vLLM without prefix caching (its hits are the tree's, exactly)."""
    engine = EngineConfig(
        vllm_blocks=100, host_tokens=memory, block_size=1, page_size=1, prefix_caching=False
    )
    return SimConfig(engine)


def cluster(n: int, routing: str, memory: int = 1000, **kw: object) -> ClusterConfig:
    return ClusterConfig(replicas=n, replica=replica(memory), routing=routing, **kw)  # type: ignore[arg-type]


def names_homed(n: int, count: int) -> list[str]:
    """`count` document ids whose ring homes are distinct replicas (inputs for the tests)."""
    ring, found, homes = HashRing(n), [], set()
    for i in range(1000):
        home = ring.order(f"doc{i}")[0]
        if home not in homes:
            homes.add(home)
            found.append(f"doc{i}")
        if len(found) == count:
            return found
    raise AssertionError("no such ids")


def test_round_robin_spreads_one_document_over_every_replica() -> None:
    requests = [req(i, "a") for i in range(6)]
    result = simulate_cluster(requests, cluster(3, "round_robin"))
    assert result.requests_per_replica == (2, 2, 2)
    assert result.doc_hit_rate == pytest.approx(3 / 6)  # each replica misses "a" once


def test_doc_affinity_keeps_a_first_document_on_one_replica() -> None:
    a, b = names_homed(2, 2)
    requests = [req(i, d, "x") for i, d in enumerate([a, b, a, b, a, b])]
    result = simulate_cluster(requests, cluster(2, "doc_affinity_unbounded"))
    assert sorted(result.requests_per_replica) == [3, 3]
    assert result.doc_hit_rate == pytest.approx(8 / 12)  # only the first (d, x) of each misses
    rr = simulate_cluster(requests, cluster(2, "round_robin"))
    assert rr.doc_hit_rate == pytest.approx(8 / 12)  # a on 0, b on 1 by parity: same here
    shifted = [req(i, d, "x") for i, d in enumerate([a, a, b, b, a, a, b, b])]
    assert simulate_cluster(shifted, cluster(2, "doc_affinity_unbounded")).doc_hit_rate == (
        pytest.approx(12 / 16)
    )
    assert simulate_cluster(shifted, cluster(2, "round_robin")).doc_hit_rate == pytest.approx(
        8 / 16
    )


def test_affinity_with_half_the_memory_matches_one_replica_with_all_of_it() -> None:
    a, b = names_homed(2, 2)
    requests = [req(i, d) for i, d in enumerate([a, a, b, b] * 3)]
    one = simulate(requests, replica(20))
    affinity = simulate_cluster(requests, cluster(2, "doc_affinity", memory=10, load_factor=2))
    rr = simulate_cluster(requests, cluster(2, "round_robin", memory=10))
    assert one.doc_hit_rate == pytest.approx(10 / 12)
    assert affinity.doc_hit_rate == pytest.approx(10 / 12)
    assert rr.doc_hit_rate == 0.0  # each replica sees a, b, a, b ... with room for one


def test_load_bound_splits_a_hot_document() -> None:
    requests = [req(i, "hot") for i in range(10)]
    unbounded = simulate_cluster(requests, cluster(2, "doc_affinity_unbounded"))
    assert sorted(unbounded.requests_per_replica) == [0, 10]
    exact = simulate_cluster(requests, cluster(2, "doc_affinity", load_factor=1.0))
    assert exact.requests_per_replica == (5, 5)  # c = 1: alternate once the home is full
    assert exact.doc_hit_rate == pytest.approx(8 / 10)
    loose = simulate_cluster(requests, cluster(2, "doc_affinity", load_factor=1.5))
    # Request k may go home while home < ceil(1.5 (k + 1) / 2): caps 1,2,3,3,4,5,6,6,7,8
    # send requests 3 and 7 elsewhere; the home share tends to c / N = 0.75.
    assert sorted(loose.requests_per_replica) == [2, 8]
    assert loose.busiest_share == pytest.approx(0.8)


def test_loads_forget_requests_outside_the_window() -> None:
    loads = Loads(2, window=3)
    for replica in [0, 0, 0, 1]:
        loads.add(replica)
    assert loads.counts == [2, 1]
    assert loads.capacity(1.0) == 2  # ceil((3 + 1) / 2)
    assert loads.least_loaded([0, 1]) == 1


def test_oracle_follows_the_replica_that_holds_the_document() -> None:
    requests = [req(i, d) for i, d in enumerate("abab" * 2)]
    result = simulate_cluster(requests, cluster(2, "oracle", memory=10, load_factor=10))
    assert result.requests_per_replica == (4, 4)
    assert result.doc_hit_rate == pytest.approx(6 / 8)
    rr = simulate_cluster(
        [req(i, d) for i, d in enumerate("aabb" * 2)], cluster(2, "round_robin", memory=10)
    )
    oracle = simulate_cluster(
        [req(i, d) for i, d in enumerate("aabb" * 2)],
        cluster(2, "oracle", memory=10, load_factor=10),
    )
    assert rr.doc_hit_rate == 0.0 and oracle.doc_hit_rate == pytest.approx(6 / 8)


def test_prefix_affinity_follows_the_matched_prefix_and_places_new_ones_on_the_smallest_tree() -> (
    None
):
    # Router trees after each request: r0 = a,b + question (21 tokens); r1 = c (11); the
    # third matches "a" on r0 (10 of 21 tokens > 0.3) although r1's tree is smaller; the
    # fourth matches nothing and goes to the smaller tree, r1.
    requests = [req(0, "a", "b"), req(1, "c"), req(2, "a", "x"), req(3, "d")]
    result = simulate_cluster(requests, cluster(2, "prefix_affinity"))
    assert result.requests_per_replica == (2, 2)
    assert [r.cached_docs for r in result.per_replica] == [1, 0]


def test_prefix_affinity_balances_when_loads_diverge() -> None:
    requests = [req(i, "hot", str(i)) for i in range(40)]
    result = simulate_cluster(
        requests, cluster(2, "prefix_affinity", load_window=100, balance_abs=4, balance_rel=1.5)
    )
    assert max(result.requests_per_replica) <= 40 // 2 + 5


def test_window_imbalance_known_answer() -> None:
    assert window_imbalance([0, 0, 0, 1, 0, 1, 0, 1], 2, 4) == [1.5, 1.0]
    assert window_imbalance([0, 1, 2], 3, 3) == [1.0]


def test_bad_cluster_config_names_the_problem() -> None:
    with pytest.raises(ConfigError, match="unknown routing 'nope'"):
        cluster(2, "nope")
    with pytest.raises(ConfigError, match="load_factor"):
        cluster(2, "doc_affinity", load_factor=0.5)
    with pytest.raises(ConfigError, match="replicas"):
        cluster(0, "round_robin")


def test_fit_zipf_recovers_the_exponent() -> None:
    rng = np.random.default_rng(1)
    ranks = np.arange(1, 501, dtype=np.float64)
    for s in (0.6, 1.1):
        p = ranks**-s
        draws = rng.choice(500, size=200_000, p=p / p.sum())
        counts = sorted(Counter(draws.tolist()).values(), reverse=True)
        counts += [0] * (500 - len(counts))
        assert fit_zipf(counts) == pytest.approx(s, abs=0.03)


def test_resample_keeps_the_one_off_share_and_the_templates() -> None:
    trace = [req(i, "hot", "h2") for i in range(30)]
    trace += [req(100 + i, f"one{i}", "z") for i in range(30)]
    trace += [req(200 + i, f"warm{i % 5}", "w") for i in range(40)]
    stream, fit = resample(trace, 1000, seed=3)
    assert fit.one_off_share == pytest.approx(0.3) and fit.copies == 10
    assert fit.reused_groups == 6 and len(stream) == 1000
    firsts = Counter(r.docs[0] for r in stream)
    one_offs = sum(1 for d, c in firsts.items() if d.startswith("one"))
    assert 0.25 < one_offs / 1000 < 0.35 and all(
        c == 1 for d, c in firsts.items() if d.startswith("one")
    )
    assert firsts.most_common(1)[0][0] == "hot"  # rank 0 is the trace's hottest
    for r in stream:
        base = r.docs[0].split("~")[0]
        assert r.doc_tokens == (10, 10)
        assert r.docs[1].split("~")[0] == {"hot": "h2"}.get(
            base, "z" if base.startswith("one") else "w"
        )
    assert resample(trace, 1000, seed=3)[0] == stream


def test_replicas_run_the_engines_tiers() -> None:
    """Each replica is one simulated engine (vLLM's blocks, the host tier at eviction): a
    replica's repeat is a hit in its own caches, never in another's."""
    engine = EngineConfig(vllm_blocks=100, host_tokens=1000, block_size=1, host_write="eviction")
    config = ClusterConfig(replicas=2, replica=SimConfig(engine), routing="round_robin")
    result = simulate_cluster([req(i, "a") for i in range(6)], config)
    assert result.doc_hit_rate == pytest.approx(4 / 6)  # each replica misses "a" once
    assert result.ttft_mean_s > 0
    with pytest.raises(ConfigError, match="FCFS"):
        ClusterConfig(replicas=2, replica=SimConfig(engine, reorder=True))


def test_cli_replicas_json(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = tmp_path / "t.jsonl"
    write_trace(path, [req(i, "a") for i in range(4)])
    args = ["simulate", "--trace", str(path), "--vllm-blocks", "100", "--block-size", "1"]
    assert main([*args, "--replicas", "2", "--routing", "round_robin", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["requests_per_replica"] == [2, 2] and out["doc_hit_rate"] == 0.5
    assert main([*args, "--replicas", "2", "--routing", "sticky"]) == 2
    assert "unknown routing 'sticky'" in capsys.readouterr().err
