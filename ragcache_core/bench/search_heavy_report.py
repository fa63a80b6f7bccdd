"""The search-heavy ablation's statistics and tables (`bench.search_heavy` runs it): search
time per stage, TTFT and non-overlapped search per point, speculation on against off with
their spreads, and the paper's Table 3 as printed. Pure: numbers in, numbers or lines out.
"""

from __future__ import annotations

import statistics
from collections.abc import Mapping, Sequence
from typing import Any, TextIO

from ragcache_core.bench.compare import spread
from ragcache_core.bench.serve import Outcome
from ragcache_core.bench.sweep import load_note
from ragcache_core.retrieval.padded import SearchRecord

SPEC, NOSPEC, VLLM = "ragcache", "ragcache-nospec", "vllm"


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


def point_line(tag: str, s: dict[str, Any]) -> str:
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
        f"{s['non_overlapped_search_mean_s'] * 1000:.0f} ms{spec}{load_note(s)}"
    )


def of_systems(points: Sequence[dict[str, Any]], systems: Sequence[str]) -> list[dict[str, Any]]:
    return [p for p in points if p["system"] in systems]


def pool_search(stats: Sequence[dict[str, Any]]) -> dict[str, Any]:
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
