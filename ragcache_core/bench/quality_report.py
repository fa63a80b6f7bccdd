"""The table `ragcache bench quality` prints from its JSON document (`bench.quality.summarize`)."""

from __future__ import annotations

from typing import Any, TextIO

from ragcache_core.bench.quality import FIGURES, REFERENCE

HEADS = {"exact_match": "exact match", "f1": "F1", "contains": "contains"}
CELL = 22


def _points(figure: dict[str, Any], sign: bool = False) -> str:
    """`12.3 [9.0, 16.1]`: a figure and its interval in percentage points."""
    value, (low, high) = figure["value"], figure["ci95"]
    spec = "+.1f" if sign else ".1f"
    return f"{value * 100:{spec}} [{low * 100:{spec}}, {high * 100:{spec}}]"


def print_quality(document: dict[str, Any], out: TextIO) -> None:
    """The settings line, the stream, one row per system (figures with 95% intervals), the
    paired differences against the reference, and what the cache did."""
    settings, stream, systems = document["settings"], document["stream"], document["systems"]
    print(
        f"bench quality: {stream['name']}, {stream['questions']:,} questions (seed "
        f"{stream['seed']}), top-{stream['top_k']}, max {settings['max_tokens']} answer tokens; "
        f"model {settings['model']}; commit {settings['git_commit']}; "
        f"{settings['wall_s']:.0f} s",
        file=out,
    )
    print(f"stream: {stream['description']}", file=out)
    gold = stream["gold_in_retriever_top3"]
    ranked = "" if gold is None else f"; the retriever ranked the gold in its top-3 for {gold:,}"
    print(
        "retrieval recall (a gold answer in the documents): "
        f"{_points(stream['retrieval_recall'])}{ranked}",
        file=out,
    )
    heads = [HEADS[f] for f in FIGURES] + [f"agrees with {REFERENCE}", "identical"]
    print(f"{'system (%, 95% CI)':<20}" + "".join(f"{h:<{CELL}}" for h in heads), file=out)
    for name, entry in systems.items():
        cells = [_points(entry[f]) for f in FIGURES]
        agreement = entry.get("agreement_with_vllm")
        cells.append(_points(agreement) if agreement else "-")
        same = entry.get("identical_to_vllm")
        cells.append(f"{same['count']}/{same['of']}" if same else "-")
        print(f"{name:<20}" + "".join(f"{c:<{CELL}}" for c in cells), file=out)
    compared = {n: e for n, e in systems.items() if "difference_vs_vllm" in e}
    if compared:
        print(
            f"difference against {REFERENCE} (points, 95% paired bootstrap over questions):",
            file=out,
        )
    for name, entry in compared.items():
        print(f"{name:<20}" + _differences(entry["difference_vs_vllm"]), file=out)
        moved = entry.get("difference_vs_vllm_reordered")
        if moved is not None:
            line = f"  on its {entry['reordered']} reordered questions: {_differences(moved)}"
            print(line, file=out)
    for name, entry in systems.items():
        if "hits" in entry:
            print(f"{name}: {_cache_line(entry)}", file=out)


def _differences(differences: dict[str, Any]) -> str:
    return "  ".join(f"{HEADS[f]} {_points(differences[f], sign=True)}" for f in FIGURES)


def _cache_line(entry: dict[str, Any]) -> str:
    hits = entry["hits"]
    parts = [
        f"measured pass: document hits {hits['doc_hit_rate']:.0%}, token hits "
        f"{hits['token_hit_rate']:.0%}"
    ]
    if "reordered" in entry:
        parts.append(f"{entry['reordered']} answers served out of retrieval order")
    own = entry.get("same_as_plain_vllm_on_own_prompts")
    if own is not None:
        parts.append(f"equal to plain vLLM's on its own ordered prompts {own['count']}/{own['of']}")
    return "; ".join(parts)
