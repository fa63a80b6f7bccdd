"""`ragcache demo`: the main job. One real question stream through vLLM, vLLM with prefix
caching, and RAGCache, side by side; a table, a PNG chart and (with --json) one JSON object.

With no arguments it builds the offline bench model, indexes the Wikipedia sample shipped in
the package and streams the shipped NQ-open / MMLU questions (see ragcache_core/data/).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from importlib import resources
from pathlib import Path
from typing import Any

DEFAULTS = {"requests": 160, "rate": 4.0, "top_k": 2, "max_tokens": 8}


def register(subparsers: Any) -> None:
    p = subparsers.add_parser(
        "demo",
        help="run one question stream through vLLM, vLLM-APC and RAGCache; print a table",
        description=__doc__,
    )
    p.add_argument("--model", type=Path, default=None, help="a local checkpoint folder")
    p.add_argument("--corpus", type=Path, action="append", default=None, help="JSONL (repeatable)")
    p.add_argument("--text-field", default="text,context", help="candidates, first present wins")
    p.add_argument("--id-field", default="doc_id,paragraph_id,id", help="candidates")
    p.add_argument("--questions", type=Path, default=None, help="JSONL of questions")
    p.add_argument("--question-field", default="question,input", help="candidates")
    p.add_argument("--requests", type=int, default=DEFAULTS["requests"])
    p.add_argument("--rate", type=float, default=DEFAULTS["rate"], help="requests per second")
    p.add_argument("--top-k", type=int, default=DEFAULTS["top_k"])
    p.add_argument("--max-tokens", type=int, default=DEFAULTS["max_tokens"])
    p.add_argument("--systems", default=",".join(("vllm", "vllm-apc", "ragcache")))
    p.add_argument("--index-kind", choices=("ivf", "hnsw", "flat"), default="ivf")
    p.add_argument(
        "--vllm-kv-gib",
        type=float,
        default=0.25,
        help="vLLM's own paged KV cache of every system (the scarce 'GPU' memory)",
    )
    p.add_argument("--gpu-pool-tokens", type=int, default=8192, help="RAGCache's GPU pool")
    p.add_argument("--host-pool-tokens", type=int, default=65536, help="RAGCache's host pool")
    p.add_argument("--speculation", choices=("on", "off"), default="on")
    p.add_argument("--reorder", choices=("on", "off"), default="on")
    p.add_argument("--policy", default="pgdsf", help="pgdsf, gdsf, lru or lfu")
    p.add_argument("--chart", type=Path, default=Path("ragcache-demo.png"))
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--size", choices=("tiny", "bench"), default="bench", help="built model size")
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.set_defaults(func=_demo)


def _data(name: str) -> Path:
    return Path(str(resources.files("ragcache_core") / "data" / name))


def _demo(args: argparse.Namespace) -> int:
    from ragcache_core.cli import CliError
    from ragcache_core.engine.config import check_model_folder

    if args.requests < 1 or args.rate <= 0 or args.top_k < 1 or args.max_tokens < 1:
        raise CliError("--requests, --rate, --top-k and --max-tokens must be positive")
    systems = [s.strip() for s in args.systems.split(",") if s.strip()]
    unknown = set(systems) - {"vllm", "vllm-apc", "ragcache"}
    if unknown or not systems:
        raise CliError(f"unknown system(s) {sorted(unknown)}: choose from vllm, vllm-apc, ragcache")
    for path in [*(args.corpus or []), *([args.questions] if args.questions else [])]:
        if not path.is_file():
            raise CliError(f"no such file: {path}")
    model = check_model_folder(args.model) if args.model else None

    from tqdm import tqdm

    from ragcache_core.bench.serve import default_sampling, run_ragcache, run_vllm
    from ragcache_core.cli.output import stdout_to_stderr
    from ragcache_core.config import CacheConfig
    from ragcache_core.retrieval.corpus import load_corpus, load_questions
    from ragcache_core.retrieval.index_store import IndexSettings, build_index
    from ragcache_core.retrieval.trace import poisson_arrivals

    log = sys.stderr
    if model is None:
        from ragcache_core.testing.tiny_model import build_tiny_model

        print(f"building the offline {args.size} model ...", file=log, flush=True)
        model = build_tiny_model(size=args.size)
    corpus = args.corpus or [_data("demo_corpus.jsonl")]
    documents = load_corpus(corpus, text_fields=args.text_field, id_fields=args.id_field)
    index = build_index(documents, IndexSettings(kind=args.index_kind), progress=True)
    question_file = args.questions or _data("demo_questions.jsonl")
    pool = load_questions(question_file, question_fields=args.question_field)
    import random

    rng = random.Random(args.seed)
    questions = [q.text for q in rng.sample(pool, min(args.requests, len(pool)))]
    while len(questions) < args.requests:  # a short question file: repeat it
        questions.append(rng.choice(pool).text)
    arrivals = [float(x) for x in poisson_arrivals(len(questions), args.rate, args.seed)]
    config = CacheConfig(
        top_k=args.top_k,
        sampling=default_sampling(args.max_tokens),
        gpu_pool_tokens=args.gpu_pool_tokens,
        host_pool_tokens=args.host_pool_tokens,
        vllm_kv_cache_gib=args.vllm_kv_gib,
        speculation=args.speculation == "on",
        reorder=args.reorder == "on",
        policy=args.policy,
    )
    source = index.source()
    runs = {}
    for name in systems:
        bar = tqdm(total=len(questions), desc=f"{name:>9}", unit="req", file=log)

        def progress(_: str, done: int, bar: Any = bar) -> None:
            bar.n = done
            bar.refresh()

        started = time.perf_counter()
        # vLLM's processes log to stdout: keep stdout for the table / JSON document alone.
        with stdout_to_stderr():
            if name == "ragcache":
                runs[name] = run_ragcache(model, config, source, questions, arrivals, progress)
            else:
                runs[name] = run_vllm(name, model, config, source, questions, arrivals, progress)
        bar.close()
        print(f"{name}: {time.perf_counter() - started:.0f} s", file=log, flush=True)

    settings = {
        "model": str(model),
        "corpus": [str(c) for c in corpus],
        "documents": len(documents),
        "questions": str(question_file),
        "requests": len(questions),
        "rate_rps": args.rate,
        "top_k": args.top_k,
        "max_tokens": args.max_tokens,
        "index": args.index_kind,
        "vllm_kv_gib": args.vllm_kv_gib,
        "gpu_pool_tokens": args.gpu_pool_tokens,
        "host_pool_tokens": args.host_pool_tokens,
        "policy": config.policy,
        "reorder": config.reorder,
        "speculation": config.speculation,
    }
    summaries = {name: run.summary() for name, run in runs.items()}
    settings["identical_answers"] = _agreement(runs)
    _chart(runs, args.chart)
    if args.json:
        print(json.dumps({"settings": settings, "systems": summaries}, indent=1))
    else:
        _table(settings, summaries, args.chart)
    return 0


def _table(settings: dict[str, Any], systems: dict[str, dict[str, Any]], chart: Path) -> None:
    print(
        f"\nmodel {settings['model']}, {settings['documents']} documents, "
        f"{settings['requests']} requests at {settings['rate_rps']}/s, top-{settings['top_k']}, "
        f"{settings['max_tokens']} answer tokens\n"
    )
    header = (
        f"{'system':<10}{'TTFT mean':>11}{'p50':>9}{'p95':>9}{'req/s':>8}"
        f"{'hit':>7}{'GPU':>7}{'host':>7}{'tokens':>8}  speculation (started/aborted/used)"
    )
    print(header)
    print("-" * len(header))
    base = systems.get("vllm", {}).get("ttft_mean_s")
    for name, s in systems.items():
        spec = s.get("speculation")
        spec_text = f"{spec['started']}/{spec['aborted']}/{spec['used']}" if spec else "-"
        print(
            f"{name:<10}{s['ttft_mean_s'] * 1000:>9.0f}ms{s['ttft_p50_s'] * 1000:>7.0f}ms"
            f"{s['ttft_p95_s'] * 1000:>7.0f}ms{s['throughput_rps']:>8.2f}"
            f"{_pct(s, 'doc_hit_rate')}{_pct(s, 'gpu_doc_hit_rate')}"
            f"{_pct(s, 'host_doc_hit_rate')}{_pct(s, 'token_hit_rate', 8)}  {spec_text}"
        )
    print(f"\nanswers identical across systems: {settings['identical_answers']} requests")
    if base and "ragcache" in systems and systems["ragcache"]["ttft_mean_s"]:
        ratio = base / systems["ragcache"]["ttft_mean_s"]
        print(f"vLLM mean TTFT / RAGCache mean TTFT = {ratio:.2f} (above 1: RAGCache is faster)")
    print(f"chart: {chart}")


def _agreement(runs: dict[str, Any]) -> str:
    """How many requests got the same answer tokens from every system (greedy, float32: all
    of them should, since the cache must not change the output)."""
    answers = [run.answers for run in runs.values()]
    same = sum(1 for per_request in zip(*answers, strict=True) if len(set(per_request)) == 1)
    return f"{same}/{len(answers[0]) if answers else 0}"


def _pct(summary: dict[str, Any], key: str, width: int = 7) -> str:
    return f"{summary[key] * 100:>{width - 1}.0f}%" if key in summary else f"{'-':>{width}}"


def _chart(runs: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(9, 4.5))
    for name, run in runs.items():
        ax.plot(
            range(1, len(run.ttfts) + 1),
            [t * 1000 for t in run.ttfts],
            marker="o",
            markersize=3,
            linewidth=1,
            label=name,
        )
    ax.set_xlabel("request (arrival order)")
    ax.set_ylabel("time to first token (ms)")
    ax.set_title("TTFT per request: vLLM vs vLLM prefix caching vs RAGCache")
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
