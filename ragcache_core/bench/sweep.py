"""`ragcache bench serve`: every system over a ladder of Poisson rates, repeated, per workload.

For each workload:

1. light load: each system answers `light` requests one at a time (after `warmup` more that
   fill its cache); its light-load TTFT p95 and service time (arrival to last token);
2. the SLO is fixed before any loaded point: `slo_factor` x the reference baseline's light-load
   TTFT p95 (the reference is `vllm`, else the first system);
3. a geometric ladder of rates from `start_fraction / service time of the reference`, times
   `factor` per step, at most `max_points` steps. Every point runs `repeats` times, the order of
   the systems rotated at each repeat; a system whose p95 passes 10x its light-load p95 in
   every repeat is saturated and leaves the ladder; the ladder ends when every system has;
4. each system's sustained rate: the highest rate up to which every rate's p95 met the SLO in
   every repeat.

With `saturate=NAME` (`--saturate`, issue 39's "saturated" workloads) steps 3-4 change: a
ladder of NAME alone (one round per rate, from the same first rate, x`factor` per step, or
/`factor` per step when the first rate is already past it) finds
the rate at which NAME's mean TTFT is `SATURATED_TTFT` x its light-load mean TTFT (geometric
interpolation between the two rungs around it; `Saturation`), and every system is then
measured at that rate and at `SATURATED_OVER` x it, `repeats` rounds each, the same requests
for every system.

Ablations run at one rate only (the reference's sustained rate, else the ladder's first), each
measured beside its parent (`SystemSpec.parent`: `ragcache` for the RAGCache ablations, `vllm`
or `vllm-apc` for the connector-less baselines) in the same rounds, and compared with it.
One engine per system serves every point (its cache emptied before each point); warm-up
requests of every point are not measured.
"""

from __future__ import annotations

import asyncio
import datetime
import os
import subprocess
import time
from collections.abc import Callable, Coroutine, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, TextIO, TypeVar

from ragcache_core.bench.compare import compare, sustained
from ragcache_core.bench.saturation import (
    SATURATED_OVER,
    SATURATED_TTFT,
    Saturation,
    saturated_rate,
)
from ragcache_core.bench.serve import (
    SYSTEMS,
    PointRun,
    RAGCacheSystem,
    ServedSystem,
    identical_answers,
    light_load,
    run_point,
    start_system,
)
from ragcache_core.bench.workloads import Request, Workload
from ragcache_core.config import CacheConfig
from ragcache_core.retrieval.trace import poisson_arrivals
from ragcache_core.search import SearchSource

SATURATION_FACTOR = 10.0
"""A system is saturated when its TTFT p95 passes this multiple of its light-load p95."""
SCHEMA = "ragcache-bench-serve/2"
"""/2: comparisons name what they compare against (`against`, `spread_against_s`; /1 had
`spread_ragcache_s`), ablations are compared with their parent."""
COOL_DOWN_S = 1.5
"""Pause before every point: a vLLM worker busy-polls for ~1 s after its last step (measured),
which would slow the next system's first requests."""
T = TypeVar("T")


@dataclass(frozen=True)
class Mode:
    """How much to measure (see `MODES`)."""

    name: str
    warmup: int
    requests: int
    repeats: int
    light: int
    factor: float
    max_points: int
    start_fraction: float
    workloads: tuple[str, ...]
    systems: tuple[str, ...]
    ablations: tuple[str, ...]
    slo_factor: float = 5.0
    warmup_concurrency: int = 4
    """Warm-up requests are sent this many at a time (a closed loop), then the measured ones
    as a Poisson stream (`run_point`); 0 sends the warm-up in the stream too."""


MODES = {
    # Tests: the tiny model, a few requests per system at one fixed rate, no sweep.
    "smoke": Mode(
        "smoke", 1, 3, 1, 0, 1.0, 1, 0.0, ("demo",), ("vllm", "vllm-apc", "ragcache"), ()
    ),
    # Real figures in under 10 minutes: the demo's stream (documents dominate the prompt, the
    # working set is larger than vLLM-APC's "GPU" KV), four systems, two rates, 2 repeats;
    # each point first warms the caches with 60 requests (4 at a time, not measured).
    "quick": Mode(
        "quick",
        60,
        20,
        2,
        3,
        2.0,
        2,
        1.0,
        ("demo",),
        ("vllm", "vllm-apc", "vllm-apc-total", "ragcache"),
        (),
    ),
    # The sweep, about 1.7 hours here (FULL_ESTIMATE): the 458-chunk stream shuffled, the
    # short documents and the no-reuse stream, four systems (two on `noreuse`: COMPARED), up
    # to three rates, 3 repeats; five ablations on the first workload. By name only: `demo`
    # (a 46-chunk part of `long-shuffled`: --quick's stream), `long` (in dataset order the
    # working set fits every cache: all tie, measured in docs/benchmarks.md) and
    # `vllm-apc-noconn` (it showed what `vllm-noconn` shows).
    "full": Mode(
        "full",
        80,
        24,
        3,
        4,
        2.0,
        3,
        0.5,
        ("long-shuffled", "short", "noreuse"),
        ("vllm", "vllm-apc", "vllm-apc-total", "ragcache"),
        (
            "ragcache-nohost",
            "ragcache-lru",
            "ragcache-noreorder",
            "ragcache-nospec",
            "vllm-noconn",
        ),
    ),
}
FULL_ESTIMATE = (
    "about 1.7 hours on the 2-core machine, from its parts measured there with the full mode's"
    " settings: long-shuffled 36 min, short 18, noreuse 16, the ablations ~28"
    " (docs/benchmarks.md)"
)


COMPARED = {
    "noreuse": ("vllm", "ragcache"),
    "long": ("vllm", "vllm-apc", "ragcache"),
}
"""Workloads whose question needs only some of a mode's systems (applied to a mode's own
systems, never to systems the user named: `workload_systems`). `noreuse`: nothing is reused,
so no prefix cache to compare, only RAGCache's cost against plain vLLM. `long`: in dataset
order the working set (~16 chunks per point) fits vLLM-APC's KV, so more memory changes
nothing (measured: vllm-apc and vllm-apc-total 84% token hits both)."""


def workload_systems(mode: Mode, workload: str, named: bool) -> tuple[str, ...]:
    """The systems that run `workload`: all of `mode.systems` when the user `named` them,
    else those `COMPARED` keeps (all when it keeps none of them)."""
    keep = COMPARED.get(workload)
    if named or keep is None:
        return mode.systems
    return tuple(n for n in mode.systems if n in keep) or mode.systems


def ablation_groups(ablations: Sequence[str], size: int = 2) -> list[list[str]]:
    """The ablations in groups of at most `size` that share a parent, in the given order (each
    group's engines are alive at once, beside its parent)."""
    groups: list[list[str]] = []
    for name in ablations:
        last = groups[-1] if groups else None
        if last and len(last) < size and SYSTEMS[last[0]].parent == SYSTEMS[name].parent:
            last.append(name)
        else:
            groups.append([name])
    return groups


def ablation_parents(ablations: Sequence[str]) -> list[str]:
    """The systems the ablations are measured beside, in a stable order."""
    return list(dict.fromkeys(str(SYSTEMS[n].parent) for n in ablations))


class Engines:
    """The started systems and the one event loop they are used from (vLLM's async engine
    binds to the loop that first uses it, so every point runs on this loop)."""

    def __init__(self, model: str | Path, config: CacheConfig, log: TextIO) -> None:
        self.model, self.config, self.log = model, config, log
        self.loop = asyncio.new_event_loop()
        self.systems: dict[str, ServedSystem] = {}

    def run(self, coro: Coroutine[Any, Any, T]) -> T:
        return self.loop.run_until_complete(coro)

    def start(self, names: Sequence[str], source: SearchSource | None) -> None:
        """Start the systems not started yet (outside the loop: start is blocking)."""
        for name in names:
            if name in self.systems:
                continue
            print(f"starting {name} ...", file=self.log, flush=True)
            self.systems[name] = start_system(name, self.model, self.config, source)
            print(f"{name}: engine started in {self.systems[name].start_s:.0f} s", file=self.log)

    def use(self, source: SearchSource | None, top_k: int) -> None:
        for system in self.systems.values():
            system.use(source, top_k)

    def stop(self, names: Sequence[str]) -> None:
        for name in names:
            system = self.systems.pop(name, None)
            if system is not None:
                self.run(system.aclose())

    def close(self) -> None:
        try:
            self.stop(list(self.systems))
        finally:
            self.loop.close()


Recorder = Callable[[str, int], Callable[[int], None]]
"""(label, total requests) -> a progress callback (a tqdm bar in the CLI)."""


@dataclass
class WorkloadResult:
    """Everything measured on one workload."""

    workload: Workload
    light: dict[str, PointRun]
    slo_s: float
    reference: str
    rates: list[float]
    points: list[dict[str, Any]]
    answers: list[dict[str, Any]]
    saturation: Saturation | None = None

    def to_json(self) -> dict[str, Any]:
        light = {n: _light_summary(r) for n, r in self.light.items()}
        return {
            "saturation": asdict(self.saturation) if self.saturation else None,
            "name": self.workload.name,
            "description": self.workload.description,
            "retriever": self.workload.retriever
            if self.workload.retrieves
            else "none (requests bring documents)",
            "documents": len(self.workload.documents),
            "top_k": self.workload.top_k,
            "light_load": light,
            "slo_s": self.slo_s,
            "slo_rule": f"{MODES_SLO_TEXT} (reference: {self.reference})",
            "rates_rps": self.rates,
            "points": self.points,
            "answers": self.answers,
            "sustained": sustained(self.points, self.slo_s),
            "comparisons": compare(self.points),
        }


MODES_SLO_TEXT = "SLO = slo_factor x the reference's light-load TTFT p95, fixed before the sweep"


def _light_summary(run: PointRun) -> dict[str, Any]:
    summary = run.summary()
    measured = run.measured
    summary["service_s"] = sum(o.latency_s for o in measured) / max(1, len(measured))
    summary.pop("throughput_rps", None)
    return summary


def sweep_workload(
    engines: Engines,
    workload: Workload,
    source: SearchSource | None,
    mode: Mode,
    systems: Sequence[str],
    seed: int,
    bar: Recorder,
    fixed_rate: float | None = None,
    saturate: str | None = None,
) -> WorkloadResult:
    """The light-load calibration and the rate ladder of one workload, or with `saturate` the
    saturated rate of that system and every system there and at 1.5x it (see the module
    doc)."""
    engines.use(source, workload.top_k)
    light = {n: _light(engines, n, workload, mode) for n in systems} if mode.light else {}
    reference = "vllm" if "vllm" in systems else systems[0]
    slo = mode.slo_factor * light[reference].summary()["ttft_p95_s"] if light else 0.0
    if fixed_rate is not None:
        rate0 = fixed_rate
    else:
        service = _light_summary(light[reference])["service_s"]
        rate0 = round(mode.start_fraction / service, 2)
    print(
        f"{workload.name}: SLO {slo * 1000:.0f} ms (fixed before the sweep), first rate "
        f"{rate0:.2f}/s, x{mode.factor} per step, at most {mode.max_points} steps",
        file=engines.log,
        flush=True,
    )
    result = WorkloadResult(workload, light, slo, reference, [], [], [])
    if saturate is not None:
        saturation = _find_saturation(engines, workload, mode, saturate, rate0, seed, bar, light)
        print(saturation.line(), file=engines.log, flush=True)
        rate = saturation.rate_rps or saturation.ladder[-1][0]
        result.saturation = saturation
        for step, at in enumerate((rate, round(rate * SATURATED_OVER, 3))):
            result.rates.append(at)
            _rounds(engines, workload, mode, systems, at, seed, step, bar, result)
        return result
    active = list(systems)
    for step in range(mode.max_points):
        if not active:
            break
        rate = round(rate0 * mode.factor**step, 3)
        result.rates.append(rate)
        runs = _rounds(engines, workload, mode, active, rate, seed, step, bar, result)
        active = [n for n in active if not _saturated(runs[n], light.get(n))]
    return result


def _find_saturation(
    engines: Engines,
    workload: Workload,
    mode: Mode,
    name: str,
    rate0: float,
    seed: int,
    bar: Recorder,
    light: dict[str, PointRun],
) -> Saturation:
    """A ladder of `name` alone, one round per rate, up to the rung whose mean TTFT passes
    `SATURATED_TTFT` x its light-load mean (at most `mode.max_points` rungs past the first);
    when the first rung is already past it, down from there instead (/`mode.factor` per rung,
    at most `mode.max_points` rungs) to the first below, so that the rate is interpolated, not
    the first rung's. The rungs are not points of the result (only the rates found are
    measured, by every system)."""
    if name not in light:
        raise ValueError(f"--saturate {name}: it needs {name}'s light-load run (mode.light > 0)")
    light_mean = light[name].summary()["ttft_mean_s"]
    limit = SATURATED_TTFT * light_mean
    one = Mode(**(asdict(mode) | {"repeats": 1}))
    scratch = WorkloadResult(workload, {}, 0.0, name, [], [], [])
    ladder: list[tuple[float, float]] = []

    def rung(rate: float) -> tuple[float, float]:
        runs = _rounds(engines, workload, one, [name], rate, seed, len(ladder), bar, scratch)
        return rate, runs[name][0].summary()["ttft_mean_s"]

    for step in range(max(2, mode.max_points + 1)):
        ladder.append(rung(round(rate0 * mode.factor**step, 3)))
        if ladder[-1][1] >= limit:
            break
    for step in range(1, mode.max_points + 1):
        if ladder[0][1] < limit:
            break
        ladder.insert(0, rung(round(rate0 / mode.factor**step, 3)))
    return Saturation(name, light_mean, ladder, saturated_rate(ladder, limit))


def _light(engines: Engines, name: str, workload: Workload, mode: Mode) -> PointRun:
    requests = workload.stream(mode.warmup + mode.light)
    return engines.run(
        light_load(
            engines.systems[name],
            requests,
            mode.warmup,
            "light",
            warmup_concurrency=mode.warmup_concurrency,
        )
    )


def _rounds(
    engines: Engines,
    workload: Workload,
    mode: Mode,
    systems: Sequence[str],
    rate: float,
    seed: int,
    step: int,
    bar: Recorder,
    result: WorkloadResult,
) -> dict[str, list[PointRun]]:
    """`mode.repeats` rounds at one rate; each round sends the same stream (same questions, same
    arrivals: the rounds measure the machine's noise, not the stream's) to every system, in an
    order rotated from round to round."""
    requests = workload.stream(mode.warmup + mode.requests)
    arrivals = [float(x) for x in poisson_arrivals(len(requests), rate, seed)]
    runs: dict[str, list[PointRun]] = {n: [] for n in systems}
    for repeat in range(mode.repeats):
        shift = (step * mode.repeats + repeat) % len(systems)
        order = [*systems[shift:], *systems[:shift]]
        round_runs = []
        for position, name in enumerate(order):
            label = f"{workload.name} {rate:.2f}/s #{repeat + 1} {name}"
            tag = f"{workload.name}-{step}-{repeat}"
            time.sleep(COOL_DOWN_S)
            load_before = machine_load()
            run = engines.run(
                run_point(
                    engines.systems[name],
                    requests,
                    arrivals,
                    rate,
                    mode.warmup,
                    tag,
                    bar(label, len(requests)),
                    warmup_concurrency=mode.warmup_concurrency,
                )
            )
            summary = run.summary() | {
                "repeat": repeat,
                "position": position,
                "load_avg_1m": [load_before, machine_load()],
            }
            result.points.append(summary)
            runs[name].append(run)
            round_runs.append(run)
            print(_point_line(label, summary), file=engines.log, flush=True)
        same, total = identical_answers(round_runs)
        compared = sum(not reorders(r.system) for r in round_runs)
        result.answers.append(
            {
                "rate_rps": rate,
                "repeat": repeat,
                "identical": same,
                "requests": total,
                "systems": compared,
            }
        )
        for run in round_runs:
            if reorders(run.system):
                result.answers.append(_checked_order(engines, run, requests, rate, repeat))
    return runs


def reorders(name: str) -> bool:
    """The system serves documents in cache order (its prompts are not the others')."""
    return SYSTEMS[name].changes.get("document_order") == "cache"


def _checked_order(
    engines: Engines, run: PointRun, requests: Sequence[Request], rate: float, repeat: int
) -> dict[str, Any]:
    """A reordering system's answers against plain vLLM on the same ordered prompts (every
    request of the round, warm-up included, as `identical_answers` counts)."""
    system = engines.systems[run.system]
    assert isinstance(system, RAGCacheSystem)
    same, total = engines.run(system.same_as_plain_vllm(requests, run.outcomes))
    reordered = sum(o.reordered for o in run.outcomes)
    line = (
        f"{run.system} at {rate:.2f}/s #{repeat + 1}: answers equal plain vLLM's on the same "
        f"ordered prompts {same}/{total} ({reordered} served out of retrieval order)"
    )
    print(line, file=engines.log, flush=True)
    return {
        "rate_rps": rate,
        "repeat": repeat,
        "system": run.system,
        "same_as_plain_vllm": same,
        "requests": total,
        "reordered": reordered,
    }


def _point_line(label: str, s: dict[str, Any]) -> str:
    return (
        f"{label}: TTFT mean {s['ttft_mean_s'] * 1000:.0f} ms, "
        f"p95 {s['ttft_p95_s'] * 1000:.0f} ms, "
        f"{s['throughput_rps']:.2f} req/s, token hits {s['token_hit_rate'] * 100:.0f}%"
        f"{load_note(s)}"
    )


def machine_load() -> float:
    """The machine's 1-minute load average (runnable processes, all users): read before and
    after each point, so that a disturbed round shows rather than being dropped."""
    return os.getloadavg()[0]


def load_note(summary: dict[str, Any]) -> str:
    """`, load 1.2->3.4` for a point line (empty for a point without the record)."""
    load = summary.get("load_avg_1m")
    return f", load {load[0]:.1f}->{load[1]:.1f}" if load else ""


def _saturated(runs: Sequence[PointRun], light: PointRun | None) -> bool:
    """Past 10x the light-load p95 in every repeat: one stalled repeat does not end a system's
    ladder (it still shows in the spread)."""
    if light is None:
        return False
    limit = SATURATION_FACTOR * light.summary()["ttft_p95_s"]
    return all(r.summary()["ttft_p95_s"] > limit for r in runs)


def ablation_rate(result: WorkloadResult) -> float:
    """The rate the ablations run at: the reference's sustained rate, else the first rate."""
    best = sustained(result.points, result.slo_s).get(result.reference)
    return best["rate_rps"] if best else result.rates[0]


def run_ablations(
    engines: Engines,
    workload: Workload,
    source: SearchSource | None,
    mode: Mode,
    ablations: Sequence[str],
    rate: float,
    seed: int,
    bar: Recorder,
) -> dict[str, Any]:
    """Each ablation at one rate, in `ablation_groups` (their engines alive at once: memory),
    each group in the same rounds as its parent, and compared with it."""
    result = WorkloadResult(workload, {}, 0.0, "vllm", [rate], [], [])
    one_rate = Mode(**(asdict(mode) | {"max_points": 1, "light": 0}))
    for names in ablation_groups(ablations):
        parents = ablation_parents(names)
        engines.start([*parents, *names], source)
        engines.use(source, workload.top_k)
        _rounds(engines, workload, one_rate, [*parents, *names], rate, seed, 0, bar, result)
        engines.stop(names)
    return {
        "workload": workload.name,
        "rate_rps": rate,
        "points": result.points,
        "answers": result.answers,
        "comparisons": compare_ablations(result.points),
    }


def compare_ablations(points: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
    """Each ablation against its parent (`compare`: ablation / parent; above 1 the ablation is
    slower)."""
    names = sorted({p["system"] for p in points if SYSTEMS[p["system"]].ablation})
    rows = []
    for parent in ablation_parents(names):
        children = [n for n in names if SYSTEMS[n].parent == parent]
        rows += compare(points, target=parent, others=children)
    return rows


def git_commit() -> str:
    """The checkout's commit (short), "+dirty" when the working tree has changes."""
    root = Path(__file__).resolve().parents[2]
    try:
        commit = subprocess.run(
            ["git", "-C", str(root), "log", "-1", "--format=%h"],
            capture_output=True,
            text=True,
            check=True,
        ).stdout.strip()
        dirty = subprocess.run(
            ["git", "-C", str(root), "status", "--porcelain", "--untracked-files=no"],
            capture_output=True,
            text=True,
            check=True,
        ).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown"
    return commit + ("+dirty" if dirty else "")


def now_utc() -> str:
    return datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


def describe_systems(names: Sequence[str]) -> dict[str, str]:
    return {n: SYSTEMS[n].what for n in names}
