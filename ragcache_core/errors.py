"""Exceptions raised by RAGCache. Every user-facing error derives from `RAGCacheError`."""

from __future__ import annotations


class RAGCacheError(Exception):
    """Base class of every error RAGCache raises on purpose (bad input, bad state)."""


class ModelError(RAGCacheError):
    """A model folder is missing, incomplete or unusable."""


class ConfigError(RAGCacheError, ValueError):
    """A configuration value is out of range or inconsistent."""


class InputError(RAGCacheError, ValueError):
    """User input (a trace, a corpus, a query) is malformed; the message names the problem."""


class PromptTooLong(InputError):
    """A prompt longer than the tokens that fit (`limit`). `tokens` is how many it has, or
    at least has: a prompt is refused as soon as it is known not to fit, before the rest of
    it is tokenized (or before any of it is, when its text alone is too long)."""

    def __init__(self, message: str, *, tokens: int, limit: int) -> None:
        super().__init__(message)
        self.tokens = tokens
        self.limit = limit


def check_fits_context(prompt_tokens: int, max_tokens: int, max_model_len: int) -> None:
    """`PromptTooLong`, with the numbers, when a prompt of `prompt_tokens` and an answer of
    `max_tokens` do not fit the context (the one check, before anything runs)."""
    limit = max_model_len - max_tokens
    if prompt_tokens > limit:
        raise PromptTooLong(
            f"the prompt has {prompt_tokens} tokens but at most {limit} fit "
            f"(max_model_len {max_model_len} - max_tokens {max_tokens})",
            tokens=prompt_tokens,
            limit=limit,
        )
