"""`KnownDocuments`: the documents `ragcache serve` can recognise inside a plain request.

An OpenAI client that was not changed sends its documents pasted into its messages (or its
completion prompt), with no `documents` field. When the server knows the corpus, the
documents of `--index`, and documents earlier requests sent with ids, it finds them there and
caches them as documents (docs/design.md 3.3, "found documents"):

    known:  anchor (the first ANCHOR_CHARS characters of a document's stripped text) -> docs
    find:   at each word start of the text (a regex scan), look the next ANCHOR_CHARS
            characters up; on a hit, check the whole document text there; jump past it

Cost: one dict lookup per word of the request's text plus one string compare per candidate,
whatever the corpus size (measured: `scripts/found_documents_cost.py`, docs/deploy.md). A
document shorter than `MIN_CHARS` is never looked for (too likely to appear by chance). A
document found becomes a node as the app showed it: its exact text, the app's own separators
around it in the neighbouring pieces, and no wrapper of RAGCache's (no "Title:" line): the
prompt's ids stay the ones `vllm serve` makes of the same messages.

Scopes: the index's documents are known to every caller; a document a request sent is known
only to requests with the same cache salt (another tenant never learns its id). Bounded: at
most `max_seen` sent documents are kept (least recently sent go first). Thread-safe.
"""

from __future__ import annotations

import re
import threading
from collections import OrderedDict
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, replace

from ragcache_core.documents import Document

ANCHOR_CHARS = 48
"""How many leading characters of a document key its lookup."""
MIN_CHARS = 64
"""Documents shorter than this (stripped) are never looked for."""
_WORD_START = re.compile(r"(?<!\S)\S")

_INDEX = "\0index"
"""The scope of the index's documents (known to every caller)."""


@dataclass(frozen=True)
class Found:
    """A known document found in a text: where its stripped text starts and ends."""

    start: int
    end: int
    document: Document


class KnownDocuments:
    """Documents by anchor, in scopes (see the module docstring)."""

    def __init__(self, max_seen: int = 100_000) -> None:
        if max_seen < 0:
            raise ValueError(f"max_seen cannot be negative, got {max_seen}")
        self.max_seen = max_seen
        self._anchors: dict[str, dict[tuple[str, str], Document]] = {}
        self._seen: OrderedDict[tuple[str, str], str] = OrderedDict()
        self._lock = threading.Lock()

    def __len__(self) -> int:
        with self._lock:
            return sum(len(docs) for docs in self._anchors.values())

    def add_index(self, documents: Iterable[Document]) -> None:
        """Know `documents` for every caller (the server's `--index`)."""
        with self._lock:
            for doc in documents:
                self._put(_INDEX, doc)

    def add_seen(self, documents: Iterable[Document], scope: str | None) -> None:
        """Know documents a request sent, for requests of the same salt (`scope`)."""
        key_scope = "" if scope is None else "salt:" + scope
        with self._lock:
            for doc in documents:
                key = self._put(key_scope, doc)
                if key is None:
                    continue
                self._seen[key] = key[1]
                self._seen.move_to_end(key)
            while len(self._seen) > self.max_seen:
                (old_scope, text), _ = self._seen.popitem(last=False)
                self._drop(old_scope, text)

    def find(self, text: str, scope: str | None) -> tuple[Found, ...]:
        """The known documents in `text` for a caller of salt `scope`, in text order, never
        overlapping (the longest wins at one place). Pure."""
        if not self._anchors:
            return ()
        key_scope = "" if scope is None else "salt:" + scope
        found: list[Found] = []
        end = 0
        for match in _WORD_START.finditer(text):
            at = match.start()
            if at < end:
                continue
            candidates = self._anchors.get(text[at : at + ANCHOR_CHARS])  # atomic
            if candidates is None:
                continue
            with self._lock:
                docs = list(candidates.items())
            best: Document | None = None
            for (doc_scope, body), doc in docs:
                if doc_scope not in (_INDEX, key_scope) or not text.startswith(body, at):
                    continue
                if best is None or len(body) > len(_body(best)):
                    best = doc
            if best is not None:
                end = at + len(_body(best))
                found.append(Found(at, end, best))
        return tuple(found)

    def _put(self, scope: str, doc: Document) -> tuple[str, str] | None:
        body = _body(doc)
        if len(body) < MIN_CHARS:
            return None
        self._anchors.setdefault(body[:ANCHOR_CHARS], {})[(scope, body)] = doc
        return scope, body

    def _drop(self, scope: str, body: str) -> None:
        anchor = body[:ANCHOR_CHARS]
        docs = self._anchors.get(anchor)
        if docs is None:
            return
        docs.pop((scope, body), None)
        if not docs:
            del self._anchors[anchor]


def _body(doc: Document) -> str:
    return doc.text.strip()


def found_documents(found: Sequence[Found]) -> tuple[Document, ...]:
    """The found documents as the prompt shows them (`prompt_text`: the text as found), with
    repeats of one document kept once (its first place)."""
    out, ids = [], set()
    for item in found:
        doc = item.document
        if (doc.id, _body(doc)) in ids:
            continue
        ids.add((doc.id, _body(doc)))
        out.append(replace(doc, prompt_text=_body(doc)))
    return tuple(out)
