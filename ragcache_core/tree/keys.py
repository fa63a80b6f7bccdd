"""Keys of the knowledge tree: what makes two cached KV tensors interchangeable.

KV depends on everything before it, so a node is addressed by its whole path: the root key
(model, tokenizer, template + system prompt, KV dtype) followed by the document keys in prompt
order. A document key carries a hash of the wrapped text, so an edited document never matches
the KV of its old text.
"""

from __future__ import annotations

from dataclasses import dataclass

from ragcache_core.errors import InputError


@dataclass(frozen=True, slots=True)
class RootKey:
    """Identity of a tree root. Two requests may share KV only if every field is equal.

    `template` is a hash (or the text) of the template head plus the system prompt: the tokens
    the root node holds.
    """

    model: str
    tokenizer: str
    template: str
    kv_dtype: str


@dataclass(frozen=True, slots=True)
class DocKey:
    """Identity of a document's content: its id plus a hash of its wrapped text."""

    doc_id: str
    content_hash: str


@dataclass(frozen=True, slots=True)
class DocSpec:
    """One retrieved document of a request, in prompt order."""

    key: DocKey
    num_tokens: int

    def __post_init__(self) -> None:
        if self.num_tokens < 0:
            raise InputError(
                f"document {self.key.doc_id!r} has a negative token count ({self.num_tokens})"
            )
