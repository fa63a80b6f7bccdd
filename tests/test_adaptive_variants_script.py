"""scripts/adaptive_variants.py: the spec grammar, a shadow cache's hits, the dueling between
paces on a stream whose hot set moves, and the table on a tiny trace."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from types import ModuleType

import pytest

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
    duel, age, lrfu = _script().variants("duel0.99m0.05fp0_0.1,age0.25,lrfu0.01")
    assert (duel.DECAY, duel.MARGIN, duel.NODE_FREQUENCY, duel.PACES) == (
        0.99,
        0.05,
        True,
        (0.0, 0.1),
    )
    assert age.PACE == 0.25 and lrfu.LAMBDA == 0.01
    plain = _script().variants("duel0.999")[0]
    assert (plain.MARGIN, plain.NODE_FREQUENCY) == (0.0, False)


def test_shadow_holds_what_fits_and_counts_hits() -> None:
    shadow = _script()._Shadow(0.0)
    shadow.reference("a", 60, 0, 100, 1.0)
    shadow.reference("b", 60, 0, 100, 1.0)  # a and b tie; the older, a, goes
    assert set(shadow.entries) == {"b"} and shadow.hits == 0.0
    shadow.reference("b", 60, 0, 100, 1.0)
    assert shadow.hits == 1.0 and shadow.entries["b"][1] == 2


def test_aging_shadow_wins_when_the_hot_set_moves() -> None:
    """A key hot once, then two keys taking turns in room for two: without aging the old
    hot key stays and the new ones miss; with aging they hit."""
    script = _script()
    shadows = [script._Shadow(0.0), script._Shadow(1.0)]
    stream = ["old"] * 20 + ["x", "y"] * 40
    for key in stream:
        for shadow in shadows:
            shadow.reference(key, 10, 0, 20, 1.0)
    still, aged = shadows
    assert "old" in still.entries and "old" not in aged.entries
    assert still.hits == 19.0  # only the old key's own repeats
    assert aged.hits > still.hits + 30


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
    argv = ["adaptive_variants.py", str(trace), "--variants", "age0,duel0.999m0f"]
    sys_argv, sys.argv = sys.argv, argv
    try:
        _script().main()
    finally:
        sys.argv = sys_argv
    out = capsys.readouterr().out
    rows = [line for line in out.splitlines() if line.startswith("| tiny")]
    assert len(rows) == 5
    assert "duel0.999m0f on held-out traces" in out
