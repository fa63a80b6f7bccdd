"""scripts/drift_traces.py: the drifting traces the policy table judges DGDSF on."""

from __future__ import annotations

import importlib.util
import subprocess
import sys
from pathlib import Path
from types import ModuleType

from ragcache_core.trace import TraceRequest, load_trace, write_trace

SCRIPT = Path(__file__).resolve().parent.parent / "scripts" / "drift_traces.py"


def _script() -> ModuleType:
    spec = importlib.util.spec_from_file_location("drift_traces", SCRIPT)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _stream(prefix: str, n: int) -> list[TraceRequest]:
    return [
        TraceRequest(
            f"{prefix}{i}", i * 0.3, (f"{prefix}:{i % 5}", f"{prefix}:{i % 7}"), (10 + i % 5, 20), 8
        )
        for i in range(n)
    ]


def test_each_third_of_nq_gets_documents_of_its_own_and_mmlu_follows_nq(tmp_path: Path) -> None:
    nq, mmlu = _stream("nq", 30), _stream("mm", 12)
    write_trace(tmp_path / "nq_top2.jsonl", nq)
    write_trace(tmp_path / "mmlu_top2.jsonl", mmlu)
    out = tmp_path / "out"
    subprocess.run([sys.executable, str(SCRIPT), str(tmp_path), "--out", str(out)], check=True)
    three = load_trace(out / "drift_nq3.jsonl")
    assert len(three) == 30
    parts = [{d for r in three[i * 10 : (i + 1) * 10] for d in r.docs} for i in range(3)]
    assert not (parts[0] & parts[1]) and not (parts[1] & parts[2]) and not (parts[0] & parts[2])
    for ours, theirs in zip(three, nq, strict=True):  # the same pattern and sizes, renamed
        assert [d.rsplit("#", 1)[0] for d in ours.docs] == list(theirs.docs)
        assert ours.doc_tokens == theirs.doc_tokens and ours.question_tokens == 8
    mixed = load_trace(out / "drift_nq_mmlu.jsonl")
    assert [r.docs for r in mixed] == [r.docs for r in nq + mmlu]
    assert [r.arrival_s for r in mixed] == [0.5 * (i + 1) for i in range(42)]
    assert len({r.id for r in mixed}) == 42


def test_renamed_keeps_sizes_and_changes_every_id() -> None:
    module = _script()
    requests = _stream("x", 4)
    out = module.renamed(requests, 2)
    assert all(d.endswith("#2") for r in out for d in r.docs)
    assert [r.doc_tokens for r in out] == [r.doc_tokens for r in requests]
