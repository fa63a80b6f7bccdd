"""`ragcache bench serve`: the serving benchmark (see `bench.sweep` for the method).

    ragcache bench serve --smoke            # tests: tiny model, 3 systems, a few requests
    ragcache bench serve --quick            # real figures in under 10 minutes (demo stream)
    ragcache bench serve                    # the full sweep (~1.7 hours here, estimated by parts)
    ragcache bench serve --workloads long,noreuse --systems vllm,ragcache --repeats 3
    ragcache bench serve --workloads search-heavy   # speculation's ablation, 1M-row index

Writes DIR/serve.json (settings, git commit, every point) and PNG plots into `--out`.
`search-heavy` (`bench.search_heavy`) runs alone: the real documents in an IVF index padded to
1M rows, search on one core and vLLM on the other, ragcache against ragcache-nospec at each
search ratio.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

from ragcache_core.bench.systems import ABLATIONS, MAIN_SYSTEMS, SYSTEMS
from ragcache_core.bench.workloads import RETRIEVERS, WORKLOADS
from ragcache_core.errors import CliError

HEAVY = "search-heavy"
"""`bench.search_heavy.NAME` (not imported here: `--help` stays light)."""


def register(bench_subparsers: Any) -> None:
    from ragcache_core.bench.sweep import FULL_ESTIMATE

    p = bench_subparsers.add_parser(
        "serve",
        help="TTFT and throughput vs request rate: vLLM, vLLM-APC, RAGCache and ablations",
        description=__doc__,
        epilog=f"The full sweep (no mode): {FULL_ESTIMATE}.",
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    mode = p.add_mutually_exclusive_group()
    mode.add_argument("--smoke", action="store_true", help="tiny model, a few requests, no sweep")
    mode.add_argument("--quick", action="store_true", help="real figures in under 10 minutes")
    p.add_argument("--model", type=Path, default=None, help="a local checkpoint folder")
    p.add_argument(
        "--workloads", default=None, help=f"comma list of {', '.join(WORKLOADS)}, or {HEAVY}"
    )
    p.add_argument("--systems", default=None, help=f"comma list of {', '.join(MAIN_SYSTEMS)}")
    p.add_argument(
        "--ablations", default=None, help=f"comma list of {', '.join(ABLATIONS)}, or none"
    )
    p.add_argument("--requests", type=int, default=None, help="measured requests per point")
    p.add_argument("--warmup", type=int, default=None, help="unmeasured requests first per point")
    p.add_argument("--repeats", type=int, default=None, help="rounds per rate")
    p.add_argument("--max-points", type=int, default=None, help="rates in the ladder at most")
    p.add_argument("--rate", type=float, default=None, help="first rate (default: calibrated)")
    p.add_argument("--top-k", type=int, default=None, help="override each workload's top-k")
    p.add_argument(
        "--saturate",
        metavar="SYSTEM",
        default=None,
        help="instead of the ladder: find SYSTEM's saturated rate (mean TTFT 2x its light-load"
        " mean, by a ladder of SYSTEM alone) and measure every system there and at 1.5x it",
    )
    p.add_argument(
        "--retriever",
        choices=tuple(RETRIEVERS),
        default="tfidf",
        help="tfidf: the offline default; minilm: all-MiniLM-L6-v2 (the 'embed' extra)",
    )
    p.add_argument("--max-tokens", type=int, default=8, help="answer tokens (fixed length)")
    p.add_argument("--vllm-kv-gib", type=float, default=0.25, help="vLLM's own KV of every system")
    p.add_argument("--host-pool-tokens", type=int, default=65536)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument(
        "--data-dir",
        type=Path,
        default=None,
        help="the benchmark data folder of the shared-data workloads (default: "
        "$RAGCACHE_DATA_DIR, else ../shared/data; docs/benchmarks.md, 'Benchmark data')",
    )
    heavy = p.add_argument_group("search-heavy (speculation's ablation)")
    heavy.add_argument(
        "--search-ratios", default=None, help="shares of the IVF lists probed, e.g. 0.125,0.25,1"
    )
    heavy.add_argument("--search-stages", type=int, default=None, help="stages per search")
    heavy.add_argument("--kb-vectors", type=int, default=None, help="index rows, padding included")
    heavy.add_argument("--kb-nlist", type=int, default=None, help="IVF lists")
    heavy.add_argument("--kb-dimension", type=int, default=None, help="embedding dimension")
    heavy.add_argument("--kb-codes", choices=("sq8", "fp16", "float32"), default=None)
    heavy.add_argument(
        "--light-only",
        action="store_true",
        help="one request at a time only (no Poisson stream per ratio)",
    )
    heavy.add_argument(
        "--no-core-split",
        dest="core_split",
        action="store_false",
        help="let search and vLLM share every core (default: one each)",
    )
    p.add_argument("--out", type=Path, default=Path("bench-serve"), help="folder for JSON + PNGs")
    p.add_argument("--json", action="store_true", help="print the JSON document to stdout")
    p.set_defaults(func=_run)


def _names(
    text: str | None, default: tuple[str, ...], allowed: tuple[str, ...], what: str
) -> tuple[str, ...]:
    if text is None:
        return default
    if text.strip() == "none":
        return ()
    names = tuple(n.strip() for n in text.split(",") if n.strip())
    unknown = sorted(set(names) - set(allowed))
    if unknown or not names:
        raise CliError(f"unknown {what} {unknown or text!r}: choose from {', '.join(allowed)}")
    return names


def resolve_mode(args: argparse.Namespace) -> Any:
    """The `Mode` chosen by --smoke/--quick, with the command line's overrides applied.
    Raises `CliError` for bad values."""
    from dataclasses import replace

    from ragcache_core.bench.sweep import MODES

    mode = MODES["smoke" if args.smoke else "quick" if args.quick else "full"]
    for name in ("requests", "warmup", "repeats", "max_points", "top_k", "rate"):
        value = getattr(args, name)
        if value is not None and (value < 1 if name != "warmup" and name != "rate" else value < 0):
            raise CliError(f"--{name.replace('_', '-')} must be positive, got {value}")
    if args.rate is not None and args.rate <= 0:
        raise CliError(f"--rate must be positive, got {args.rate}")
    if args.max_tokens < 1 or args.vllm_kv_gib <= 0 or args.host_pool_tokens < 0:
        raise CliError("--max-tokens and --vllm-kv-gib must be positive, pool sizes not negative")
    overrides = {k: getattr(args, k) for k in ("requests", "warmup", "repeats", "max_points")}
    mode = replace(mode, **{k: v for k, v in overrides.items() if v is not None})
    systems = _names(args.systems, mode.systems, tuple(SYSTEMS), "system(s)")
    workloads = _names(args.workloads, mode.workloads, (*WORKLOADS, HEAVY), "workload(s)")
    if args.saturate is not None and args.saturate not in systems:
        raise CliError(f"--saturate {args.saturate}: not among the systems ({', '.join(systems)})")
    if args.saturate is not None and (mode.light < 1 or HEAVY in workloads):
        raise CliError("--saturate needs a light-load run: not with --smoke or search-heavy")
    if HEAVY in workloads and len(workloads) > 1:
        raise CliError(f"{HEAVY} runs alone (its engines are pinned to their cores)")
    return replace(
        mode,
        workloads=workloads,
        systems=systems,
        ablations=_names(args.ablations, mode.ablations, ABLATIONS, "ablation(s)"),
    )


def _run(args: argparse.Namespace) -> int:
    from ragcache_core.bench.data_dir import require_data, resolve_data_dir
    from ragcache_core.bench.workloads import workload_files
    from ragcache_core.engine.settings import check_model_folder

    mode = resolve_mode(args)
    refused = [SYSTEMS[n].cuda_only for n in mode.systems if SYSTEMS[n].cuda_only]
    if refused:
        from ragcache_core.engine.settings import detect_device

        if not detect_device().is_cuda:
            raise CliError(str(refused[0]))
    # Before any engine starts: a missing data file names the flag and the variable. (The
    # search-heavy workload's data is checked as it loads, through `load_workload`.)
    needed = sorted({f for n in mode.workloads if n != HEAVY for f in workload_files(n)})
    if needed:
        require_data(resolve_data_dir(args.data_dir), needed)
    model = check_model_folder(args.model) if args.model else None
    from ragcache_core.bench.report import run_bench
    from ragcache_core.cli.output import stdout_to_stderr

    with stdout_to_stderr():  # vLLM's processes log to stdout: keep it for the results alone
        document = run_bench(mode, args, model)
    if args.json:
        print(json.dumps(document, indent=1))
    elif mode.workloads == (HEAVY,):
        from ragcache_core.bench.search_heavy_report import print_search_heavy

        print_search_heavy(document, sys.stdout)
    else:
        from ragcache_core.bench.report import print_tables

        print_tables(document, sys.stdout)
    return 0
