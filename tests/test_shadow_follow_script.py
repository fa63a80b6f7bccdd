"""scripts/shadow_follow.py: a live cache that never switches is its starting policy exactly
(so the shadows and the follower share one tier model), and the chooser's switch rule."""

from __future__ import annotations

import importlib.util
import random
import sys
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType

import pytest

from ragcache_core.policy import POLICIES
from ragcache_core.trace import TraceRequest

SCRIPTS = Path(__file__).resolve().parent.parent / "scripts"


@pytest.fixture(autouse=True)
def _registry_restored() -> Iterator[None]:
    """`run_cell` registers each variant in the policy registry; leave it as it was."""
    saved = dict(POLICIES)
    yield
    POLICIES.clear()
    POLICIES.update(saved)


def _script() -> ModuleType:
    sys.path.insert(0, str(SCRIPTS))
    spec = importlib.util.spec_from_file_location("shadow_follow", SCRIPTS / "shadow_follow.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


def _requests() -> list[TraceRequest]:
    """Zipf-popular first documents, and a second one from a small set in a third of them."""
    rng = random.Random(0)
    requests = []
    for i in range(200):
        first = str(min(int(rng.paretovariate(1.0)), 30))
        second = f"x{rng.randrange(12)}"
        docs = (first,) if i % 3 else (first, second)
        requests.append(
            TraceRequest(
                id=f"q{i}",
                arrival_s=float(i),
                docs=docs,
                doc_tokens=(100,) * len(docs),
                question_tokens=20,
            )
        )
    return requests


@pytest.mark.parametrize("host_write", ["compute", "eviction"])
def test_a_follower_that_never_switches_is_its_starting_policy(host_write: str) -> None:
    script = _script()
    # z = 1e9: no lead is ever evidence enough, so each follower stays on its start.
    specs = [f"follow0.999m0z1000000000s{p}" for p in script.FIXED]
    fixed, live, switches = script.run_cell(_requests(), 300, 600, 64, host_write, specs)
    assert len(set(fixed.values())) > 1  # the tiny trace tells the policies apart
    for policy, spec in zip(script.FIXED, specs, strict=True):
        assert switches[spec] == 0
        assert live[spec] == pytest.approx(fixed[policy], abs=1e-12), (policy, live, fixed)


def test_the_chooser_switches_past_its_margin_only() -> None:
    script = _script()
    n = len(script.FIXED)
    chooser = script.Chooser("follow1m1.5")  # no decay; a lead must pass 1.5 x the current's
    assert chooser.update([1] * n, 0) == 0  # a tie keeps the current one
    lead = [0] * n
    lead[2] = 1
    assert chooser.update(lead, 0) == 0  # 2 against 1: a lead of 1, not past 1.5
    assert chooser.update(lead, 0) == 2  # 3 against 1: a lead of 2, past it
    with pytest.raises(SystemExit):
        script.Chooser("follow0.9q")
