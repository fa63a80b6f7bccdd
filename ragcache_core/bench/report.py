"""Running `ragcache bench serve` end to end: model, workloads, engines, sweeps, JSON, plots,
tables."""

from __future__ import annotations

import argparse
import json
import sys
import time
from dataclasses import asdict
from pathlib import Path
from typing import Any, TextIO

from ragcache_core.bench.serve import default_sampling, resolved
from ragcache_core.bench.sweep import (
    SCHEMA,
    Engines,
    Mode,
    Recorder,
    Saturation,
    ablation_parents,
    ablation_rate,
    describe_systems,
    git_commit,
    now_utc,
    run_ablations,
    sweep_workload,
    workload_systems,
)
from ragcache_core.bench.workloads import HostSizing, Workload, host_sizing, load_workload
from ragcache_core.config import CacheConfig
from ragcache_core.search import SearchSource

SMOKE_RATE = 4.0
HEAVY_NAME = "search-heavy"
"""`bench.search_heavy.NAME`: that workload runs alone, its own way."""


def tqdm_recorder(log: TextIO) -> Recorder:
    """One transient tqdm bar per point, on stderr."""
    from tqdm import tqdm

    def make(label: str, total: int) -> Any:
        bar = tqdm(total=total, desc=label, unit="req", file=log, leave=False)

        def update(done: int) -> None:
            bar.n = done
            bar.refresh()
            if done >= total:
                bar.close()

        return update

    return make


def cache_config(args: argparse.Namespace) -> CacheConfig:
    """The memory and sampling every system shares (RAGCache's pools size the baselines')."""
    return CacheConfig(
        sampling=default_sampling(args.max_tokens),
        host_pool_tokens=args.host_pool_tokens,
        vllm_kv_cache_gib=args.vllm_kv_gib,
    )


def prepare(
    workload_name: str, model: Path, args: argparse.Namespace
) -> tuple[Workload, SearchSource | None]:
    """Load a workload and, when its requests retrieve, build its index (`--retriever`)."""
    from ragcache_core.bench.workloads import index_source
    from ragcache_core.retrieval.trace import tokenizer_counter

    workload = load_workload(
        workload_name,
        tokenizer_counter(str(model)),
        seed=args.seed,
        top_k=args.top_k,
        data_dir=args.data_dir,
    )
    return index_source(workload, args.retriever)


def size_host_tier(
    workload: Workload, source: SearchSource | None, mode: Mode, model: Path, config: CacheConfig
) -> HostSizing:
    """A capacity-constrained workload's host tier, sized on its measured stream (warm-up plus
    measured requests) with the model's tokenizer and KV layout."""
    from ragcache_core.retrieval.trace import tokenizer_counter
    from ragcache_core.storage.pool_layout import layout_for_model

    layout = layout_for_model(model, dtype=str(resolved(config).dtype), page_size=config.page_size)
    count = tokenizer_counter(str(model))
    return host_sizing(workload, source, mode.warmup + mode.requests, count, layout.token_bytes)


def run_bench(mode: Mode, args: argparse.Namespace, model: Path | None) -> dict[str, Any]:
    """Run the sweep of every workload (and the ablations), write DIR/serve.json and the plots,
    and return the JSON document."""
    log = sys.stderr
    if model is None:
        from ragcache_core.models import build_tiny_model

        print(f"building the offline model ({mode.name}) ...", file=log, flush=True)
        model = build_tiny_model(size="tiny" if mode.name == "smoke" else "bench")
    config = cache_config(args)
    started = time.perf_counter()
    document: dict[str, Any] = {
        "schema": SCHEMA,
        "settings": _settings(mode, args, model, config),
        "workloads": [],
        "ablations": None,
    }
    bar = tqdm_recorder(log)
    if mode.workloads == (HEAVY_NAME,):
        from ragcache_core.bench.search_heavy import run_search_heavy

        def checkpoint(done: dict[str, Any]) -> None:  # what is done survives a later failure
            _write_json(done, args.out, started)

        document = run_search_heavy(
            mode.name, args, model, config, document["settings"], bar, log, checkpoint
        )
        _write_json(document, args.out, started)
        return document
    engines = Engines(model, config, log)
    fixed = args.rate if args.rate is not None else (SMOKE_RATE if mode.name == "smoke" else None)
    try:
        results = []
        for name in mode.workloads:
            workload, source = prepare(name, model, args)
            sizing = None
            workload_config = config
            if workload.host_share is not None:
                sizing = size_host_tier(workload, source, mode, model, config)
                print(sizing.line(), file=log, flush=True)
                workload_config = config.with_(host_pool_tokens=sizing.host_tokens)
            if workload_config != engines.config:  # pools are sized when an engine starts
                engines.stop(list(engines.systems))
                engines.config = workload_config
            systems = workload_systems(mode, name, named=args.systems is not None)
            engines.start(systems, source)
            result = sweep_workload(
                engines, workload, source, mode, systems, args.seed, bar, fixed, args.saturate
            )
            results.append((result, source))
            document["workloads"].append(result.to_json())
            if sizing is not None:
                document["workloads"][-1]["host_sizing"] = asdict(sizing)
            _write_json(document, args.out, started)  # what is done survives a later failure
        if mode.ablations and results:
            result, source = results[0]
            keep = ablation_parents(mode.ablations)
            engines.stop([n for n in list(engines.systems) if n not in keep])
            rate = ablation_rate(result)
            document["ablations"] = run_ablations(
                engines, result.workload, source, mode, mode.ablations, rate, args.seed, bar
            )
    finally:
        engines.close()
    _write_json(document, args.out, started)
    _write(document, args.out)
    return document


def _settings(
    mode: Mode, args: argparse.Namespace, model: Path, config: CacheConfig
) -> dict[str, Any]:

    from ragcache_core.storage.pool_layout import layout_for_model

    layout = layout_for_model(model, dtype=str(resolved(config).dtype), page_size=config.page_size)
    return {
        "mode": asdict(mode),
        "git_commit": git_commit(),
        "started_utc": now_utc(),
        "model": str(model),
        "kv_bytes_per_token": layout.token_bytes,
        "systems": describe_systems([*mode.systems, *mode.ablations]),
        "max_tokens": args.max_tokens,
        "vllm_kv_gib": config.vllm_kv_cache_gib,
        "host_pool_tokens": config.host_pool_tokens,
        "policy": config.policy,
        "seed": args.seed,
        "ttft": "arrival to first token, search included",
        "warmup": f"the first {mode.warmup} requests of every point fill the cache, not measured",
        "token_hit_rate": "prompt tokens not computed / prompt tokens, system prompt included",
    }


def _write_json(document: dict[str, Any], out: Path, started: float) -> None:
    """DIR/serve.json as the run stands (`wall_s` so far): written after every workload."""
    document["settings"]["wall_s"] = time.perf_counter() - started
    out.mkdir(parents=True, exist_ok=True)
    (out / "serve.json").write_text(json.dumps(document, indent=1))


def _write(document: dict[str, Any], out: Path) -> None:
    """The plots, then serve.json again with their paths."""
    from ragcache_core.bench.plots import draw_all

    document["settings"]["plots"] = [str(p) for p in draw_all(document, out)]
    (out / "serve.json").write_text(json.dumps(document, indent=1))


def print_tables(document: dict[str, Any], out: TextIO) -> None:
    """Per workload: light load, every rate (median and min..max of the repeats), the SLO
    result and the comparisons whose spreads are apart."""
    settings = document["settings"]
    print(
        f"model {settings['model']}, commit {settings['git_commit']}, "
        f"mode {settings['mode']['name']}",
        file=out,
    )
    for w in document["workloads"]:
        print(f"\n== {w['name']}: {w['description']}\nretriever: {w['retriever']}", file=out)
        if "host_sizing" in w:
            print(HostSizing(**w["host_sizing"]).line(), file=out)
        print(f"SLO: TTFT p95 <= {w['slo_s'] * 1000:.0f} ms ({w['slo_rule']})", file=out)
        if w.get("saturation"):
            print(Saturation(**w["saturation"]).line(), file=out)
        for name, s in w["light_load"].items():
            print(
                f"  light load {name:<15} TTFT p95 {s['ttft_p95_s'] * 1000:7.0f} ms, service "
                f"{s['service_s'] * 1000:6.0f} ms, token hits {s['token_hit_rate'] * 100:3.0f}%",
                file=out,
            )
        _rate_table(w["points"], out)
        for name, best in w["sustained"].items():
            text = (
                f"{best['rate_rps']:.2f}/s ({best['throughput_rps']:.2f} req/s)" if best else "none"
            )
            print(f"  highest rate within the SLO  {name:<15} {text}", file=out)
        for c in w["comparisons"]:
            print(_comparison_line(c), file=out)
        for a in w["answers"]:
            print(_answers_line(a), file=out)
    ablations = document.get("ablations")
    if ablations:
        print(f"\n== ablations: {ablations['workload']} at {ablations['rate_rps']:.2f}/s", file=out)
        _rate_table(ablations["points"], out)
        for c in ablations["comparisons"]:
            print(_comparison_line(c), file=out)
    print(f"\nplots: {', '.join(settings.get('plots', []))}", file=out)


def _answers_line(a: dict[str, Any]) -> str:
    at = f"{a['rate_rps']:.2f}/s #{a['repeat'] + 1}"
    if "system" in a:  # a reordering system, against plain vLLM on its own prompts
        return (
            f"  {a['system']} answers equal plain vLLM's on the same ordered prompts at {at}: "
            f"{a['same_as_plain_vllm']}/{a['requests']} ({a['reordered']} reordered)"
        )
    if a.get("systems", 2) < 2:  # one system's answers: nothing to compare them with
        return f"  answers identical at {at}: one system serves these prompts, not compared"
    return f"  answers identical at {at}: {a['identical']}/{a['requests']}"


def _rate_table(points: list[dict[str, Any]], out: TextIO) -> None:
    from ragcache_core.bench.compare import spread

    header = (
        f"  {'rate':>6} {'system':<19}{'TTFT mean ms (min..max)':>26}"
        f"{'p95 ms (min..max)':>24}{'req/s':>7}{'tok hit':>8}{'doc hit':>8}"
    )
    print(header, file=out)
    keys = sorted({(p["rate_rps"], p["system"]) for p in points})
    for rate, system in keys:
        mean = spread(points, system, rate, "ttft_mean_s")
        p95 = spread(points, system, rate, "ttft_p95_s")
        tput = spread(points, system, rate, "throughput_rps")
        hit = spread(points, system, rate, "token_hit_rate")
        doc = spread(points, system, rate, "doc_hit_rate") if system.startswith("ragcache") else []
        print(
            f"  {rate:>6.2f} {system:<19}{_ms(mean):>26}{_ms(p95):>24}{tput[1]:>7.2f}"
            f"{hit[1] * 100:>7.0f}%{(f'{doc[1] * 100:.0f}%' if doc else '-'):>8}",
            file=out,
        )


def _ms(values: list[float]) -> str:
    return f"{values[1] * 1000:.0f} ({values[0] * 1000:.0f}..{values[2] * 1000:.0f})"


def _comparison_line(c: dict[str, Any]) -> str:
    verdict = "spreads apart" if c["spreads_apart"] else "spreads overlap or one run: no claim"
    return (
        f"  {c['rate_rps']:.2f}/s: {c['system']} / {c['against']} mean TTFT = "
        f"{c['ratio_ttft_mean']:.2f} "
        f"({verdict})"
    )
