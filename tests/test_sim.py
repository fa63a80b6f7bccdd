"""Trace simulator: trace parsing (errors with line numbers), results, the CLI."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from ragcache_core.cli import main
from ragcache_core.errors import ConfigError, InputError
from ragcache_core.policy import POLICIES
from ragcache_core.sim import SimConfig, Simulator, TraceRequest, load_trace, write_trace

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


def test_round_trip_and_hit_accounting(tmp_path: Path) -> None:
    requests = [
        TraceRequest("1", 0.0, ("a", "b"), (10, 20), 5),
        TraceRequest("2", 1.0, ("a", "b"), (10, 20), 5),
        TraceRequest("3", 2.0, ("a", "c"), (10, 30), 5),
    ]
    path = tmp_path / "t.jsonl"
    write_trace(path, requests)
    assert load_trace(path) == requests
    result = Simulator(SimConfig(gpu_tokens=1000, host_tokens=0, system_tokens=7)).run(requests)
    assert result.requests == 3 and result.requested_docs == 6
    assert result.cached_docs == 3  # a, b on the second request; a on the third
    assert result.doc_hit_rate == pytest.approx(3 / 6)
    assert result.token_hit_rate == pytest.approx((10 + 20 + 10) / (30 + 30 + 40))
    assert result.gpu_doc_hit_rate == result.doc_hit_rate and result.host_doc_hit_rate == 0
    # First request computes everything; the root is cached afterwards.
    assert result.recomputed_tokens == (7 + 30 + 5) + 5 + (30 + 5)


def test_max_depth_counts_deeper_documents_as_misses() -> None:
    requests = [TraceRequest(str(i), 0.0, ("a", "b", "c"), (5, 5, 5), 1) for i in range(3)]
    result = Simulator(SimConfig(gpu_tokens=100, host_tokens=0, max_depth=1)).run(requests)
    assert result.cached_docs == 2 and result.doc_hit_rate == pytest.approx(2 / 9)


def test_host_tier_hits_are_reported() -> None:
    requests = [TraceRequest(str(i), 0.0, (d,), (10,), 1) for i, d in enumerate("abab")]
    result = Simulator(SimConfig(gpu_tokens=10, host_tokens=100)).run(requests)
    assert result.host_doc_hit_rate == pytest.approx(2 / 4)


def test_cli_json_keys(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = write_lines(tmp_path / "t.jsonl", [GOOD, {**GOOD, "id": "r2"}])
    code = main(
        ["simulate", "--trace", str(path), "--policy", "lru", "--gpu-tokens", "100",
         "--host-tokens", "100", "--system-tokens", "8", "--max-depth", "2", "--reorder",
         "--max-prefill-bs", "2", "--window", "4", "--json"]
    )  # fmt: skip
    assert code == 0
    out = json.loads(capsys.readouterr().out)
    for key in ["requests", "doc_hit_rate", "token_hit_rate", "gpu_doc_hit_rate",
                "host_doc_hit_rate", "recomputed_tokens", "estimated_prefill_s",
                "wait_mean_s", "wait_p95_s", "ttft_mean_s"]:  # fmt: skip
        assert key in out
    assert out["requests"] == 2
    assert out["doc_hit_rate"] == 0.0  # same batch: the second cannot hit the first's stores


def test_cli_errors_are_one_line(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delitem(POLICIES, "apgdsf", raising=False)  # a script may have registered it
    path = write_lines(tmp_path / "t.jsonl", [GOOD, {**GOOD, "doc_tokens": [1, 2, 3]}])
    args = ["simulate", "--trace", str(path), "--gpu-tokens", "10", "--host-tokens", "0"]
    assert main(args) == 2
    err = capsys.readouterr().err.strip()
    assert "\n" not in err and ":2:" in err
    assert main([*args[:-1], "0", "--policy", "fifo"]) == 2
    assert "unknown replacement policy" in capsys.readouterr().err
    assert main([*args[:-1], "0", "--policy", "apgdsf"]) == 2
    err = capsys.readouterr().err.strip()
    assert "\n" not in err and "'apgdsf' was removed" in err and "'dgdsf'" in err


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
    config = SimConfig(gpu_tokens=1000, host_tokens=0, document_order=order)
    result = Simulator(config).run(_swapped())
    assert result.cached_docs == cached_docs
    assert result.requested_docs == 6  # the totals are the request's, in any order


def test_document_order_is_checked_and_reported(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(ConfigError, match="unknown document_order 'random'"):
        SimConfig(gpu_tokens=1, host_tokens=0, document_order="random")
    path = tmp_path / "t.jsonl"
    write_trace(path, _swapped())
    args = ["simulate", "--trace", str(path), "--gpu-tokens", "1000", "--host-tokens", "0"]
    assert main([*args, "--document-order", "cache", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["document_order"] == "cache" and out["cached_docs"] == 2
    assert main([*args, "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["cached_docs"] == 0
