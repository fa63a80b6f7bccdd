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
from collections.abc import Callable, Mapping, Sequence
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any, TextIO

from ragcache_core.bench.cores import CoreSplit
from ragcache_core.bench.serve import (
    Outcome,
    PointRun,
    RAGCacheSystem,
    ServedSystem,
    identical_answers,
    light_load,
    run_point,
)
from ragcache_core.bench.sweep import COOL_DOWN_S, Engines, Recorder, describe_systems, spread
from ragcache_core.bench.workloads import Request, Workload, load_workload
from ragcache_core.errors import ConfigError
from ragcache_core.retrieval.embedder import EmbedderConfig
from ragcache_core.retrieval.padded import PaddedIndex, PaddedSettings, PaddedSource, SearchRecord
from ragcache_core.retrieval.trace import poisson_arrivals

NAME = "search-heavy"
SCHEMA = "ragcache-bench-search-heavy/1"
SPEC, NOSPEC, VLLM = "ragcache", "ragcache-nospec", "vllm"


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


# --------------------------------------------------------------------------- statistics


def search_stats(
    records: Sequence[SearchRecord], exact: Mapping[str, tuple[int, ...]], k: int
) -> dict[str, Any]:
    """What the searches measured: time per stage, when the final top-k first appeared, the
    synthetic rows that reached it and recall against exact search (pure)."""
    if not records:
        return {"searches": 0}
    n_stages = max(len(r.stage_s) for r in records)
    stage_means = [
        statistics.fmean(r.stage_s[i] for r in records if len(r.stage_s) > i)
        for i in range(n_stages)
    ]
    settled = [0] * n_stages
    for r in records:
        settled[r.last_change] += 1
    hideable = [r.total_s - r.embed_s - sum(r.stage_s[: r.last_change + 1]) for r in records]
    with_exact = [r for r in records if r.question in exact]
    recall = (
        statistics.fmean(len(set(r.final_rows) & set(exact[r.question])) / k for r in with_exact)
        if with_exact
        else None
    )
    return {
        "searches": len(records),
        "embed_mean_s": statistics.fmean(r.embed_s for r in records),
        "stage_mean_s": stage_means,
        "total_mean_s": statistics.fmean(r.total_s for r in records),
        "final_at_stage": [c / len(records) for c in settled],
        "stage0_is_final": settled[0] / len(records),
        "hideable_mean_s": statistics.fmean(hideable),
        "synthetic_in_topk_slots": sum(r.dropped for r in records),
        "synthetic_slot_rate": sum(r.dropped for r in records) / (k * len(records)),
        "searches_with_synthetic": sum(1 for r in records if r.dropped) / len(records),
        "recall_vs_exact": recall,
        "recall_questions": len(with_exact),
    }


def outcome_stats(outcomes: Sequence[Outcome]) -> dict[str, Any]:
    """TTFT and search times of measured requests (pure)."""
    ttfts = sorted(o.ttft_s for o in outcomes)
    if not ttfts:
        return {"requests": 0}
    return {
        "requests": len(outcomes),
        "ttft_mean_s": statistics.fmean(ttfts),
        "ttft_p50_s": statistics.median(ttfts),
        "ttft_p95_s": ttfts[min(len(ttfts) - 1, round(0.95 * (len(ttfts) - 1)))],
        "search_mean_s": statistics.fmean(o.search_s for o in outcomes),
        "non_overlapped_search_mean_s": statistics.fmean(
            o.search_s - o.search_hidden_s for o in outcomes
        ),
        "speculative_answers": sum(o.speculative for o in outcomes),
        "service_mean_s": statistics.fmean(o.latency_s for o in outcomes),
        "prompt_docs_mean": statistics.fmean(o.docs for o in outcomes),
        "ttfts_s": [o.ttft_s for o in outcomes],
    }


def compare_key(points: Sequence[dict[str, Any]], key: str) -> dict[str, Any] | None:
    """`ragcache-nospec` / `ragcache` on the median of `key` over the rounds, and whether
    the min..max spreads (of at least 2 rounds each) are apart (only then a claim)."""
    mine = spread(points, SPEC, points[0]["rate_rps"], key) if points else []
    theirs = spread(points, NOSPEC, points[0]["rate_rps"], key) if points else []
    if not mine or not theirs or mine[1] <= 0:
        return None
    rounds = min(sum(p["system"] == s for p in points) for s in (SPEC, NOSPEC))
    apart = rounds >= 2 and (mine[2] < theirs[0] or theirs[2] < mine[0])
    return {
        "key": key,
        "ratio_nospec_over_spec": theirs[1] / mine[1],
        "spec_s": mine,
        "nospec_s": theirs,
        "spreads_apart": apart,
    }


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
    }
    print(_point_line(tag, summary), file=bench.log, flush=True)
    return run, summary


def _point_line(tag: str, s: dict[str, Any]) -> str:
    c = s["counters_with_warmup"]
    spec = (
        f", speculations {c.get('speculation_started', 0)} started / "
        f"{c.get('speculation_used', 0)} used / {c.get('speculation_aborted', 0)} aborted"
        if c
        else ""
    )
    return (
        f"{tag} {s['system']}: TTFT mean {s['ttft_mean_s'] * 1000:.0f} ms, search "
        f"{s['search_mean_s'] * 1000:.0f} ms, not overlapped "
        f"{s['non_overlapped_search_mean_s'] * 1000:.0f} ms{spec}"
    )


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
        "lists_per_stage": getattr(staged.plan, "lists", None),
        "reference": reference,
        "reference_light_ttft_mean_s": ttft,
        "reference_light_search_mean_s": search,
        "search_share_of_reference_ttft": search / ttft if ttft > 0 else 0.0,
        "light": {
            "points": light,
            "answers": light_answers,
            "ttft": compare_key(_of(light, (SPEC, NOSPEC)), "ttft_mean_s"),
            "non_overlapped": compare_key(
                _of(light, (SPEC, NOSPEC)), "non_overlapped_search_mean_s"
            ),
        },
        "loaded": part,
        "searches": _pool_search(records_all),
    }


def _of(points: Sequence[dict[str, Any]], systems: Sequence[str]) -> list[dict[str, Any]]:
    return [p for p in points if p["system"] in systems]


def _pool_search(stats: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """Search statistics of a ratio, weighted by each point's searches."""
    stats = [s for s in stats if s.get("searches")]
    total = sum(s["searches"] for s in stats)
    if not total:
        return {"searches": 0}

    def mean(key: str) -> float:
        return sum(s[key] * s["searches"] for s in stats) / total

    n_stages = max(len(s["stage_mean_s"]) for s in stats)
    recall = [s for s in stats if s["recall_vs_exact"] is not None]
    return {
        "searches": total,
        "embed_mean_s": mean("embed_mean_s"),
        "total_mean_s": mean("total_mean_s"),
        "stage_mean_s": [
            sum(s["stage_mean_s"][i] * s["searches"] for s in stats) / total
            for i in range(n_stages)
        ],
        "final_at_stage": [
            sum(s["final_at_stage"][i] * s["searches"] for s in stats) / total
            for i in range(n_stages)
        ],
        "stage0_is_final": mean("stage0_is_final"),
        "hideable_mean_s": mean("hideable_mean_s"),
        "synthetic_slot_rate": mean("synthetic_slot_rate"),
        "searches_with_synthetic": mean("searches_with_synthetic"),
        "synthetic_in_topk_slots": sum(s["synthetic_in_topk_slots"] for s in stats),
        "recall_vs_exact": (
            sum(s["recall_vs_exact"] * s["recall_questions"] for s in recall)
            / max(1, sum(s["recall_questions"] for s in recall))
            if recall
            else None
        ),
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
            "search_heavy": _heavy_json(heavy),
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


def _heavy_json(heavy: HeavyMode) -> dict[str, Any]:
    return asdict(heavy)


# --------------------------------------------------------------------------- the tables


def print_search_heavy(document: dict[str, Any], out: TextIO) -> None:
    """The paper's Table 3 per load: TTFT and non-overlapped search, speculation on and off."""
    kb, w = document["knowledge_base"], document["workload"]
    print(
        f"\n== {w['name']}: {w['description']}\nknowledge base: {kb['vectors']:,} rows, "
        f"{kb['real']:,} real + {kb['synthetic']:,} synthetic ({kb['synthetic_share'] * 100:.1f}% "
        f"padded), dimension {kb['dimension']}, IVF {kb['nlist']} lists, {kb['codes']} codes "
        f"({kb['code_bytes'] / 2**20:,.0f} MiB)",
        file=out,
    )
    split = document["core_split"]
    print(f"core split: {split if split is None else _split_line(split)}", file=out)
    print(
        f"  {'ratio':>6} {'search ms':>10} {'stage ms':>22} {'share':>6} {'stage0=final':>13} "
        f"{'synthetic':>10} {'recall':>7}",
        file=out,
    )
    for r in document["ratios"]:
        s = r["searches"]
        stages = "/".join(f"{x * 1000:.0f}" for x in s.get("stage_mean_s", []))
        recall = s.get("recall_vs_exact")
        print(
            f"  {r['ratio'] * 100:>5.1f}% {s.get('total_mean_s', 0) * 1000:>10.1f} {stages:>22} "
            f"{r['search_share_of_reference_ttft'] * 100:>5.0f}% "
            f"{s.get('stage0_is_final', 0) * 100:>12.0f}% "
            f"{s.get('synthetic_slot_rate', 0) * 100:>9.2f}% "
            f"{'-' if recall is None else f'{recall:.3f}':>7}",
            file=out,
        )
    for load in ("light", "loaded"):
        print(f"\n  {load}: TTFT mean ms and non-overlapped search ms, median (min..max)", file=out)
        for r in document["ratios"]:
            part = r[load]
            if part is None:
                continue
            rate = "one at a time" if load == "light" else f"{part['rate_rps']:.2f}/s"
            for key, c in (("TTFT", part["ttft"]), ("not overlapped", part["non_overlapped"])):
                if c is None:
                    continue
                verdict = "apart" if c["spreads_apart"] else "overlap: no claim"
                print(
                    f"  {r['ratio'] * 100:>5.1f}% {rate:>13} {key:>15}: spec {_ms(c['spec_s'])}"
                    f", nospec {_ms(c['nospec_s'])}: x{c['ratio_nospec_over_spec']:.2f} "
                    f"({verdict})",
                    file=out,
                )
            for a in part["answers"]:
                print(
                    f"  {r['ratio'] * 100:>5.1f}% answers identical #{a['repeat'] + 1}: "
                    f"{a['identical']}/{a['requests']}",
                    file=out,
                )


def _split_line(split: dict[str, Any]) -> str:
    return f"search + app on CPUs {split['search_cpus']}, vLLM on CPUs {split['engine_cpus']}"


def _ms(values: Sequence[float]) -> str:
    return f"{values[1] * 1000:.0f} ({values[0] * 1000:.0f}..{values[2] * 1000:.0f})"
