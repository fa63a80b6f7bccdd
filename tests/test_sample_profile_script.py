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
    time.sleep(0.5)  # the sampler's last flush


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
    # The child was busy in it: most of its busy samples pass through the function's frame.
    header = child[0].splitlines()[0]  # "<pid> (driver): N busy samples of M"
    busy = int(header.split("): ")[1].split()[0])
    assert busy >= 20, header
