"""Documents and the position-independent wrapper that renders them into a prompt.

A `Document` is what retrieval returns and what the cache keys on: a string id, its text and
free-form metadata (the title, the source file, whatever the corpus carried). The prompt shows a
document through a `DocumentTemplate` that never mentions its position ("Title: ...", never
"[2]"), so a document's tokens are the same wherever it sits in the prompt; the knowledge tree
caches exactly those tokens. Retrieval counts tokens of `render_document(doc)` for traces and the
controller tokenizes the same string for the engine, so both agree by construction.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any

from ragcache_core.errors import InputError


@dataclass(frozen=True)
class Document:
    """One retrievable document. Immutable; equality and hash use `id` and `text` only.

    `metadata` is copied into a read-only mapping at construction (the caller's dict may change
    afterwards without effect). The title, when the corpus has one, is `metadata["title"]`.
    """

    id: str
    text: str
    metadata: Mapping[str, Any] = field(default_factory=dict, compare=False, hash=False)

    def __post_init__(self) -> None:
        if not isinstance(self.id, str) or not self.id:
            raise InputError(f"document id must be a non-empty string, got {self.id!r}")
        if not isinstance(self.text, str):
            raise InputError(f"document {self.id!r}: text must be a string")
        object.__setattr__(self, "metadata", MappingProxyType(dict(self.metadata)))

    @property
    def title(self) -> str:
        """The document's title, or the empty string when it has none."""
        title = self.metadata.get("title", "")
        return title if isinstance(title, str) else str(title)


@dataclass(frozen=True)
class DocumentTemplate:
    """How a document appears in the prompt; both forms must contain `{text}`.

    `titled` is used when the document has a non-empty title (it may use `{title}`),
    `untitled` otherwise. Neither may depend on the document's position in the prompt.
    """

    titled: str = "Title: {title}\n{text}\n\n"
    untitled: str = "{text}\n\n"

    def __post_init__(self) -> None:
        for name, value in (("titled", self.titled), ("untitled", self.untitled)):
            if "{text}" not in value:
                raise InputError(f"document template {name!r} must contain '{{text}}': {value!r}")


DEFAULT_DOC_TEMPLATE = DocumentTemplate()


def render_document(doc: Document, template: DocumentTemplate = DEFAULT_DOC_TEMPLATE) -> str:
    """The exact text of `doc` as the prompt shows it (pure; tokenize this string on its own)."""
    title = doc.title.strip()
    if title:
        return template.titled.format(title=title, text=doc.text)
    return template.untitled.format(title="", text=doc.text)
