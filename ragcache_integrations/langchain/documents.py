"""LangChain `Document` <-> RAGCache `Document`.

The id RAGCache keys a document's KV on (with a hash of its text, so an edited text never
matches old KV) is, first found: `doc.id`, `metadata["id"]`, `metadata["source"]`, else a hash
of the content. Chunks of one source share the source's id, which is fine (the content hash
tells them apart) and lets `cache.invalidate(source)` drop every chunk of a changed file.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterable

from langchain_core.documents import Document as LCDocument

from ragcache_core.documents import Document
from ragcache_core.errors import InputError
from ragcache_integrations.langchain.adapters import to_document

_ID_KEYS = ("id", "source")


def content_digest(text: str) -> str:
    """A stable hash of a document's text (the id of last resort and the prompt-matching key)."""
    return "sha1:" + hashlib.sha1(text.encode("utf-8")).hexdigest()


def document_id(doc: LCDocument) -> str:
    """The id RAGCache uses for `doc` (see the module docstring). Pure."""
    if doc.id:
        return str(doc.id)
    for key in _ID_KEYS:
        value = doc.metadata.get(key)
        if isinstance(value, str | int) and not isinstance(value, bool) and str(value):
            return str(value)
    return content_digest(doc.page_content)


def to_ragcache(doc: object) -> Document:
    """One LangChain document as a RAGCache `Document`. Raises `InputError` for anything that
    is not a LangChain `Document` or has no text."""
    if not isinstance(doc, LCDocument):
        raise InputError(f"context must hold LangChain Documents, got {type(doc).__name__}")
    if not isinstance(doc.page_content, str) or not doc.page_content.strip():
        raise InputError(f"document {document_id(doc)!r} has no text")
    return to_document(doc, document_id(doc))


def to_ragcache_all(docs: Iterable[object]) -> tuple[Document, ...]:
    return tuple(to_ragcache(d) for d in docs)


def to_langchain(doc: Document) -> LCDocument:
    """A RAGCache `Document` back as a LangChain one (id, text, metadata)."""
    return LCDocument(id=doc.id, page_content=doc.text, metadata=dict(doc.metadata))
