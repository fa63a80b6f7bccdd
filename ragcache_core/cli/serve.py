"""`ragcache serve`: one engine and one knowledge tree behind an OpenAI-compatible HTTP API,
shared by every app process (docs/deploy.md)."""

from __future__ import annotations

import argparse
import logging
import os
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ragcache_core.config import DEFAULT_POLICY
from ragcache_core.errors import CliError
from ragcache_core.policy import POLICIES

if TYPE_CHECKING:
    from ragcache_core.serve.state import ServeSettings

API_KEY_ENV = "RAGCACHE_API_KEY"
ADMIN_KEY_ENV = "RAGCACHE_ADMIN_KEY"


def register(subparsers: Any) -> None:
    p = subparsers.add_parser(
        "serve",
        help="serve one engine and one knowledge tree over HTTP (OpenAI-compatible)",
        description=(
            "Serve POST /v1/chat/completions and /v1/completions (OpenAI-compatible; pass the "
            "retrieved documents as the 'documents' extension field to cache them), "
            "POST /v1/rag/query (server-side search over --index), GET /metrics, /health, "
            "/v1/models and POST /v1/cache/invalidate. One process owns the engine; it "
            "dies with the server (a watchdog), and what crashed servers left in shared "
            "memory is reclaimed at start. See docs/deploy.md."
        ),
    )
    p.add_argument("--model", type=Path, required=True, metavar="DIR", help="model folder")
    p.add_argument("--index", type=Path, default=None, metavar="DIR", help="a ragcache index")
    p.add_argument("--host", default="127.0.0.1", help="default: %(default)s")
    p.add_argument(
        "--port",
        type=int,
        default=8000,
        help="default: %(default)s; 0: any free port (bound before the engine starts; the "
        "'ready on' log line names it)",
    )
    p.add_argument(
        "--fd",
        type=int,
        default=None,
        metavar="N",
        help="serve on a bound TCP socket inherited as file descriptor N (for supervisors, as "
        "ragcache replicas does); its address replaces --host and --port",
    )
    p.add_argument(
        "--api-key", default=os.environ.get(API_KEY_ENV), help=f"bearer key (env {API_KEY_ENV})"
    )
    p.add_argument(
        "--admin-key",
        default=os.environ.get(ADMIN_KEY_ENV),
        help=f"the only key that opens /v1/cache/invalidate and /integrity (env {ADMIN_KEY_ENV}; "
        "default: the API key opens them)",
    )
    p.add_argument(
        "--api-key-file",
        type=Path,
        default=None,
        metavar="FILE",
        help="several keys, one '<key> [tenant]' per line (docs/deploy.md, Tenants)",
    )
    p.add_argument(
        "--salt-per-key",
        action="store_true",
        help="salt every request with its key's tenant: no cross-tenant cache hits",
    )
    p.add_argument(
        "--served-model-name", default=None, help="the name in /v1/models (default: the folder's)"
    )
    p.add_argument("--workers", type=int, default=1, help="must be 1: one process owns the engine")
    p.add_argument("--max-waiting", type=int, default=None, help="queue beyond max-num-seqs (64)")
    p.add_argument("--drain-timeout", type=float, default=30.0, help="seconds (%(default)s)")
    p.add_argument("--log-level", default="warning", help="uvicorn's (%(default)s)")
    # (Defaults left to ServeSettings, which --help does not import: it loads FastAPI.)
    p.add_argument(
        "--max-body-mib", type=float, default=None, help="a larger request body gets 413 (8)"
    )
    p.add_argument(
        "--header-timeout",
        type=float,
        default=None,
        help="seconds a connection has to send its request headers (10)",
    )
    p.add_argument(
        "--read-timeout",
        type=float,
        default=None,
        help="seconds each part of a request body may take to arrive (30)",
    )
    p.add_argument(
        "--replica-id",
        default=None,
        help="this replica's name in the X-RAGCache-Replica response header (host:port)",
    )
    p.add_argument(
        "--peers",
        nargs="*",
        default=(),
        metavar="URL",
        help="the other replicas (http://host:port): an invalidation fans out to them",
    )
    _cache_options(p)
    p.set_defaults(func=_serve)


def _cache_options(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("cache (CacheConfig; docs/configuration.md)")
    g.add_argument("--host-pool-tokens", type=int, default=None)
    g.add_argument("--page-size", type=int, default=None)
    g.add_argument(
        "--policy", default=None, help=f"{', '.join(POLICIES)} (default {DEFAULT_POLICY})"
    )
    g.add_argument("--top-k", type=int, default=None, help="documents per /v1/rag/query")
    g.add_argument(
        "--document-order",
        choices=("retrieval", "cache"),
        default=None,
        help="the prompt's document order when a request names none: retrieval (default) or "
        "cache (follows the cached path; docs/configuration.md 'Document order')",
    )
    g.add_argument("--system-prompt", default=None, help="the tree's root")
    g.add_argument("--max-tokens", type=int, default=None, help="/v1/rag/query's default answer")
    g.add_argument("--max-model-len", type=int, default=None)
    g.add_argument("--max-num-seqs", type=int, default=None)
    g.add_argument("--vllm-kv-cache-gib", type=float, default=None)
    g.add_argument("--request-timeout", type=float, default=None, help="seconds per event")
    g.add_argument("--no-speculation", action="store_true")


def _serve(args: argparse.Namespace) -> int:
    from ragcache_core.engine.settings import check_model_folder

    if args.workers != 1:
        raise CliError(
            f"--workers {args.workers}: one server process owns the engine and the knowledge "
            "tree; run one worker and point every app process at it (docs/deploy.md)"
        )
    model = check_model_folder(args.model)
    if args.index is not None and not (args.index / "manifest.json").is_file():
        raise CliError(f"--index {args.index}: not a ragcache index (no manifest.json)")
    from ragcache_core.serve.listen import adopt_socket, bind_socket, bound_host, bound_port

    # The port is held from here on, before the engine's start (serve/listen.py).
    if args.fd is not None:
        sock = adopt_socket(args.fd)
        args.host, args.port = bound_host(sock), bound_port(sock)
    else:
        sock = bind_socket(args.host, args.port)
    try:
        settings = _settings(args, str(model))
        logging.getLogger("ragcache_core.serve").setLevel(logging.INFO)
        from ragcache_core.serve.app import run

        run(settings, sock)
    finally:
        sock.close()
    return 0


def _settings(args: argparse.Namespace, model: str) -> ServeSettings:
    import dataclasses

    from ragcache_core.config import CacheConfig
    from ragcache_core.serve.auth import read_key_file
    from ragcache_core.serve.state import DEFAULT_MAX_WAITING, ServeSettings

    config = CacheConfig()
    changes = {
        "host_pool_tokens": args.host_pool_tokens,
        "page_size": args.page_size,
        "policy": args.policy,
        "top_k": args.top_k,
        "document_order": args.document_order,
        "max_model_len": args.max_model_len,
        "max_num_seqs": args.max_num_seqs,
        "vllm_kv_cache_gib": args.vllm_kv_cache_gib,
        "request_timeout_s": args.request_timeout,
    }
    config = config.with_(**{k: v for k, v in changes.items() if v is not None})
    if args.no_speculation:
        config = config.with_(speculation=False)
    if args.system_prompt is not None:
        config = config.with_(
            prompt=dataclasses.replace(config.prompt, system_prompt=args.system_prompt)
        )
    if args.max_tokens is not None:
        config = config.with_(
            sampling=dataclasses.replace(config.sampling, max_tokens=args.max_tokens)
        )
    return ServeSettings(
        model=model,
        config=config,
        index=args.index,
        host=args.host,
        port=args.port,
        api_key=args.api_key or None,
        admin_key=args.admin_key or None,
        api_keys=() if args.api_key_file is None else read_key_file(args.api_key_file),
        salt_per_key=args.salt_per_key,
        served_model_name=args.served_model_name,
        max_waiting=DEFAULT_MAX_WAITING if args.max_waiting is None else args.max_waiting,
        drain_timeout_s=args.drain_timeout,
        log_level=args.log_level,
        replica_id=args.replica_id,
        peers=tuple(args.peers),
        **_limits(args),
    )


def _limits(args: argparse.Namespace) -> dict[str, Any]:
    """The connection limits given on the command line (the rest keep their defaults)."""
    given = {
        "max_body_bytes": None if args.max_body_mib is None else round(args.max_body_mib * 2**20),
        "header_timeout_s": args.header_timeout,
        "read_timeout_s": args.read_timeout,
    }
    return {k: v for k, v in given.items() if v is not None}
