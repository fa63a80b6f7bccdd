"""scripts/adaptive_variants.py: the spec grammar, a shadow cache's hits, the dueling between
paces on a stream whose hot set moves, the cost term's candidate and its scale, and the table
on a tiny trace."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from types import ModuleType

import pytest

from ragcache_core.plan import Tier
from ragcache_core.policy import NodeStats
from ragcache_core.trace import TraceRequest, write_trace

SCRIPTS = Path(__file__).resolve().parent.parent / "scripts"


def _script() -> ModuleType:
    sys.path.insert(0, str(SCRIPTS))
    spec = importlib.util.spec_from_file_location(
        "adaptive_variants", SCRIPTS / "adaptive_variants.py"
    )
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


def test_spec_grammar() -> None:
    script = _script()
    duel, age, lrfu = script.variants("duel0.99m0.05fp1_0.1_c1,age0.25,lrfu0.01")
    cand = script.Candidate
    assert (duel.DECAY, duel.MARGIN, duel.NODE_FREQUENCY) == (0.99, 0.05, True)
    candidates = duel.CANDIDATES
    assert candidates == (cand(1.0), cand(0.1), cand(1.0, cost=True))
    assert age.PACE == 0.25 and lrfu.LAMBDA == 0.01
    plain = script.variants("duel0.999")[0]
    assert (plain.MARGIN, plain.NODE_FREQUENCY) == (0.0, False)
    assert plain.CANDIDATES[0] == cand(0.0)


def test_shadow_holds_what_fits_and_counts_hits() -> None:
    script = _script()
    shadow = script._Shadow(script.Candidate(0.0))
    shadow.reference("a", 60, 0, 100, 1.0)
    shadow.reference("b", 60, 0, 100, 1.0)  # a and b tie; the older, a, goes
    assert set(shadow.entries) == {"b"} and shadow.hits == 0.0
    shadow.reference("b", 60, 0, 100, 1.0)
    assert shadow.hits == 1.0 and shadow.entries["b"][1] == 2


def test_aging_shadow_wins_when_the_hot_set_moves() -> None:
    """A key hot once, then two keys taking turns in room for two: without aging the old
    hot key stays and the new ones miss; with aging they hit."""
    script = _script()
    shadows = [script._Shadow(script.Candidate(0.0)), script._Shadow(script.Candidate(1.0))]
    stream = ["old"] * 20 + ["x", "y"] * 40
    for key in stream:
        for shadow in shadows:
            shadow.reference(key, 10, 0, 20, 1.0)
    still, aged = shadows
    assert "old" in still.entries and "old" not in aged.entries
    assert still.hits == 19.0  # only the old key's own repeats
    assert aged.hits > still.hits + 30


def test_cost_shadow_keeps_the_costly_key() -> None:
    """Two keys of one size, one twice as costly per token: the 1 / size shadow keeps the
    newer (a tie), the cost shadow the costly one."""
    script = _script()
    by_size = script._Shadow(script.Candidate(1.0))
    by_cost = script._Shadow(script.Candidate(1.0, cost=True))
    for shadow in (by_size, by_cost):
        shadow.reference("costly", 10, 0, 10, 1.0, cost=2.0)
        shadow.reference("cheap", 10, 0, 10, 1.0, cost=1.0)
    assert set(by_size.entries) == {"cheap"} and set(by_cost.entries) == {"costly"}


def test_cost_weight_is_on_the_per_token_scale() -> None:
    """The cost term is scaled so that its mean over the references seen is 1 / size's: the
    priorities of both weights (so across a switch) stay on one scale."""
    script = _script()
    policy = script.variants("duel0.999m0fp0_c1")[0]()
    nodes = []
    for tokens, cost in ((10, 0.002), (40, 0.004)):
        stats = NodeStats(tokens, cost, now=0)
        stats.touch(0, count=True, window=0)
        stats.record_computed(cost)
        policy.on_enter(Tier.HOST, str(tokens), stats)
        nodes.append(stats)
    weights = [policy.weights(stats) for stats in nodes]
    per_token_mean = sum(w[0] for w in weights) / 2
    cost_mean = sum(w[1] for w in weights) / 2
    assert per_token_mean == pytest.approx((1 / 10 + 1 / 40) / 2)
    assert cost_mean == pytest.approx(per_token_mean)
    assert weights[1][1] == pytest.approx(2 * weights[0][1])  # the cost ratio kept
    policy.choice[Tier.HOST] = script.Candidate(1.0, cost=True)
    value, _ = policy.priority(nodes[1], Tier.HOST)
    assert value == pytest.approx(weights[1][1])


def test_table_on_a_tiny_trace(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    requests = [
        TraceRequest(
            id=f"q{i}",
            arrival_s=float(i),
            docs=(str(i % 7), str((i // 3) % 40)),
            doc_tokens=(100, 120),
            question_tokens=20,
        )
        for i in range(120)
    ]
    trace = tmp_path / "tiny.jsonl"
    write_trace(trace, requests)
    argv = ["adaptive_variants.py", str(trace), "--variants", "age0,duel0.999m0fp1_0_c1"]
    sys_argv, sys.argv = sys.argv, argv
    try:
        _script().main()
    finally:
        sys.argv = sys_argv
    out = capsys.readouterr().out
    rows = [line for line in out.splitlines() if line.startswith("| tiny")]
    assert len(rows) == 5
    assert "duel0.999m0fp1_0_c1 on held-out traces" in out
