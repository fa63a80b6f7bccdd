"""`ragcache bench prefill`: TTFT of full prefill vs RAGCache hits vs vLLM's prefix-cache floor.

For each document length (default 512, 1,024, 2,048, 4,096 tokens) and one engine run:

    full_s      document + question, nothing cached (vLLM prefix cache not read)
    gpu_hit_s   document KV loaded from the GPU pool, question computed
    host_hit_s  document KV loaded from the host pool (after a swap-out), question computed
    floor_s     document KV already in vLLM's own paged cache (a vLLM prefix-cache hit)

The engine runs with vLLM's prefix caching on, only to measure the floor; vLLM's prefix cache
is emptied before every RAGCache run, so those are served by the pools alone. Values are TTFT
medians (vLLM's own arrival-to-first-token) over `--repeats` runs, each with a new question.
The paper saw up to 11.5x (GPU hit) and 3.9x (host hit) over full prefill; the goal here is a
full hit within 1.5x of the floor.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
from dataclasses import asdict, dataclass
from typing import Any

from ragcache_core.cli.output import stdout_to_stderr

DOC_TOKENS = (512, 1024, 2048, 4096)
QUESTION_TOKENS = 32
PAGE = 16


@dataclass(frozen=True, slots=True)
class PrefillResult:
    doc_tokens: int
    full_s: float
    gpu_hit_s: float
    host_hit_s: float
    floor_s: float
    alignment_recomputed_tokens: int
    """Document tokens recomputed because of block alignment (per-token loads: always 0)."""


def measure(
    model: str,
    doc_tokens: tuple[int, ...] = DOC_TOKENS,
    repeats: int = 5,
    seed: int = 0,
    progress: bool = False,
) -> dict[str, Any]:
    """Run the benchmark in one engine; returns the `--json` document."""
    from ragcache_core.engine.cached import CachedEngine, PoolSettings
    from ragcache_core.engine.llm import GreedySampling
    from ragcache_core.engine.settings import EngineSpec
    from ragcache_core.plan import LoadSpan, Plan, SlotCopy, StoreSpan, Tier
    from ragcache_core.storage.layout import layout_for_model
    from ragcache_core.storage.memory import GIB

    longest = max(doc_tokens)
    layout = layout_for_model(model, dtype="float32", page_size=PAGE)
    pool_gib = (-(-longest // PAGE) + 1) * layout.slot_bytes / GIB
    spec = EngineSpec(
        model=model,
        dtype="float32",
        prefix_caching=True,  # only to measure the floor; emptied before every RAGCache run
        max_model_len=longest + QUESTION_TOKENS + 64,
        max_num_batched_tokens=longest + QUESTION_TOKENS + 64,
        kv_cache_bytes=int(max(1.0, 4 * (longest + 128) * layout.token_bytes / GIB) * GIB),
    )
    pools = PoolSettings(
        gpu_pool_gib=pool_gib,
        host_pool_gib=pool_gib,
        page_size=PAGE,
        host_pool_name="bench-prefill",
    )
    rng = random.Random(seed)
    sampling = GreedySampling(max_tokens=1)
    results: list[PrefillResult] = []
    engine = CachedEngine(spec, pools)
    try:
        vocab = _vocab_size(model)

        def tokens(n: int) -> list[int]:
            return [rng.randrange(3, vocab) for _ in range(n)]

        engine.run(tokens(64), None, sampling)  # warm-up
        for n in doc_tokens:
            doc = tokens(n)
            pages = -(-n // PAGE)
            gpu, host = tuple(range(pages)), tuple(range(pages))
            gpu_load = Plan(PAGE, load=(LoadSpan(Tier.GPU, gpu, 0, n),))
            host_load = Plan(PAGE, load=(LoadSpan(Tier.HOST, host, 0, n),))

            def ttft(doc: list[int], plan: Plan | None, *, floor: bool = False) -> float:
                if plan is not None:
                    engine.reset_prefix_cache()  # RAGCache runs are served by the pools alone
                prompt = doc + tokens(QUESTION_TOKENS)
                return float(engine.run(prompt, plan, sampling, read_prefix_cache=floor).ttft_s)

            full = [ttft(doc, None) for _ in range(repeats)]
            engine.reset_prefix_cache()
            engine.run(
                doc + tokens(QUESTION_TOKENS), Plan(PAGE, store=(StoreSpan(gpu, 0, n),)), sampling
            )
            gpu_hit = [ttft(doc, gpu_load) for _ in range(repeats)]
            engine.reset_prefix_cache()
            engine.run(tokens(8), Plan(PAGE, swap_out=(SlotCopy(gpu, host),)), sampling)
            host_hit = [ttft(doc, host_load) for _ in range(repeats)]
            engine.reset_prefix_cache()
            ttft(doc, None, floor=True)  # puts the document into vLLM's prefix cache
            floor = [ttft(doc, None, floor=True) for _ in range(repeats)]
            result = PrefillResult(
                doc_tokens=n,
                full_s=statistics.median(full),
                gpu_hit_s=statistics.median(gpu_hit),
                host_hit_s=statistics.median(host_hit),
                floor_s=statistics.median(floor),
                alignment_recomputed_tokens=0,
            )
            results.append(result)
            if progress:
                print(f"  {_row(result)}", file=sys.stderr, flush=True)
        memory = {
            "token_kv_bytes": layout.token_bytes,
            "gpu_pool_bytes": layout.pool_bytes(engine.gpu_slots),
            "host_pool_bytes": layout.pool_bytes(engine.host_slots),
            "vllm_kv_cache_bytes": spec.kv_cache_bytes,
        }
    finally:
        engine.close(unlink_host_pool=True)
    return {
        "model": model,
        "page_size": PAGE,
        "question_tokens": QUESTION_TOKENS,
        "repeats": repeats,
        "memory": memory,
        "results": [asdict(r) for r in results],
    }


def _vocab_size(model: str) -> int:
    from pathlib import Path

    config = json.loads((Path(model) / "config.json").read_text())
    return int(config.get("text_config", config)["vocab_size"])


def _row(r: PrefillResult) -> str:
    return (
        f"{r.doc_tokens:>5} tokens: full {r.full_s * 1e3:8.1f} ms"
        f" | GPU hit {r.gpu_hit_s * 1e3:7.1f} ms"
        f" ({r.full_s / r.gpu_hit_s:4.1f}x) | host hit {r.host_hit_s * 1e3:7.1f} ms"
        f" ({r.full_s / r.host_hit_s:4.1f}x) | floor {r.floor_s * 1e3:7.1f} ms"
        f" | GPU hit / floor {r.gpu_hit_s / r.floor_s:4.2f}"
    )


def register(bench_subparsers: Any) -> None:
    parser = bench_subparsers.add_parser(
        "prefill", help="TTFT: full prefill vs GPU-pool / host-pool hits vs vLLM prefix cache"
    )
    parser.add_argument(
        "--model", help="local checkpoint folder (default: the offline bench model)"
    )
    parser.add_argument(
        "--doc-tokens",
        type=int,
        nargs="+",
        default=list(DOC_TOKENS),
        help="document lengths in tokens (default: 512 1024 2048 4096)",
    )
    parser.add_argument("--repeats", type=int, default=5, help="runs per median (default 5)")
    parser.add_argument("--json", action="store_true", help="print the results as JSON")
    parser.set_defaults(func=_run)


def _run(args: argparse.Namespace) -> int:
    from ragcache_core.cli import CliError

    if args.repeats < 1 or any(n < 1 for n in args.doc_tokens):
        raise CliError("--repeats and --doc-tokens must be positive")
    model = args.model
    if model is None:
        from ragcache_core.testing.tiny_model import build_tiny_model

        model = str(build_tiny_model(size="bench", attention="mha"))
    else:
        from ragcache_core.engine.config import check_model_folder

        model = str(check_model_folder(model))
    if args.json:
        # vLLM's processes log to stdout: keep stdout for the JSON document alone.
        with stdout_to_stderr():
            report = measure(model, tuple(args.doc_tokens), args.repeats)
    else:
        report = measure(model, tuple(args.doc_tokens), args.repeats, progress=True)
    if args.json:
        print(json.dumps(report, indent=1))
    else:
        for r in report["results"]:
            print(_row(PrefillResult(**r)))
    return 0
