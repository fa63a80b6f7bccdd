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
