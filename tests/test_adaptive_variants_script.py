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
    assert (plain.MARGIN, plain.Z, plain.NODE_FREQUENCY) == (0.0, 0.0, False)
    assert plain.CANDIDATES[0] == cand(0.0)
    tested = script.variants("duel0.999z2.5fp1_u0")[0]
    assert (tested.DECAY, tested.MARGIN, tested.Z, tested.NODE_FREQUENCY) == (0.999, 0, 2.5, True)
    candidates = tested.CANDIDATES
    assert candidates == (cand(1.0), cand(0.0, uniform=True))
    with pytest.raises(SystemExit):
        script.variants("duel0.999q1")
    gdsf, pgdsf = script.variants("gdsfa0,pgdsfa0.5")
    assert (gdsf.PACE, gdsf.COST, pgdsf.PACE, pgdsf.COST) == (0.0, "standalone", 0.5, "prefix")


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


def _first_switch(spec: str, stream: list[str]) -> int:
    """The index in `stream` (keys of 10 tokens, the host tier holding 20) at which the
    policy `spec` first leaves its start candidate; len(stream) if it never does."""
    script = _script()
    policy = script.variants(spec)[0]()
    policy.capacity[Tier.HOST] = 20
    nodes = {key: NodeStats(10, 0.0, now=0) for key in set(stream)}
    start = policy.choice[Tier.HOST]
    for i, key in enumerate(stream):
        nodes[key].touch(i, count=True, window=0)
        policy._reference(Tier.HOST, key, nodes[key])
        if policy.choice[Tier.HOST] != start:
            return i
    return len(stream)


def test_sign_test_waits_for_a_clear_lead() -> None:
    """Pace 1 wins once the hot set moves: with Z = 0 the tier switches at its first hit
    ahead, with Z = 3 only once the lead is 3 standard deviations of the references where
    exactly one shadow hit (all of them here, so a lead of 10, 9 references later)."""
    stream = ["old"] * 20 + ["x", "y"] * 40
    at_once = _first_switch("duel1m0fp0_1", stream)
    tested = _first_switch("duel1z3fp0_1", stream)
    assert at_once < len(stream) and tested == at_once + 9


def test_sign_test_holds_on_noise() -> None:
    """A lead of 2 hits over 4 references where exactly one of the two hit: Z = 0
    switches, Z = 2 (a lead above 2 x sqrt(4)) does not; 0.5 of such references do."""
    script = _script()
    for z, disagreements, switched in ((0, 4.0, True), (2, 4.0, False), (2, 0.5, True)):
        policy = script.variants(f"duel0.999z{z}p1_0")[0]()
        shadows = policy.shadows[Tier.HOST]
        shadows[0].hits, shadows[1].hits = 3.0, 5.0
        policy.disagreements[Tier.HOST][0][1] = disagreements
        policy._choose(Tier.HOST)
        assert (policy.choice[Tier.HOST] == script.Candidate(0.0)) is switched


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


def test_uniform_shadow_keeps_the_frequent_key() -> None:
    """A large key seen twice, then a small one: per token the large one is worth less and
    goes; with one weight for all (plain LFU) the small one, seen once, goes."""
    script = _script()
    per_token = script._Shadow(script.Candidate(0.0))
    uniform = script._Shadow(script.Candidate(0.0, uniform=True))
    for shadow in (per_token, uniform):
        shadow.reference("large", 80, 0, 100, 1.0, uniform=0.02)
        shadow.reference("large", 80, 0, 100, 1.0, uniform=0.02)
        shadow.reference("small", 30, 0, 100, 1.0, uniform=0.02)
    assert set(per_token.entries) == {"small"} and set(uniform.entries) == {"large"}


def test_uniform_weight_is_the_per_token_mean() -> None:
    script = _script()
    policy = script.variants("duel0.999fpu0")[0]()
    nodes = [NodeStats(tokens, 0.0, now=0) for tokens in (10, 40)]
    for i, stats in enumerate(nodes):
        stats.touch(0, count=True, window=0)
        policy.on_enter(Tier.HOST, str(i), stats)
    assert policy.uniform_weight() == pytest.approx((1 / 10 + 1 / 40) / 2)
    values = [policy.priority(stats, Tier.HOST)[0] for stats in nodes]
    assert values[0] == pytest.approx(values[1])  # one weight, one frequency: one value


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


def test_a_clock_at_full_pace_is_the_policy_itself() -> None:
    """`gdsfa1` and `pgdsfa1` are GDSF and PGDSF (the same hits on a trace with Zipf
    popularity and mixed sizes); `gdsfa0`, whose clock never moves, is another policy."""
    import random

    from policy_hit_rates import simulate_cell

    script = _script()
    rng = random.Random(0)
    sizes = {str(d): 50 + d * 37 % 150 for d in range(30)}
    weights = [1 / (rank + 1) for rank in range(30)]
    requests = []
    for i in range(300):
        name = rng.choices(list(sizes), weights)[0]
        requests.append(TraceRequest(f"q{i}", float(i), (name,), (sizes[name],), 20))
    for cls in script.variants("gdsfa1,pgdsfa1,gdsfa0"):
        script.POLICIES[cls.name] = cls

    def rate(policy: str) -> float:
        return simulate_cell(requests, 300, 600, policy, 64, host_write="compute").doc_hit_rate

    assert rate("gdsfa1") == rate("gdsf") > 0 and rate("pgdsfa1") == rate("pgdsf") > 0
    assert rate("gdsfa0") != rate("gdsf")


def test_aged_lfu_variants_parse_and_a_registered_policy_passes_through() -> None:
    """`alfu{h}`, `aclfu{h}`, `aslfu{h}`: the decayed count with half-life h, weighted by
    nothing, PGDSF's cost term or GDSF's; a registered name (`dgdsf`, `lfu`) is the policy as
    it ships."""
    script = _script()
    classes = script.variants("alfu500,aclfu1000,aslfu2000,dgdsf,lfu")
    assert [c.name for c in classes] == ["alfu500", "aclfu1000", "aslfu2000", "dgdsf", "lfu"]
    assert [getattr(c, "WEIGHT", None) for c in classes[:3]] == [
        "uniform",
        "prefix",
        "standalone",
    ]
    assert abs(classes[2].LAMBDA - 1 / 2000) < 1e-12
    assert classes[3] is script.POLICIES["dgdsf"] and classes[4] is script.POLICIES["lfu"]
    # Twice the standalone cost is one more in the log2 priority.
    policy = classes[2]()
    cheap, dear = NodeStats(10, 1.0, now=0), NodeStats(10, 2.0, now=0)
    for stats in (cheap, dear):
        stats.touch(5, count=True, window=0)
        policy.on_enter(Tier.HOST, id(stats), stats)
    assert policy.priority(dear, Tier.HOST)[0] - policy.priority(cheap, Tier.HOST)[0] == (
        pytest.approx(1.0)
    )
