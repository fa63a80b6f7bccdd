"""A model given by name (not a local folder): fail at once when no hub can provide it.

A name such as `meta-llama/Llama-3.2-1B` is resolved by transformers and vLLM through the
Hugging Face Hub. On a machine that cannot reach it they retry for most of a minute and then
raise an `OSError` that does not say the name was taken for a hub id. `check_hub_model` decides
in a few seconds instead: a copy in the local Hugging Face cache is fine; otherwise, with
`HF_HUB_OFFLINE` set or the hub's host unreachable, it raises `ModelError` naming the fix.
"""

from __future__ import annotations

import os
import socket
import threading
from typing import Any
from urllib.parse import urlsplit

from ragcache_core.errors import ModelError

__all__ = ["check_hub_model", "hub_endpoint", "load_tokenizer", "reach"]

PROBE_TIMEOUT_S = 3.0
"""How long the hub's host may take to accept a connection (name lookup included)."""

_FIX = (
    "pass the folder of a downloaded checkpoint instead (or build the offline test model: "
    "ragcache model build --size tiny --out DIR)"
)


def hub_endpoint() -> str:
    """The hub's URL: `HF_ENDPOINT` (read now, so a change after import counts), else
    huggingface_hub's default."""
    given = os.environ.get("HF_ENDPOINT")
    if given:
        return given.rstrip("/")
    from huggingface_hub import constants

    return str(constants.ENDPOINT).rstrip("/")


def check_hub_model(name: str) -> None:
    """Raise `ModelError` (in seconds, not after a minute of retries) when `name` is not a
    local folder and no hub can provide it: not in the local Hugging Face cache, and either
    `HF_HUB_OFFLINE` is set or the hub's host does not answer."""
    if _cached(name):
        return
    if os.environ.get("HF_HUB_OFFLINE", "").strip().lower() in ("1", "true", "yes", "on"):
        raise ModelError(
            f"model {name!r} is not a local folder and HF_HUB_OFFLINE is set (no cached copy); "
            + _FIX
        )
    endpoint = hub_endpoint()
    problem = reach(endpoint, PROBE_TIMEOUT_S)
    if problem is not None:
        raise ModelError(
            f"model {name!r} is not a local folder, and the Hugging Face Hub ({endpoint}) "
            f"cannot be reached ({problem}); " + _FIX
        )


def load_tokenizer(model: str) -> Any:
    """The model's tokenizer (transformers); `ModelError` instead of transformers' `OSError`
    when the folder or name does not hold one."""
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(model)
    except OSError as exc:
        raise ModelError(f"cannot load the tokenizer of model {model!r}: {exc}") from exc


def reach(url: str, timeout_s: float) -> str | None:
    """None when `url`'s host (or the proxy configured for it, `HTTPS_PROXY` and friends)
    accepts a TCP connection within `timeout_s` (name lookup included), else what went
    wrong."""
    parts = urlsplit(url)
    proxy = _proxy_for(parts.scheme, parts.hostname or "")
    if proxy:
        parts = urlsplit(proxy if "://" in proxy else f"http://{proxy}")
    host = parts.hostname
    if not host:
        return f"no host in {url!r}"
    port = parts.port or (443 if parts.scheme == "https" else 80)
    outcome: list[str | None] = []

    def connect() -> None:
        try:
            with socket.create_connection((host, port), timeout=timeout_s):
                outcome.append(None)
        except OSError as exc:
            outcome.append(exc.strerror or type(exc).__name__)

    # The name lookup has no timeout of its own: bound the whole attempt from outside.
    probe = threading.Thread(target=connect, name="ragcache-hub-probe", daemon=True)
    probe.start()
    probe.join(timeout_s + 1.0)
    if not outcome:
        return f"no answer from {host}:{port} within {timeout_s:.0f} s"
    return outcome[0]


def _proxy_for(scheme: str, host: str) -> str | None:
    """The proxy the hub client would use for `scheme://host` (from the environment)."""
    import urllib.request

    if not host or urllib.request.proxy_bypass(host):
        return None
    proxies = urllib.request.getproxies()
    return proxies.get(scheme) or proxies.get("all")


def _cached(name: str) -> bool:
    """Whether the local Hugging Face cache holds `name`'s config (no network)."""
    try:
        from huggingface_hub import try_to_load_from_cache

        found = try_to_load_from_cache(name, "config.json")
    except Exception:  # not a valid repo id, or no huggingface_hub: not cached
        return False
    return isinstance(found, str)
