"""`ragcache doctor`: check the stack end to end and print the engine's TTFT.

Checks torch, vLLM (version in the tested range), Faiss; builds (or reuses) the offline tiny
model unless `--model` names one, and says which kind of model it checks (`weights`:
random-weight, or real, by name when `ragcache model fetch` made it); starts vLLM with
RAGCache's safe defaults; generates; prints the TTFT vLLM measured for a prompt.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path
from typing import Any

from ragcache_core.cli.output import add_verbose, vllm_log
from ragcache_core.errors import CliError


def register(subparsers: Any) -> None:
    parser = subparsers.add_parser(
        "doctor", help="check torch, vLLM and Faiss, start the engine, print a TTFT"
    )
    parser.add_argument("--model", type=Path, default=None, help="a local model folder")
    parser.add_argument("--prompt-tokens", type=int, default=512)
    add_verbose(parser)
    parser.set_defaults(func=_doctor)


def _step(name: str, value: str) -> None:
    print(f"  {name:<22} {value}", flush=True)


def _doctor(args: argparse.Namespace) -> int:
    from ragcache_core.engine.settings import check_model_folder

    # Validate input before any slow import or engine start.
    model = check_model_folder(args.model) if args.model is not None else None
    if args.prompt_tokens < 1:
        raise CliError(f"--prompt-tokens must be at least 1, got {args.prompt_tokens}")

    print("ragcache doctor")
    vllm_log(args, "doctor", sys.stdout)
    import torch

    _step("torch", f"{torch.__version__} (cuda available: {torch.cuda.is_available()})")
    import faiss

    _step("faiss", str(faiss.__version__))
    from ragcache_core.engine.compat import check_vllm_version

    _step("vllm", check_vllm_version())

    if model is None:
        from ragcache_core.models import build_tiny_model

        started = time.perf_counter()
        model = build_tiny_model(size="tiny")
        _step("model", f"{model} (built/reused in {time.perf_counter() - started:.1f} s)")
    else:
        _step("model", str(model))
    from ragcache_core.models import describe_model

    _step("weights", describe_model(model))

    from ragcache_core.config import SamplingConfig
    from ragcache_core.engine.llm import Engine
    from ragcache_core.engine.settings import EngineSpec, build_settings, detect_device

    device = detect_device()
    settings = build_settings(EngineSpec(model=str(model)), device)
    _step("device", f"{device.kind} {device.name} ({settings.dtype})")
    with Engine(settings) as engine:
        _step("engine start", f"{engine.start_s:.1f} s")
        vocab = len(engine.tokenizer())
        prompt = [(7 * i + 3) % vocab for i in range(args.prompt_tokens)]
        engine.generate([prompt], SamplingConfig(max_tokens=2, ignore_eos=True))  # warm-up
        result = engine.generate([prompt], SamplingConfig(max_tokens=8, ignore_eos=True))[0]
        _step("generated", " ".join(map(str, result.token_ids)))
        print(
            f"TTFT: {result.ttft_s * 1000:.1f} ms for a {len(prompt)}-token prompt (vLLM metrics)"
        )
    return 0
