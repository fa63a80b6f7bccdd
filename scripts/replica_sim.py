"""N replicas behind a router, simulated: hit rate, load imbalance and memory per routing policy.

For each trace (made by scripts/build_sim_traces.py), a stream of --length requests is
resampled with the trace's measured first-document skew (scripts/resample.py), then
run through 8, 16 and 64 replicas with every routing policy, each replica one simulated engine
(vLLM's blocks and the host tier, `ragcache_core/sim/engine.py`). Memory: the replicas together
hold --share of the stream's distinct prefix tokens (per replica M = share x W / N; a quarter
vLLM's blocks of 32 tokens, three quarters host tier in 16-token pages, written at eviction as
the engine's default); the single-replica reference holds N x M. The memory
search finds the smallest per-replica memory, as a multiple of M on a grid, that reaches the
single replica's token hit rate.

    .venv/bin/python scripts/build_sim_traces.py --out /tmp/ragcache-traces
    .venv/bin/python scripts/replica_sim.py /tmp/ragcache-traces/{nq,mmlu}_top2.jsonl \\
        --out /tmp/ragcache-replicas
    .venv/bin/python scripts/replica_sim.py --report /tmp/ragcache-replicas/replicas.json \\
        --plot docs/img/replicas-sim.png        # the markdown table and the plot
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

from ragcache_core.sim import (
    ROUTINGS,
    ClusterConfig,
    EngineConfig,
    SimConfig,
    load_trace,
    simulate,
    simulate_cluster,
)
from ragcache_core.trace import TraceRequest

sys.path.insert(0, str(Path(__file__).resolve().parent))
from resample import resample  # scripts/resample.py, beside this script

GRID = (1.0, 1.25, 1.5, 2.0, 3.0, 4.0, 8.0, 16.0, 32.0, 64.0)
BLOCK_SIZE = 32
LONGEST_PROMPT = 2048
"""vLLM's blocks never fall below this many tokens (a replica must run its longest prompt)."""
SEARCHED = ("round_robin", "prefix_affinity", "doc_affinity", "oracle")


def distinct_prefix_tokens(requests: list[TraceRequest]) -> int:
    seen: set[tuple[str, ...]] = set()
    total = 0
    for r in requests:
        for depth in range(1, len(r.docs) + 1):
            if r.docs[:depth] not in seen:
                seen.add(r.docs[:depth])
                total += r.doc_tokens[depth - 1]
    return total


def replica_config(memory: int, system_tokens: int) -> SimConfig:
    """A quarter vLLM's blocks (at least `LONGEST_PROMPT` tokens), three quarters host tier in
    16-token pages written at eviction; PGDSF (pinned: docs/benchmarks.md's figures were first
    measured with it, before DGDSF became the default, and rerun with it)."""
    gpu = memory // 4
    engine = EngineConfig(
        vllm_blocks=max(gpu, LONGEST_PROMPT) // BLOCK_SIZE + 1,
        host_tokens=memory - gpu,
        block_size=BLOCK_SIZE,
        page_size=16,
        policy="pgdsf",
        host_write="eviction",
    )
    return SimConfig(engine, system_tokens=system_tokens)


def cluster_hit(
    stream: list[TraceRequest], n: int, routing: str, memory: int, args: argparse.Namespace
) -> dict[str, Any]:
    config = ClusterConfig(
        replicas=n,
        replica=replica_config(memory, args.system_tokens),
        routing=routing,
        load_factor=args.load_factor,
    )
    return simulate_cluster(stream, config).to_json()


def memory_multiple(
    stream: list[TraceRequest],
    n: int,
    routing: str,
    base: int,
    target: float,
    known: dict[float, float],
    args: argparse.Namespace,
) -> float | None:
    """Smallest grid multiple x <= N of `base` whose token hit rate reaches `target` (binary
    search, assuming the hit rate grows with memory); None if even N x base falls short."""
    grid = [x for x in GRID if x <= n]

    def hit(x: float) -> float:
        if x not in known:
            known[x] = cluster_hit(stream, n, routing, int(base * x), args)["token_hit_rate"]
        return known[x]

    if hit(grid[-1]) < target:
        return None
    lo, hi = 0, len(grid) - 1  # hit(grid[hi]) >= target
    while lo < hi:
        mid = (lo + hi) // 2
        if hit(grid[mid]) >= target:
            hi = mid
        else:
            lo = mid + 1
    return grid[hi]


def run_trace(path: Path, args: argparse.Namespace) -> dict[str, Any]:
    trace = load_trace(path)
    stream, fit = resample(trace, args.length, seed=args.seed, prefix=path.stem)
    distinct = distinct_prefix_tokens(stream)
    out: dict[str, Any] = {
        "trace": path.stem,
        "length": len(stream),
        "fit": fit.to_json(),
        "distinct_prefix_tokens": distinct,
        "share": args.share,
        "load_factor": args.load_factor,
        "replicas": {},
    }
    for n in args.replicas:
        base = int(args.share * distinct / n)
        single = simulate(stream, replica_config(base * n, args.system_tokens)).token_hit_rate
        row: dict[str, Any] = {"memory_per_replica": base, "single_n_memory_hit": single}
        for routing in ROUTINGS:
            result = cluster_hit(stream, n, routing, base, args)
            known = {1.0: result["token_hit_rate"]}
            if routing in SEARCHED and not args.no_search:
                result["memory_multiple"] = memory_multiple(
                    stream, n, routing, base, single, known, args
                )
            row[routing] = result
            print(
                f"{path.stem} N={n} {routing}: token hit {result['token_hit_rate']:.3f} "
                f"(single {single:.3f}), busiest {result['busiest_share']:.3f}, "
                f"imbalance {result['imbalance_mean']:.2f}/{result['imbalance_max']:.2f}, "
                f"memory x{result.get('memory_multiple')}",
                file=sys.stderr,
                flush=True,
            )
        out["replicas"][str(n)] = row
    return out


def table(results: list[dict[str, Any]]) -> str:
    """The markdown tables of docs/benchmarks.md, one per trace."""
    lines = []
    for res in results:
        fit = res["fit"]
        lines += [
            f"\n**{res['trace']}** resampled to {res['length']:,} requests (one-off share "
            f"{fit['one_off_share']:.2f}, Zipf s {fit['zipf_s']:.2f} over "
            f"{fit['reused_groups']} x {fit['copies']} reused first documents); distinct "
            f"prefix tokens W = {res['distinct_prefix_tokens']:,}; the replicas hold "
            f"{res['share']:.0%} of W together.\n",
            "| N | memory per replica M | one replica with N x M | routing | token hit | "
            "doc hit | busiest share | imbalance mean / max | memory per replica to match |",
            "|---|---|---|---|---|---|---|---|---|",
        ]
        for n, row in res["replicas"].items():
            for routing in ROUTINGS:
                r = row[routing]
                multiple = r.get("memory_multiple", "-")
                shown = (
                    "-"
                    if multiple == "-"
                    else (f"> {n} M" if multiple is None else f"{multiple:g} M")
                )
                lines.append(
                    f"| {n} | {row['memory_per_replica']:,} | {row['single_n_memory_hit']:.3f} | "
                    f"{routing} | {r['token_hit_rate']:.3f} | {r['doc_hit_rate']:.3f} | "
                    f"{r['busiest_share']:.3f} | {r['imbalance_mean']:.2f} / "
                    f"{r['imbalance_max']:.2f} | {shown} |"
                )
    return "\n".join(lines)


def plot(results: list[dict[str, Any]], path: Path) -> None:
    """Token hit rate and load imbalance against N, one row per trace."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(len(results), 2, figsize=(10, 3.6 * len(results)), squeeze=False)
    for row_axes, res in zip(axes, results, strict=True):
        ns = [int(n) for n in res["replicas"]]
        hit_ax, load_ax = row_axes
        single = [res["replicas"][str(n)]["single_n_memory_hit"] for n in ns]
        hit_ax.plot(ns, single, "k--", label="one replica, N x memory")
        for routing in ROUTINGS:
            rows = [res["replicas"][str(n)][routing] for n in ns]
            hit_ax.plot(ns, [r["token_hit_rate"] for r in rows], "o-", label=routing)
            load_ax.plot(ns, [r["imbalance_mean"] for r in rows], "o-", label=routing)
        for ax, title in ((hit_ax, "token hit rate"), (load_ax, "max/mean requests per window")):
            ax.set_xscale("log", base=2)
            ax.set_xticks(ns, [str(n) for n in ns])
            ax.set_xlabel("replicas N")
            ax.set_title(f"{res['trace']}: {title}")
            ax.grid(alpha=0.3)
        hit_ax.set_ylim(bottom=0)
        hit_ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("traces", type=Path, nargs="*")
    parser.add_argument("--out", type=Path, default=None)
    parser.add_argument("--report", type=Path, nargs="+", default=None, help="replicas.json")
    parser.add_argument("--plot", type=Path, default=None, help="with --report: a PNG")
    parser.add_argument("--length", type=int, default=24000)
    parser.add_argument("--replicas", type=int, nargs="+", default=[8, 16, 64])
    parser.add_argument("--share", type=float, default=0.2)
    parser.add_argument("--load-factor", type=float, default=1.25)
    parser.add_argument("--system-tokens", type=int, default=64)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--no-search", action="store_true", help="skip the memory search")
    args = parser.parse_args()
    if args.report:
        results = [r for path in args.report for r in json.loads(path.read_text())]
        print(table(results))
        if args.plot:
            plot(results, args.plot)
        return
    if args.out is None or not args.traces:
        parser.error("give traces and --out (or --report)")
    args.out.mkdir(parents=True, exist_ok=True)
    results = [run_trace(path, args) for path in args.traces]
    (args.out / "replicas.json").write_text(json.dumps(results, indent=1))
    print(f"wrote {args.out / 'replicas.json'}")


if __name__ == "__main__":
    main()
