"""Documents and the position-independent wrapper that renders them into a prompt.

A `Document` is what retrieval returns and what the cache keys on: a string id, its text and
free-form metadata (the title, the source file, whatever the corpus carried). The prompt shows a
document as the application formats it: `prompt_text` when a framework integration rendered it
(LlamaIndex with its metadata, a LangChain `document_prompt`), else through a `DocumentTemplate`
("Title: {title}\n{text}\n\n" by default). A template may number documents with `{position}`
("[2] ..."): the tree is keyed by path, and a node at depth i is always at position i, so
numbering from the front costs no reuse (docs/design.md 3.3).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any

from ragcache_core.errors import InputError


@dataclass(frozen=True)
class Document:
    """One retrievable document. Immutable; equality and hash use `id` and `text` only.

    `metadata` is copied into a read-only mapping at construction (the caller's dict may change
    afterwards without effect). The title, when the corpus has one, is `metadata["title"]`.
    `prompt_text`, when set, is exactly how the prompt shows this document (a framework's own
    rendering, metadata included); None shows it through the prompt's `DocumentTemplate`.
    """

    id: str
    text: str
    metadata: Mapping[str, Any] = field(default_factory=dict, compare=False, hash=False)
    prompt_text: str | None = field(default=None, compare=False, hash=False)

    def __post_init__(self) -> None:
        if not isinstance(self.id, str) or not self.id:
            raise InputError(f"document id must be a non-empty string, got {self.id!r}")
        if not isinstance(self.text, str):
            raise InputError(f"document {self.id!r}: text must be a string")
        if self.prompt_text is not None and not isinstance(self.prompt_text, str):
            raise InputError(f"document {self.id!r}: prompt_text must be a string or None")
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
    `untitled` otherwise. Both may use `{position}` (1 for the first document).
    """

    titled: str = "Title: {title}\n{text}\n\n"
    untitled: str = "{text}\n\n"

    def __post_init__(self) -> None:
        for name, value in (("titled", self.titled), ("untitled", self.untitled)):
            if "{text}" not in value:
                raise InputError(f"document template {name!r} must contain '{{text}}': {value!r}")


DEFAULT_DOC_TEMPLATE = DocumentTemplate()


def checked_documents(documents: Iterable[object]) -> tuple[Document, ...]:
    """The caller's documents, each a `Document` with text. Raises `InputError` naming the first
    that is not one: another type, or a document whose text is empty or blank (there is nothing
    to cache or show: the framework integrations refuse it the same way, "has no text")."""
    out = []
    for doc in documents:
        if not isinstance(doc, Document):
            raise InputError(f"documents must be ragcache_core.Document, got {type(doc).__name__}")
        if not doc.text.strip():
            raise InputError(f"document {doc.id!r} has no text")
        out.append(doc)
    return tuple(out)


def render_document(
    doc: Document, template: DocumentTemplate = DEFAULT_DOC_TEMPLATE, position: int = 1
) -> str:
    """The exact text of `doc` as the prompt shows it at `position` (1-based). Pure."""
    if doc.prompt_text is not None:
        return doc.prompt_text
    title = doc.title.strip()
    if title:
        return template.titled.format(title=title, text=doc.text, position=position)
    return template.untitled.format(title="", text=doc.text, position=position)
