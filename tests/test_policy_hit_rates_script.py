"""scripts/policy_hit_rates.py on a tiny generated trace: the table's shape on the engine's
tier model, its infinite ceiling, and the policy changes a cell."""

from __future__ import annotations

import importlib.util
import random
import sys
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType

import pytest

from ragcache_core.policy import POLICIES
from ragcache_core.trace import TraceRequest, load_trace, write_trace

SCRIPT = Path(__file__).resolve().parent.parent / "scripts" / "policy_hit_rates.py"


@pytest.fixture(autouse=True)
def policies_kept() -> Iterator[None]:
    """`main` registers `apgdsf` (adaptive_pgdsf.py) for its process: not for the suite's."""
    saved = dict(POLICIES)
    yield
    POLICIES.clear()
    POLICIES.update(saved)


def _script() -> ModuleType:
    spec = importlib.util.spec_from_file_location("policy_hit_rates", SCRIPT)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


def _trace(path: Path) -> Path:
    """A few hot documents, many cold ones: the policies part ways on it."""
    rng = random.Random(7)
    requests = []
    for i in range(160):
        hot = rng.random() < 0.5
        docs = [rng.randrange(6), rng.randrange(60)] if hot else rng.sample(range(60), 2)
        requests.append(
            TraceRequest(
                id=f"q{i}",
                arrival_s=i * 0.1,
                docs=tuple(str(d) for d in docs),
                doc_tokens=tuple(90 + 5 * d for d in docs),
                question_tokens=20,
            )
        )
    write_trace(path, requests)
    return path


def _rows(out: str) -> list[list[str]]:
    lines = [line for line in out.splitlines() if line.startswith("| ") and "(" in line]
    rows = [[c.strip() for c in line.strip("|").split("|")] for line in lines]
    return [row for row in rows if not row[0].startswith("host")]


@pytest.mark.parametrize("flags", [[], ["--host-write", "eviction"], ["--vllm-blocks", "40"]])
def test_table_shape(tmp_path: Path, capsys: pytest.CaptureFixture[str], flags: list[str]) -> None:
    script = _script()
    trace = _trace(tmp_path / "tiny.jsonl")
    script.main([str(trace), "--fractions", "0.05,0.2", *flags])
    out = capsys.readouterr().out
    rows = _rows(out)
    assert len(rows) == 2
    # the five fixed policies, the default (dgdsf, not one of them), then two more columns
    assert script.DEFAULT not in script.FIXED
    assert all(len(row) == 1 + len(script.FIXED) + 1 + 2 for row in rows)
    shares = [float(cell.rsplit("(", 1)[1].rstrip(")")) for cell in rows[0][1:6]]
    assert max(shares) == pytest.approx(1.0)
    assert "of the best fixed policy in every cell" in out
    assert "tier model: engine" in out


def test_the_infinite_ceiling_counts_a_document_after_the_same_documents() -> None:
    script = _script()

    def req(i: int, *docs: str) -> TraceRequest:
        return TraceRequest(str(i), float(i), docs, tuple(10 for _ in docs), 1)

    # a (miss), a b (a hit, b miss), b a (b after the root: miss, a after b: miss), a b (hits)
    ceiling = script.infinite_ceiling(
        [req(0, "a"), req(1, "a", "b"), req(2, "b", "a"), req(3, "a", "b")]
    )
    assert ceiling.doc_hit_rate == pytest.approx(3 / 7)
    assert ceiling.token_hit_rate == pytest.approx(3 / 7)


@pytest.mark.parametrize("host_write", ["compute", "eviction"])
def test_policy_changes_a_cell(tmp_path: Path, host_write: str) -> None:
    script = _script()
    requests = load_trace(_trace(tmp_path / "tiny.jsonl"))
    distinct = script.distinct_prefix_tokens(requests)
    rates = {
        policy: script.simulate_cell(
            requests, distinct // 100, distinct // 20, policy, 64, host_write=host_write
        ).doc_hit_rate
        for policy in script.FIXED
    }
    assert all(0.0 <= rate <= 1.0 for rate in rates.values())
    assert len(set(rates.values())) > 1
