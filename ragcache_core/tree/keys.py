"""Keys of the knowledge tree: what makes two cached KV tensors interchangeable.

KV depends on everything before it, so a node is addressed by its whole path: the root key
(model, tokenizer, a hash of the root's token ids, KV dtype, tenant salt) followed by the
document keys in prompt order. The tree is a forest: one root per distinct root key
(docs/design.md 2.1). A document key carries a hash of the node's token ids, so an edited
document never matches the KV of its old text.
"""

from __future__ import annotations

from dataclasses import dataclass

from ragcache_core.errors import InputError


@dataclass(frozen=True, slots=True)
class RootKey:
    """Identity of a tree root. Two requests may share KV only if every field is equal.

    `template` is a hash (or the text) of the tokens the root node holds: everything before the
    documents (chat template, system prompt, tools). `salt` is a hash of the request's
    `cache_salt` ("" unsalted): a salted request reaches only roots of the same salt, so it
    never hits KV another tenant stored.
    """

    model: str
    tokenizer: str
    template: str
    kv_dtype: str
    salt: str = ""


@dataclass(frozen=True, slots=True)
class DocKey:
    """Identity of a node's content: its document's id plus a hash of the node's token ids
    (its document as the prompt shows it, docs/design.md 3.3)."""

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
