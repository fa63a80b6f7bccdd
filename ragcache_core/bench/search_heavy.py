"""`ragcache bench serve --workloads search-heavy`: speculative pipelining's ablation on a
knowledge base whose search costs what a real one does (the paper's Table 3).

    knowledge base  the real documents padded with synthetic vectors to 1M+ rows: IVF, 1,024
                    lists, 8-bit codes (`retrieval.padded`); built once, cached under
                    $RAGCACHE_HOME/indexes keyed by its settings
    core split      search and the app on one core, vLLM on the other (`bench.cores`), the
                    same for every system
    per search ratio (the share of the lists probed), highest first:
      light load    every system, `repeats` rounds, order rotated: W warm-up requests (4 at a
                    time), then L one at a time; vllm's gives search's share of its TTFT
      Poisson load  ragcache and ragcache-nospec, `repeats` rounds, order rotated, at one rate
                    for every ratio (`start_fraction` / vllm's light-load service time at the
                    highest ratio, unless --rate); none with --light-only
    reported        mean TTFT and non-overlapped search time (the search time an answer waited
                    for: all of it without speculation, the part before the adopted
                    speculation started with it) with min..max spreads; search time per stage,
                    how often an intermediate top-k was the final one, the aborted speculative
                    work, the synthetic rows that reached a top-k (dropped from the prompt) and
                    recall against exact search
"""

from __future__ import annotations

import argparse
import contextlib
import hashlib
import json
import os
import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any, TextIO

from ragcache_core.bench.cores import CoreSplit
from ragcache_core.bench.search_heavy_report import (
    NOSPEC,
    SPEC,
    VLLM,
    compare_key,
    of_systems,
    outcome_stats,
    point_line,
    pool_search,
    search_stats,
)
from ragcache_core.bench.serve import (
    PointRun,
    RAGCacheSystem,
    ServedSystem,
    identical_answers,
    light_load,
    run_point,
)
from ragcache_core.bench.sweep import (
    COOL_DOWN_S,
    Engines,
    Recorder,
    describe_systems,
    machine_load,
)
from ragcache_core.bench.workloads import Request, Workload, load_workload
from ragcache_core.errors import ConfigError
from ragcache_core.retrieval.embedder import EmbedderConfig
from ragcache_core.retrieval.padded import PaddedIndex, PaddedSettings, PaddedSource
from ragcache_core.retrieval.trace import poisson_arrivals

NAME = "search-heavy"
SCHEMA = "ragcache-bench-search-heavy/1"


@dataclass(frozen=True)
class HeavyMode:
    """How much the search-heavy ablation measures (see `HEAVY_MODES`)."""

    documents: str
    """The workload whose documents and questions are used (`bench.workloads`)."""
    index: PaddedSettings
    ratios: tuple[float, ...]
    stages: int
    """Stages per search (equal shares of the probed lists): a speculation can start after
    the first, at 1/stages of the search."""
    systems: tuple[str, ...]
    warmup: int
    requests: int
    """Measured requests of each Poisson point (0: light load only, `--light-only`)."""
    light: int
    repeats: int
    start_fraction: float
    rate: float | None = None


HEAVY_MODES = {
    # Tests: the shipped 300 documents padded to 20,000 rows, the tiny model, two ratios.
    "smoke": HeavyMode(
        "demo-short",
        PaddedSettings(
            vectors=20_000, nlist=64, train_points=4_096, embedder=EmbedderConfig(dimension=32)
        ),
        (0.5, 1.0),
        4,
        (SPEC, NOSPEC),
        1,
        3,
        2,
        1,
        1.0,
        4.0,
    ),
    # The ablation (docs/benchmarks.md, "Search-heavy"): 12,100 real documents padded to
    # 3,000,000 rows of 512 dimensions, 8-bit codes (1.43 GiB), the paper's 1,024 lists and
    # four search ratios, 3 rounds. Sized from measurements on one core each: a full scan
    # reads ~4.7 GB/s of codes (1.5M rows: 165 ms), vLLM's light-load prefill of these
    # ~500-token prompts takes ~230-270 ms, so a full search (~330 ms) is over half of vLLM's
    # light-load TTFT.
    "full": HeavyMode(
        "short",
        PaddedSettings(
            vectors=3_000_000,
            nlist=1024,
            codes="sq8",
            train_points=65_536,
            embedder=EmbedderConfig(dimension=512),
        ),
        (0.125, 0.25, 0.5, 1.0),
        4,
        (VLLM, SPEC, NOSPEC),
        40,
        24,
        12,
        3,
        0.5,
    ),
}
HEAVY_MODES["quick"] = replace(HEAVY_MODES["full"], ratios=(0.25, 1.0), repeats=2)


def resolve(mode_name: str, args: argparse.Namespace) -> HeavyMode:
    """The mode's settings with the command line's overrides. Raises `ConfigError`."""
    heavy = HEAVY_MODES[mode_name]
    changes: dict[str, Any] = {}
    for name in ("warmup", "requests", "repeats", "rate"):
        if getattr(args, name, None) is not None:
            changes[name] = getattr(args, name)
    if getattr(args, "light_only", False):
        changes["requests"] = 0
    if getattr(args, "systems", None):
        changes["systems"] = tuple(n.strip() for n in args.systems.split(",") if n.strip())
    if getattr(args, "search_ratios", None):
        changes["ratios"] = _ratios(args.search_ratios)
    if getattr(args, "search_stages", None) is not None:
        changes["stages"] = args.search_stages
    index_changes = {
        key: getattr(args, arg)
        for key, arg in (("vectors", "kb_vectors"), ("nlist", "kb_nlist"))
        if getattr(args, arg, None) is not None
    }
    if getattr(args, "kb_codes", None) is not None:
        index_changes["codes"] = args.kb_codes
    if getattr(args, "kb_dimension", None) is not None:
        index_changes["embedder"] = EmbedderConfig(dimension=args.kb_dimension)
    if index_changes:
        changes["index"] = replace(heavy.index, **index_changes)
    heavy = replace(heavy, **changes)
    unknown = set(heavy.systems) - {VLLM, SPEC, NOSPEC}
    if unknown or not {SPEC, NOSPEC} <= set(heavy.systems):
        raise ConfigError(f"{NAME} compares {SPEC} with {NOSPEC} (and {VLLM}); got {heavy.systems}")
    if heavy.stages < 2:
        raise ConfigError("--search-stages must be at least 2 (one stage cannot speculate)")
    return heavy


def _ratios(text: str) -> tuple[float, ...]:
    try:
        values = tuple(float(v) for v in text.split(",") if v.strip())
    except ValueError as exc:
        raise ConfigError(f"--search-ratios takes numbers in (0, 1], got {text!r}") from exc
    if not values or any(not 0 < v <= 1 for v in values):
        raise ConfigError(f"--search-ratios takes numbers in (0, 1], got {text!r}")
    return values


def index_home() -> Path:
    """Where padded indexes are cached: `$RAGCACHE_HOME/indexes`."""
    home = Path(os.environ.get("RAGCACHE_HOME", Path.home() / ".cache" / "ragcache"))
    return home / "indexes"


# --------------------------------------------------------------------------- running


@dataclass
class Bench:
    """What every point of the ablation shares."""

    engines: Engines
    kb: PaddedIndex
    heavy: HeavyMode
    workload: Workload
    split: CoreSplit | None
    exact: dict[str, tuple[int, ...]]
    bar: Recorder
    log: TextIO

    def source(self, ratio: float) -> PaddedSource:
        prepare = self.split.pin_search_thread if self.split else None
        return self.kb.source(ratio, self.heavy.stages, prepare_thread=prepare)


def _counters(system: ServedSystem) -> dict[str, Any]:
    return system.counters() if isinstance(system, RAGCacheSystem) else {}


def _point(
    bench: Bench,
    source: PaddedSource,
    name: str,
    load: float,
    repeat: int,
    position: int,
    tag: str,
) -> tuple[PointRun, dict[str, Any]]:
    """One system's pass: light load (`load` 0) or a Poisson stream at `load` requests/s."""
    heavy, system = bench.heavy, bench.engines.systems[name]
    time.sleep(COOL_DOWN_S)
    source.log.take()
    load_before = machine_load()
    if load == 0.0:
        requests = bench.workload.stream(heavy.warmup + heavy.light)
        run = bench.engines.run(
            light_load(system, requests, heavy.warmup, tag, warmup_concurrency=4)
        )
    else:
        requests = bench.workload.stream(heavy.warmup + heavy.requests)
        arrivals = [float(x) for x in poisson_arrivals(len(requests), load, 0)]
        label = f"{tag} {name}"
        run = bench.engines.run(
            run_point(
                system,
                requests,
                arrivals,
                load,
                heavy.warmup,
                tag,
                bench.bar(label, len(requests)),
                warmup_concurrency=4,
            )
        )
    records = source.log.take()
    summary = {
        "system": name,
        "rate_rps": load,
        "repeat": repeat,
        "position": position,
        **outcome_stats(run.measured),
        "counters_with_warmup": _counters(system),
        "search": search_stats(records, bench.exact, bench.workload.top_k),
        "load_avg_1m": [load_before, machine_load()],
    }
    print(point_line(tag, summary), file=bench.log, flush=True)
    return run, summary


def _rounds(
    bench: Bench, source: PaddedSource, systems: Sequence[str], load: float, label: str
) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """`repeats` rounds of one load, the systems' order rotated each round; (points,
    answers: per round, the requests every system answered with the same tokens)."""
    points, answers = [], []
    for repeat in range(bench.heavy.repeats):
        shift = repeat % len(systems)
        order = [*systems[shift:], *systems[:shift]]
        runs = []
        for position, name in enumerate(order):
            tag = f"{label} #{repeat + 1}"
            run, summary = _point(bench, source, name, load, repeat, position, tag)
            points.append(summary)
            runs.append(run)
        same, total = identical_answers(runs)
        answers.append({"repeat": repeat, "identical": same, "requests": total})
    return points, answers


def _ratio(bench: Bench, ratio: float, rate: float | None) -> dict[str, Any]:
    """Every load of one search ratio; the rate is calibrated here when None."""
    source = bench.source(ratio)
    bench.engines.use(source, bench.workload.top_k)
    staged = source.staged
    label = f"{NAME} {ratio * 100:g}%"
    source.log.take()
    light, light_answers = _rounds(bench, source, bench.heavy.systems, 0.0, f"{label} light")
    reference = VLLM if VLLM in bench.heavy.systems else NOSPEC
    ref_points = [p for p in light if p["system"] == reference]
    ttft = statistics.median(p["ttft_mean_s"] for p in ref_points)
    search = statistics.median(p["search_mean_s"] for p in ref_points)
    if rate is None:
        service = statistics.median(p["service_mean_s"] for p in ref_points)
        rate = round(bench.heavy.start_fraction / service, 2)
    loaded: list[dict[str, Any]] = []
    part: dict[str, Any] | None = None
    if bench.heavy.requests > 0:  # --requests 0: light load only
        loaded, answers = _rounds(bench, source, (SPEC, NOSPEC), rate, f"{label} {rate:.2f}/s")
        part = {
            "rate_rps": rate,
            "points": loaded,
            "answers": answers,
            "ttft": compare_key(loaded, "ttft_mean_s"),
            "non_overlapped": compare_key(loaded, "non_overlapped_search_mean_s"),
        }
    records_all = [p["search"] for p in light + loaded]
    return {
        "ratio": ratio,
        "nprobe": staged.nprobe,
        "lists_per_stage": getattr(staged.sizing, "lists", None),
        "reference": reference,
        "reference_light_ttft_mean_s": ttft,
        "reference_light_search_mean_s": search,
        "search_share_of_reference_ttft": search / ttft if ttft > 0 else 0.0,
        "light": {
            "points": light,
            "answers": light_answers,
            "ttft": compare_key(of_systems(light, (SPEC, NOSPEC)), "ttft_mean_s"),
            "non_overlapped": compare_key(
                of_systems(light, (SPEC, NOSPEC)), "non_overlapped_search_mean_s"
            ),
        },
        "loaded": part,
        "searches": pool_search(records_all),
    }


def load_heavy_workload(
    heavy: HeavyMode,
    count_tokens: Any,
    seed: int,
    top_k: int | None,
    data_dir: Path | None = None,
) -> Workload:
    """The documents and questions of `heavy.documents`, named and described as this one
    (`data_dir`: the benchmark data folder, as `load_workload` takes it)."""
    base = load_workload(heavy.documents, count_tokens, seed=seed, top_k=top_k, data_dir=data_dir)
    return replace(
        base,
        name=NAME,
        description=f"{base.description}; the index padded "
        f"to {heavy.index.vectors:,} rows with synthetic vectors (see knowledge_base)",
    )


def exact_answers(
    kb: PaddedIndex, requests: Sequence[Request], k: int
) -> dict[str, tuple[int, ...]]:
    """The exact top-k rows (float32, every row) of each distinct question; kept beside the
    index (regenerating millions of rows takes minutes)."""
    questions = list(dict.fromkeys(r.question for r in requests))
    digest = hashlib.sha256(json.dumps([k, questions]).encode()).hexdigest()[:16]
    path = kb.folder / f"exact-{digest}.json" if kb.folder else None
    if path is not None and path.is_file():
        return {q: tuple(rows) for q, rows in json.loads(path.read_text(encoding="utf-8"))}
    for kept in sorted(kb.folder.glob("exact-*.json")) if kb.folder else ():
        stored = {q: tuple(rows) for q, rows in json.loads(kept.read_text(encoding="utf-8"))}
        if all(len(rows) == k for rows in stored.values()) and set(questions) <= set(stored):
            return {q: stored[q] for q in questions}  # a longer stream's answers hold these
    _, rows = kb.exact_topk(kb.embedder.embed(questions), k)
    exact = {q: tuple(int(x) for x in row) for q, row in zip(questions, rows, strict=True)}
    if path is not None:
        partial = path.with_suffix(f".{os.getpid()}.tmp")
        partial.write_text(json.dumps(list(exact.items())), encoding="utf-8")
        os.replace(partial, path)
    return exact


def run_search_heavy(
    mode_name: str,
    args: argparse.Namespace,
    model: Path,
    config: Any,
    settings: dict[str, Any],
    bar: Recorder,
    log: TextIO,
    checkpoint: Callable[[dict[str, Any]], None] | None = None,
) -> dict[str, Any]:
    """The whole ablation (module doc); returns the JSON document, also passed to
    `checkpoint` after each search ratio (to save what is done)."""
    from ragcache_core.retrieval.trace import tokenizer_counter

    heavy = resolve(mode_name, args)
    workload = load_heavy_workload(
        heavy, tokenizer_counter(str(model)), args.seed, args.top_k, args.data_dir
    )
    split = CoreSplit.halves() if args.core_split else None
    started = time.perf_counter()
    kb, built = PaddedIndex.cached(workload.documents, heavy.index, index_home())
    kb_s = time.perf_counter() - started
    print(
        f"{NAME}: knowledge base {'built' if built else 'loaded'} in {kb_s:.0f} s: "
        f"{kb.ntotal:,} rows ({kb.synthetic_share * 100:.1f}% synthetic)",
        file=log,
        flush=True,
    )
    stream = workload.stream(heavy.warmup + max(heavy.requests, heavy.light))
    exact = exact_answers(kb, stream, workload.top_k)
    # Speculation itself is measured at every ratio, ungated (the default gate only switches it
    # off for sources whose searches are faster than any of the full mode's ratios).
    config = replace(config, speculation_min_search_s=0.0)
    engines = Engines(model, config, log)
    document: dict[str, Any] = {
        "schema": SCHEMA,
        "settings": {
            **settings,
            "systems": describe_systems(heavy.systems),
            "warmup": f"the first {heavy.warmup} requests of every point fill the cache (4 at a "
            "time), not measured",
            "search_heavy": asdict(heavy),
        },
        "knowledge_base": {**kb.describe(), "built_now": built, "ready_s": kb_s},
        "workload": {
            "name": workload.name,
            "description": workload.description,
            "documents": len(workload.documents),
            "top_k": workload.top_k,
        },
        "core_split": split.describe() if split else None,
        "ratios": [],
    }
    try:
        with split.engine_environment() if split else contextlib.nullcontext():
            engines.start(heavy.systems, None)
        if split:
            document["core_split"]["engine_pids"] = split.pin_engines()
            split.pin_app()
        bench = Bench(engines, kb, heavy, workload, split, exact, bar, log)
        rate = heavy.rate
        for ratio in sorted(heavy.ratios, reverse=True):  # the highest calibrates the rate
            result = _ratio(bench, ratio, rate)
            rate = result["loaded"]["rate_rps"] if result["loaded"] else rate
            document["ratios"].append(result)
            if checkpoint is not None:
                checkpoint(document)
    finally:
        engines.close()
    document["ratios"].sort(key=lambda r: r["ratio"])
    return document
