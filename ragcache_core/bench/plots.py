"""PNG plots of a `ragcache bench serve` JSON document (matplotlib, Agg backend)."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any


def pyplot() -> Any:
    """matplotlib.pyplot on the Agg backend (no display needed)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def cdf_rate(points: Sequence[dict[str, Any]]) -> float | None:
    """The highest rate at which every system of the workload was measured."""
    systems = {p["system"] for p in points}
    rates = sorted({p["rate_rps"] for p in points})
    full = [r for r in rates if {p["system"] for p in points if p["rate_rps"] == r} == systems]
    return full[-1] if full else None


def pooled_ttfts(points: Sequence[dict[str, Any]], system: str, rate: float) -> list[float]:
    """Every measured TTFT of one system at one rate, all repeats pooled, sorted."""
    return sorted(
        t for p in points if p["system"] == system and p["rate_rps"] == rate for t in p["ttfts_s"]
    )


def plot_cdf(ax: Any, points: Sequence[dict[str, Any]], rate: float, title: str) -> None:
    """TTFT CDF per system at one rate (repeats pooled)."""
    for system in sorted({p["system"] for p in points}):
        ttfts = pooled_ttfts(points, system, rate)
        if ttfts:
            ys = [(i + 1) / len(ttfts) for i in range(len(ttfts))]
            ax.step([t * 1000 for t in ttfts], ys, where="post", label=system)
    ax.set_xscale("log")
    ax.set_xlabel("time to first token (ms, log scale)")
    ax.set_ylabel("fraction of requests")
    ax.set_title(title)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)


def _ttft_vs_rate(ax: Any, w: dict[str, Any]) -> None:
    from ragcache_core.bench.compare import spread

    points = w["points"]
    for i, system in enumerate(sorted({p["system"] for p in points})):
        rates = sorted({p["rate_rps"] for p in points if p["system"] == system})
        for key, style in (("ttft_mean_s", "-"), ("ttft_p95_s", "--")):
            s = [spread(points, system, r, key) for r in rates]
            mid = [v[1] * 1000 for v in s]
            err = [[(v[1] - v[0]) * 1000 for v in s], [(v[2] - v[1]) * 1000 for v in s]]
            label = f"{system} {'mean' if key == 'ttft_mean_s' else 'p95'}"
            ax.errorbar(
                rates,
                mid,
                yerr=err,
                fmt=style,
                marker="o",
                ms=3,
                color=f"C{i}",
                label=label,
                capsize=2,
            )
    if w["slo_s"]:
        ax.axhline(w["slo_s"] * 1000, color="grey", lw=0.8, ls=":", label="SLO")
    ax.set_yscale("log")
    ax.set_xlabel("request rate (req/s, Poisson)")
    ax.set_ylabel("TTFT (ms, log; bars: min..max of repeats)")
    ax.set_title(w["name"])
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7)


def _grid(n: int) -> tuple[Any, Any, list[Any]]:
    plt = pyplot()
    fig, axes = plt.subplots(1, max(1, n), figsize=(6.5 * max(1, n), 4.5), squeeze=False)
    return plt, fig, list(axes[0])


def draw_all(document: dict[str, Any], out: Path) -> list[Path]:
    """Write ttft_vs_rate.png, throughput_slo.png, ttft_cdf.png and hit_rates.png; return them."""
    workloads = document["workloads"]
    paths: list[Path] = []
    if not workloads:
        return paths
    plt, fig, axes = _grid(len(workloads))
    for ax, w in zip(axes, workloads, strict=True):
        _ttft_vs_rate(ax, w)
    paths.append(_save(plt, fig, out / "ttft_vs_rate.png"))

    plt, fig, axes = _grid(len(workloads))
    for ax, w in zip(axes, workloads, strict=True):
        rate = cdf_rate(w["points"])
        if rate is not None:
            plot_cdf(ax, w["points"], rate, f"{w['name']}: TTFT CDF at {rate:.2f}/s")
    paths.append(_save(plt, fig, out / "ttft_cdf.png"))

    plt, fig, axes = _grid(len(workloads))
    for ax, w in zip(axes, workloads, strict=True):
        _bars(ax, w)
    paths.append(_save(plt, fig, out / "throughput_slo.png"))

    plt, fig, axes = _grid(len(workloads))
    for ax, w in zip(axes, workloads, strict=True):
        _hits(ax, w)
    paths.append(_save(plt, fig, out / "hit_rates.png"))
    return paths


def _bars(ax: Any, w: dict[str, Any]) -> None:
    names = list(w["sustained"])
    values = [(w["sustained"][n] or {}).get("throughput_rps", 0.0) for n in names]
    ax.bar(names, values, color=[f"C{i}" for i in range(len(names))])
    ax.set_ylabel("throughput at the highest rate within the SLO (req/s)")
    ax.set_title(f"{w['name']}: SLO p95 <= {w['slo_s'] * 1000:.0f} ms")
    ax.tick_params(axis="x", labelrotation=20)
    ax.grid(alpha=0.3, axis="y")


def _hits(ax: Any, w: dict[str, Any]) -> None:
    """Token hit rate per system (median over every point) and RAGCache's document hits per
    tier, stacked."""
    import statistics

    points = w["points"]
    names = sorted({p["system"] for p in points})
    xs = range(len(names))
    token = [
        statistics.median(p["token_hit_rate"] for p in points if p["system"] == n) for n in names
    ]
    gpu = [_median(points, n, "gpu_doc_hit_rate") for n in names]
    host = [_median(points, n, "host_doc_hit_rate") for n in names]
    ax.bar(
        [x - 0.2 for x in xs], [v * 100 for v in token], width=0.4, label="token hits (all systems)"
    )
    ax.bar([x + 0.2 for x in xs], [v * 100 for v in gpu], width=0.4, label="doc hits, GPU tier")
    ax.bar(
        [x + 0.2 for x in xs],
        [v * 100 for v in host],
        width=0.4,
        bottom=[v * 100 for v in gpu],
        label="doc hits, host tier",
    )
    ax.set_xticks(list(xs), names, rotation=20)
    ax.set_ylabel("hit rate (%), median over points")
    ax.set_title(w["name"])
    ax.grid(alpha=0.3, axis="y")
    ax.legend(fontsize=7)


def _median(points: Sequence[dict[str, Any]], system: str, key: str) -> float:
    import statistics

    values = [p[key] for p in points if p["system"] == system and key in p]
    return statistics.median(values) if values else 0.0


def _save(plt: Any, fig: Any, path: Path) -> Path:
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path
