"""Trace simulator: trace parsing (errors with line numbers), results, the CLI."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from ragcache_core.cli import main
from ragcache_core.cost import CopyCost
from ragcache_core.errors import ConfigError, InputError
from ragcache_core.policy import POLICIES
from ragcache_core.sim import (
    EngineConfig,
    SimConfig,
    Simulator,
    TraceRequest,
    load_trace,
    write_trace,
)

GOOD = {"id": "r1", "arrival_s": 0.5, "docs": ["a", "b"], "doc_tokens": [10, 20],
        "question_tokens": 5}  # fmt: skip


def write_lines(path: Path, records: list[object]) -> Path:
    path.write_text("\n".join(r if isinstance(r, str) else json.dumps(r) for r in records) + "\n")
    return path


@pytest.mark.parametrize(
    "bad, message",
    [
        ("{not json", "invalid JSON"),
        ({**GOOD, "doc_tokens": [10]}, "'docs' has 2 entries but 'doc_tokens' has 1"),
        ({**GOOD, "doc_tokens": [10, -3]}, "doc_tokens[1] cannot be negative"),
        ({**GOOD, "question_tokens": -1}, "'question_tokens' cannot be negative"),
        ({**GOOD, "arrival_s": -2.0}, "'arrival_s' must be finite and >= 0"),
        ({k: v for k, v in GOOD.items() if k != "docs"}, "missing field 'docs'"),
        ({**GOOD, "docs": ["a", 3]}, "list of document id strings"),
        ("[1, 2]", "expected a JSON object"),
    ],
)
def test_malformed_trace_lines_fail_with_line_number(
    tmp_path: Path, bad: object, message: str
) -> None:
    path = write_lines(tmp_path / "t.jsonl", [GOOD, "", bad])
    with pytest.raises(InputError) as info:
        load_trace(path)
    assert f"{path}:3:" in str(info.value) and message in str(info.value)


def engine(**changes: object) -> EngineConfig:
    """vLLM's blocks of one token (its hits exact to the token), no host tier."""
    settings: dict[str, object] = {"vllm_blocks": 1000, "host_tokens": 0, "block_size": 1}
    return EngineConfig(**{**settings, **changes})  # type: ignore[arg-type]


def host_alone(host: int, **changes: object) -> EngineConfig:
    """vLLM without prefix caching and a host tier of `host` one-token slots written at
    compute: the knowledge tree is the only cache (its hits and evictions, exactly)."""
    return engine(prefix_caching=False, host_tokens=host, page_size=1, **changes)


def test_round_trip_and_hit_accounting(tmp_path: Path) -> None:
    requests = [
        TraceRequest("1", 0.0, ("a", "b"), (10, 20), 5),
        TraceRequest("2", 1.0, ("a", "b"), (10, 20), 5),
        TraceRequest("3", 2.0, ("a", "c"), (10, 30), 5),
    ]
    path = tmp_path / "t.jsonl"
    write_trace(path, requests)
    assert load_trace(path) == requests
    result = Simulator(SimConfig(engine(), system_tokens=7)).run(requests)
    assert result.requests == 3 and result.requested_docs == 6
    assert result.cached_docs == 3  # a, b on the second request; a on the third
    assert result.doc_hit_rate == pytest.approx(3 / 6)
    assert result.token_hit_rate == pytest.approx((10 + 20 + 10) / (30 + 30 + 40))
    assert result.gpu_doc_hit_rate == result.doc_hit_rate and result.host_doc_hit_rate == 0
    # First request computes everything; the root is cached afterwards (another question
    # each time: its tokens are never a hit).
    assert result.recomputed_tokens == (7 + 30 + 5) + 5 + (30 + 5)


def test_time_is_the_wait_and_the_prefill_loads_and_copies() -> None:
    """TTFT = wait + host loads + copies on the prefill's critical path + T(cached, computed):
    a request that loads its document from the host tier pays the copy of its tokens."""
    requests = [TraceRequest(str(i), 0.0, (d,), (10,), 1) for i, d in enumerate("aba")]
    config = SimConfig(engine(vllm_blocks=19, host_tokens=100, page_size=1, host_write="compute"))
    copies = CopyCost(kv_bytes_per_token=1000, bytes_per_s=1e6)  # a token: 1 ms
    result = Simulator(config, TokenCost(), copies).run(requests)
    # a: 11 computed, 10 stored; b (at 21 ms): 11 and 10; a again (at 42 ms): a host hit.
    assert result.host_doc_hit_rate == pytest.approx(1 / 3)
    assert result.loaded_tokens == 10 and result.recomputed_tokens == 11 + 11 + 1
    assert result.estimated_prefill_s == pytest.approx(23.0)  # TokenCost: 1 s a token
    assert result.load_s == pytest.approx(0.010) and result.copy_s == pytest.approx(0.020)
    firsts = [11 + 0.010, 11 + 0.010, 0.010 + 1]  # prefill + store, or load + prefill
    waits = [0.0, firsts[0], firsts[0] + firsts[1]]
    assert result.ttft_mean_s == pytest.approx(
        sum(w + f for w, f in zip(waits, firsts, strict=True)) / 3
    )
    assert result.wait_mean_s == pytest.approx(sum(waits) / 3)


class TokenCost:
    """One second a computed token."""

    def prefill_time(self, cached_tokens: int, new_tokens: int) -> float:
        return float(new_tokens)


def test_max_depth_counts_deeper_documents_as_misses() -> None:
    requests = [TraceRequest(str(i), 0.0, ("a", "b", "c"), (5, 5, 5), 1) for i in range(3)]
    result = Simulator(SimConfig(host_alone(100, max_depth=1))).run(requests)
    assert result.cached_docs == 2 and result.doc_hit_rate == pytest.approx(2 / 9)


def test_without_prefix_caching_nothing_is_a_gpu_hit() -> None:
    requests = [TraceRequest(str(i), 0.0, ("a",), (10,), 1) for i in range(3)]
    assert Simulator(SimConfig(engine(prefix_caching=False))).run(requests).cached_docs == 0
    assert Simulator(SimConfig(engine())).run(requests).gpu_doc_hit_rate == pytest.approx(2 / 3)


def test_host_tier_hits_are_reported() -> None:
    # vLLM's 18 blocks hold one request (10 + 1 prompt tokens and 7 answer tokens): each
    # request's blocks push out the previous one's, and the host tier serves the repeat.
    requests = [TraceRequest(str(i), 0.0, (d,), (10,), 1) for i, d in enumerate("abab")]
    for host_write in ("compute", "eviction"):
        config = SimConfig(engine(vllm_blocks=19, host_tokens=100, host_write=host_write))
        result = Simulator(config).run(requests)
        assert result.host_doc_hit_rate == pytest.approx(2 / 4), host_write


def test_cli_json_keys(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = write_lines(tmp_path / "t.jsonl", [GOOD, {**GOOD, "id": "r2"}])
    code = main(
        ["simulate", "--trace", str(path), "--policy", "lru", "--vllm-blocks", "100",
         "--block-size", "1", "--host-tokens", "100", "--system-tokens", "8", "--max-depth",
         "2", "--reorder", "--window", "4", "--json"]
    )  # fmt: skip
    assert code == 0
    out = json.loads(capsys.readouterr().out)
    for key in ["requests", "doc_hit_rate", "token_hit_rate", "gpu_doc_hit_rate",
                "host_doc_hit_rate", "recomputed_tokens", "estimated_prefill_s", "load_s",
                "copy_s", "wait_mean_s", "wait_p95_s", "ttft_mean_s", "ttft_p95_s"]:  # fmt: skip
        assert key in out
    assert out["requests"] == 2 and out["host_write"] == "eviction"  # the engine's default
    assert out["doc_hit_rate"] == 0.5  # the second finds both in vLLM's blocks
    assert out["estimated_prefill_s"] > 0 and out["profile"] == "analytic"


def test_the_paper_profile_by_name(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = write_lines(tmp_path / "t.jsonl", [GOOD, {**GOOD, "id": "r2"}])
    args = ["simulate", "--trace", str(path), "--vllm-blocks", "100", "--json"]
    assert main([*args, "--profile", "paper-a10g"]) == 0
    paper = json.loads(capsys.readouterr().out)
    assert main(args) == 0
    analytic = json.loads(capsys.readouterr().out)
    assert paper["profile"] == "paper-a10g"
    assert paper["estimated_prefill_s"] != analytic["estimated_prefill_s"]


def test_cli_errors_are_one_line(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delitem(POLICIES, "apgdsf", raising=False)  # a script may have registered it
    path = write_lines(tmp_path / "t.jsonl", [GOOD, {**GOOD, "doc_tokens": [1, 2, 3]}])
    args = ["simulate", "--trace", str(path), "--vllm-blocks", "10", "--host-tokens", "0"]
    assert main(args) == 2
    err = capsys.readouterr().err.strip()
    assert "\n" not in err and ":2:" in err
    assert main([*args[:-1], "0", "--policy", "fifo"]) == 2
    assert "unknown replacement policy" in capsys.readouterr().err
    assert main([*args[:-1], "0", "--policy", "apgdsf"]) == 2
    err = capsys.readouterr().err.strip()
    assert "\n" not in err and "'apgdsf' was removed" in err and "'dgdsf'" in err
    assert main(args[:3]) == 2
    assert "--vllm-blocks" in capsys.readouterr().err


def _swapped() -> list[TraceRequest]:
    return [
        TraceRequest("1", 0.0, ("a", "b"), (10, 20), 1),
        TraceRequest("2", 1.0, ("b", "a"), (20, 10), 1),
        TraceRequest("3", 2.0, ("c", "b"), (5, 20), 1),
    ]


@pytest.mark.parametrize(
    "order, cached_docs",
    [
        ("retrieval", 0),  # [b, a] and [c, b] miss a -> b
        ("cache", 2),  # [b, a] is served as [a, b]; c, b has no cached continuation
        ("sorted", 2),  # [a, b] both times; [b, c]: root -> b is not cached
        ("first_seen", 2),  # a before b (both times)
    ],
)
def test_document_order_in_the_simulator(order: str, cached_docs: int) -> None:
    config = SimConfig(host_alone(1000), document_order=order)
    result = Simulator(config).run(_swapped())
    assert result.cached_docs == cached_docs
    assert result.requested_docs == 6  # the totals are the request's, in any order


def test_the_order_that_follows_the_cache_sees_vllms_blocks() -> None:
    """With the host tier written at eviction the tree knows what vLLM's blocks hold
    (`Node.resident`): [b, a] is served as [a, b], and vLLM's blocks serve both."""
    config = SimConfig(engine(host_tokens=1000, host_write="eviction"), document_order="cache")
    result = Simulator(config).run(_swapped()[:2])
    assert result.cached_docs == 2 and result.gpu_doc_hit_rate == pytest.approx(2 / 4)


def test_document_order_is_checked_and_reported(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(ConfigError, match="unknown document_order 'random'"):
        SimConfig(engine(), document_order="random")
    path = tmp_path / "t.jsonl"
    write_trace(path, _swapped())
    args = ["simulate", "--trace", str(path), "--vllm-blocks", "1000", "--block-size", "1"]
    args += ["--no-prefix-caching", "--host-tokens", "1000", "--page-size", "1"]
    assert main([*args, "--document-order", "cache", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["document_order"] == "cache" and out["cached_docs"] == 2
    assert out["host_write"] == "compute"  # what a host tier alone can do
    assert main([*args, "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["cached_docs"] == 0
