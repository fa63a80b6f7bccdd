"""scripts/sample_profile: the sampler reaches a spawned child (as vLLM spawns its engine core
and workers) and the report names the busy function in it."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

SCRIPTS = Path(__file__).resolve().parents[1] / "scripts"

CHILD = """
import multiprocessing
import time


def burn_in_child() -> None:
    end = time.monotonic() + 1.5
    while time.monotonic() < end:
        sum(range(10_000))


if __name__ == "__main__":
    process = multiprocessing.get_context("spawn").Process(target=burn_in_child)
    process.start()
    process.join()
"""


def test_a_spawned_childs_busy_function_is_reported(tmp_path: Path) -> None:
    script = tmp_path / "parent.py"
    script.write_text(CHILD)
    samples = tmp_path / "samples"
    env = {
        **os.environ,
        "PYTHONPATH": str(SCRIPTS / "sample_profile"),
        "RAGCACHE_SAMPLE_DIR": str(samples),
        "RAGCACHE_SAMPLE_FLUSH_S": "0.2",
    }
    subprocess.run([sys.executable, str(script)], env=env, check=True, timeout=60)
    files = list(samples.glob("*.txt"))
    assert len(files) >= 2, files  # the parent and its spawned child
    report = subprocess.run(
        [sys.executable, str(SCRIPTS / "sample_profile_report.py"), str(samples)],
        capture_output=True,
        text=True,
        check=True,
        timeout=60,
    ).stdout
    child = [part for part in report.split("pid ") if "burn_in_child" in part]
    assert child, report
    # The child was busy in it: its busy samples (1.5 s at 10 ms) end in the function's frame.
    lines = child[0].splitlines()
    busy = int(lines[0].split("): ")[1].split()[0])  # "<pid> (driver): N busy samples of M"
    assert busy >= 20, lines[0]
    top_leaf = lines[lines.index("  top leaf frames:") + 1]
    assert "burn_in_child" in top_leaf and int(top_leaf.split()[0]) >= busy / 2, lines
