"""Exceptions raised by RAGCache. Every user-facing error derives from `RAGCacheError`."""

from __future__ import annotations


class RAGCacheError(Exception):
    """Base class of every error RAGCache raises on purpose (bad input, bad state)."""


class ModelError(RAGCacheError):
    """A model folder is missing, incomplete or unusable."""


class FetchError(ModelError):
    """Fetching a real model failed (`ragcache_core.models.fetch_model`): the download, its
    pinned sha256, the disk, or the converted model's shape. Nothing half-written is kept."""


class CacheClosedError(RAGCacheError):
    """A call on a `RAGCache` or `RAGCacheClient` after its `close()` (or one cut short by
    it). Create a new one to go on; nothing of the closed one is kept."""


class ConfigError(RAGCacheError, ValueError):
    """A configuration value is out of range or inconsistent."""


class InputError(RAGCacheError, ValueError):
    """User input (a trace, a corpus, a query) is malformed; the message names the problem and
    `param`, when set, the field (what `ragcache serve` reports as the error's `param`)."""

    def __init__(self, message: str = "", *, param: str | None = None) -> None:
        super().__init__(message)
        self.param = param


class SamplingError(ConfigError, InputError):
    """A sampling setting outside what vLLM accepts (`SamplingConfig`); `param` names it. Both
    a `ConfigError` (a bad setting) and an `InputError` (a bad request: 400 in the server)."""


class PromptTooLong(InputError):
    """A prompt longer than the tokens that fit (`limit`). `tokens` is how many it has, or
    at least has: a prompt is refused as soon as it is known not to fit, before the rest of
    it is tokenized (or before any of it is, when its text alone is too long)."""

    def __init__(self, message: str, *, tokens: int, limit: int) -> None:
        super().__init__(message)
        self.tokens = tokens
        self.limit = limit


class CliError(RAGCacheError):
    """A problem with a `ragcache` command's input, printed as one line (exit code 2)."""


class MainGuardError(RAGCacheError, RuntimeError):
    """A script starts vLLM at import time, outside `if __name__ == "__main__":`; vLLM's
    engine processes re-import the script and would start it again (see the message)."""


def wrong_type(what: str, expected: str, given: object, fix: str = "") -> TypeError:
    """The `TypeError` for a wrong object: what `what` expects, what it was given, the fix."""
    message = f"{what} expects {expected}, got {describe(given)}"
    return TypeError(f"{message}; {fix}" if fix else message)


def describe(value: object) -> str:
    """A value's type as a user would recognise it: `VectorIndexRetriever (from
    llama_index.core...)`, `str 'abc'`, `None`."""
    if value is None:
        return "None"
    cls = type(value)
    if cls.__module__ == "builtins":
        text = repr(value)
        return f"{cls.__name__} {text if len(text) <= 60 else text[:57] + '...'}"
    return f"{cls.__name__} (from {cls.__module__})"


def check_fits_context(prompt_tokens: int, max_tokens: int, max_model_len: int) -> None:
    """`PromptTooLong`, with the numbers, when a prompt of `prompt_tokens` and an answer of
    `max_tokens` do not fit the context (the one check, before anything runs). A `max_tokens`
    larger than the context is named as the culprit instead (an `InputError` with
    `param="max_tokens"`, vLLM's words)."""
    if max_tokens > max_model_len:
        raise InputError(
            f"max_tokens={max_tokens} cannot be greater than max_model_len={max_model_len}. "
            "Please request fewer output tokens.",
            param="max_tokens",
        )
    limit = max_model_len - max_tokens
    if prompt_tokens > limit:
        raise PromptTooLong(
            f"the prompt has {prompt_tokens} tokens but at most {limit} fit "
            f"(max_model_len {max_model_len} - max_tokens {max_tokens})",
            tokens=prompt_tokens,
            limit=limit,
        )
