"""Prompt assembly: the app's own prompt, tokenized whole, cut into tree nodes (docs/design.md 3.3).

    rendered = the app's messages through the model's chat template (or its text), with the
               documents spliced in where it puts its context
    ids      = tokenizer(rendered) once, with character offsets: the ids `vllm serve` would
               make from the same text, by construction
    root     = ids up to the safe cut before the first document   ─ the tree's root (its key:
               the root's ids + the tenant's salt)
    node i   = ids from the previous cut to the start of document i's last pretoken
               (held back into the next node, so a node never depends on what follows it)
    rest     = the last document's held-back tail, the rest of the template, the question
               ─ computed on every request, never cached

A cut falls on a token boundary of the whole text; where a token straddles the wanted place,
the cut moves left to that token's start (`BuiltPrompt.moved_cuts`): the ids stay the whole
text's, only reuse can suffer. Nodes are keyed by (document id, hash of the node's ids), so a
node is reused exactly when the same ids follow the same path. Whole tokenizations are
memoized by text (an LRU); the chat template is rendered per request.
"""

from __future__ import annotations

import bisect
import hashlib
import itertools
import logging
import re
from array import array
from collections import OrderedDict
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace
from typing import Any

from ragcache_core.app_prompt import CONTEXT, QUESTION, AppPrompt, default_prompt
from ragcache_core.config import PromptConfig
from ragcache_core.documents import Document, render_document
from ragcache_core.errors import InputError
from ragcache_core.tree.keys import DocKey, DocSpec, RootKey

logger = logging.getLogger(__name__)

_WORD = re.compile(r" ?\S+")
"""The fallback pretoken for tokenizers without a pre-tokenizer: a word with its space."""


@dataclass(frozen=True)
class BuiltPrompt:
    """The token ids of one request, in pieces that map onto tree nodes.

    `root_key` None means the tree's default root. `moved_cuts` counts cuts that had to move
    left of where they belong (a token straddled them: the ids are still the whole text's,
    but the nodes may be reused less); `unplaced_docs` counts documents that could not be found
    in the rendered prompt (they are computed with the rest, never cached).
    """

    root_ids: tuple[int, ...]
    doc_ids: tuple[tuple[int, ...], ...]
    question_ids: tuple[int, ...]
    doc_specs: tuple[DocSpec, ...]
    root_key: RootKey | None = None
    moved_cuts: int = 0
    unplaced_docs: int = 0

    @property
    def token_ids(self) -> list[int]:
        ids = list(self.root_ids)
        for doc in self.doc_ids:
            ids.extend(doc)
        ids.extend(self.question_ids)
        return ids

    @property
    def num_tokens(self) -> int:
        return len(self.root_ids) + sum(map(len, self.doc_ids)) + len(self.question_ids)


def content_hash(text: str) -> str:
    return hashlib.sha256(text.encode("utf-8")).hexdigest()[:24]


def ids_hash(ids: Sequence[int]) -> str:
    """A short hash of token ids (node keys)."""
    return hashlib.sha256(array("q", ids).tobytes()).hexdigest()[:24]


def salt_hash(salt: str | None) -> str:
    """The root key's salt field for a request's `cache_salt` ("" unsalted)."""
    if salt is None:
        return ""
    if not isinstance(salt, str) or not salt:
        raise InputError("cache_salt must be a non-empty string (or left out)")
    return hashlib.sha256(("ragcache-salt\0" + salt).encode("utf-8")).hexdigest()[:24]


@dataclass(frozen=True)
class _Encoded:
    ids: tuple[int, ...]
    starts: tuple[int, ...]
    ends: tuple[int, ...]
    """Token i covers characters [starts[i], ends[i]); ends are made non-decreasing."""


class PromptBuilder:
    """Builds a request's prompt ids from the app's prompt (see the module docstring). Whole
    tokenizations are memoized by text (an LRU of `cache_size`). Not thread-safe."""

    def __init__(
        self,
        tokenizer: Any,
        config: PromptConfig,
        model_name: str,
        kv_dtype: str,
        cache_size: int = 4096,
    ) -> None:
        self._tokenizer = tokenizer
        self.config = config
        use_chat = config.chat_template
        if use_chat is None:
            use_chat = self.has_chat_template
        self.uses_chat_template = use_chat
        self._model = model_name
        self._kv_dtype = kv_dtype
        self._tokenizer_name = f"{type(tokenizer).__name__}:{len(tokenizer)}"
        self._fast = bool(getattr(tokenizer, "is_fast", False))
        backend = getattr(tokenizer, "backend_tokenizer", None) if self._fast else None
        self._pre_tokenizer = getattr(backend, "pre_tokenizer", None)
        self._encoded: OrderedDict[tuple[str, bool, bool], _Encoded] = OrderedDict()
        self._cache_size = cache_size
        self.default_prompt = self._checked_default(config, use_chat)
        self.root_key = RootKey(self._model, self._tokenizer_name, "default", kv_dtype)
        """The tree's default root key (every built prompt names its own)."""

    @property
    def has_chat_template(self) -> bool:
        return bool(getattr(self._tokenizer, "chat_template", None))

    def _checked_default(self, config: PromptConfig, chat: bool) -> AppPrompt:
        prompt = default_prompt(config, chat)
        if not chat:
            return prompt
        try:
            self._chat(prompt.messages, {})
        except InputError:  # templates without a system role: fold it into the user turn
            user = config.system_prompt + "\n\n" + str(prompt.messages[1]["content"])
            prompt = replace(prompt, messages=({"role": "user", "content": user},))
        return prompt

    # ------------------------------------------------------------------ building

    def build(
        self,
        question: str,
        documents: Sequence[Document],
        prompt: AppPrompt | None = None,
        cache_salt: str | None = None,
    ) -> BuiltPrompt:
        """The ids of `prompt` (None: the `PromptConfig` layout) with `documents` and
        `question`, cut into root, nodes and rest. Raises `InputError` for a question that is
        not a non-empty string, a bad salt, or a prompt the chat template refuses."""
        if not isinstance(question, str):
            raise InputError(f"the question must be a string, got {type(question).__name__}")
        if not question.strip():
            raise InputError("the question is empty")
        salt = salt_hash(cache_salt)
        prompt = prompt or self.default_prompt
        texts = [render_document(d, prompt.document, i + 1) for i, d in enumerate(documents)]
        rendered, search_from, specials = self._render(prompt, question, texts)
        spans = _locate(rendered, texts, search_from)
        if len(spans) < len(texts):
            logger.debug(
                "%d of %d documents not found in the prompt", len(texts) - len(spans), len(texts)
            )
        cuts = self._cuts(rendered, spans, search_from if prompt.has_context else 0)
        encoded = self._encode(rendered, specials, prompt.bos)
        if encoded is None:
            pieces, moved = self._pieces_apart(rendered, cuts, specials, prompt.bos), 0
        else:
            pieces, moved = _pieces_whole(encoded, cuts)
        root_ids, rest = pieces[0], pieces[-1]
        node_ids = pieces[1:-1]
        specs = tuple(
            DocSpec(DocKey(doc.id, ids_hash(ids)), len(ids))
            for doc, ids in zip(documents, node_ids, strict=False)
        )
        root_key = RootKey(
            self._model, self._tokenizer_name, ids_hash(root_ids), self._kv_dtype, salt
        )
        return BuiltPrompt(
            root_ids,
            tuple(node_ids),
            rest,
            specs,
            root_key=root_key,
            moved_cuts=moved,
            unplaced_docs=len(texts) - len(spans),
        )

    def render(
        self, question: str, documents: Sequence[Document], prompt: AppPrompt | None = None
    ) -> str:
        """The prompt text as the model sees it (for inspection and tests). Pure."""
        prompt = prompt or self.default_prompt
        texts = [render_document(d, prompt.document, i + 1) for i, d in enumerate(documents)]
        return self._render(prompt, question, texts)[0]

    # ------------------------------------------------------------------ rendering

    def _render(
        self, prompt: AppPrompt, question: str, texts: Sequence[str]
    ) -> tuple[str, int, bool]:
        """(the rendered text, where the documents may start, whether the tokenizer adds its
        special tokens)."""
        context = prompt.separator.join(texts)
        chat = prompt.text is None or (
            prompt.chat if prompt.chat is not None else self.has_chat_template
        )
        if not chat:
            assert prompt.text is not None
            text = prompt.text.replace(QUESTION, question)
            head = text.partition(CONTEXT)[0] if CONTEXT in text else ""
            return text.replace(CONTEXT, context), len(head), prompt.special_tokens
        messages = prompt.messages or ({"role": "user", "content": prompt.text or ""},)
        kwargs = dict(prompt.chat_template_kwargs)
        asked = [_fill(m, question) for m in messages]
        rendered = self._chat(
            [_fill(m, context=context, base=a) for m, a in zip(messages, asked, strict=True)],
            kwargs,
        )
        if not prompt.has_context:
            return rendered, 0, False
        marked = self._chat(asked, kwargs)
        head = marked.partition(CONTEXT)[0]
        return rendered, _common_prefix(head, rendered), False

    def _chat(self, messages: Sequence[Mapping[str, Any]], kwargs: dict[str, Any]) -> str:
        if not self.has_chat_template:
            raise InputError("the model has no chat template: send a text prompt (chat=False)")
        try:
            text = self._tokenizer.apply_chat_template(
                [dict(m) for m in messages], tokenize=False, add_generation_prompt=True, **kwargs
            )
        except Exception as exc:  # the template refused the messages (e.g. jinja's raise)
            raise InputError(f"the chat template cannot render these messages: {exc}") from exc
        return str(text)

    # ------------------------------------------------------------------ cutting

    def _cuts(self, text: str, spans: Sequence[tuple[int, int]], context: int) -> list[int]:
        """Character cuts: the root's end, then each placed document's node end. Without
        documents the root ends where the context would start (`context`; 0 when the prompt
        marks none: nothing of an unknown prompt is kept as a root)."""
        if not spans:
            return [_safe_cut(text, context)]
        cuts = [_safe_cut(text, spans[0][0])]
        for begin, end in spans:
            hold = begin + self._last_pretoken(text[begin:end])
            cuts.append(hold if hold > cuts[-1] else max(end, cuts[-1]))
        return cuts

    def _last_pretoken(self, text: str) -> int:
        """Where the last non-blank pretoken of `text` (tokenized alone) starts."""
        if self._pre_tokenizer is not None:
            try:
                pieces = self._pre_tokenizer.pre_tokenize_str(text)
            except Exception:  # a pre-tokenizer that cannot run alone: use words
                pieces = None
            if pieces is not None:
                for _, (start, end) in reversed(pieces):
                    if text[start:end].strip():
                        return int(start)
                return len(text)
        words = list(_WORD.finditer(text))
        return words[-1].start() if words else len(text)

    # ------------------------------------------------------------------ tokenizing

    def _encode(self, text: str, specials: bool, bos: bool) -> _Encoded | None:
        """The whole text's ids with character spans (None: no offsets from this tokenizer)."""
        if not self._fast:
            return None
        key = (text, specials, bos)
        found = self._encoded.get(key)
        if found is not None:
            self._encoded.move_to_end(key)
            return found
        out = self._tokenizer(text, add_special_tokens=specials, return_offsets_mapping=True)
        ids = list(out["input_ids"])
        spans = [(int(a), int(b)) for a, b in out["offset_mapping"]]
        bos_id = getattr(self._tokenizer, "bos_token_id", None)
        if bos and bos_id is not None:
            ids, spans = [bos_id, *ids], [(0, 0), *spans]
        ends, high = [], 0
        for _, end in spans:
            high = max(high, end)
            ends.append(high)
        found = _Encoded(tuple(ids), tuple(a for a, _ in spans), tuple(ends))
        self._encoded[key] = found
        if len(self._encoded) > self._cache_size:
            self._encoded.popitem(last=False)
        return found

    def _pieces_apart(
        self, text: str, cuts: Sequence[int], specials: bool, bos: bool
    ) -> list[tuple[int, ...]]:
        """Slow tokenizers (no offsets): each piece tokenized on its own at the same cuts (the
        ids may then differ from the whole text's at a seam; rule 1 still holds)."""
        bounds = [0, *cuts, len(text)]
        pieces = []
        for i, (a, b) in enumerate(itertools.pairwise(bounds)):
            ids = list(self._tokenizer.encode(text[a:b], add_special_tokens=specials and i == 0))
            bos_id = getattr(self._tokenizer, "bos_token_id", None)
            if i == 0 and bos and bos_id is not None:
                ids = [bos_id, *ids]
            pieces.append(tuple(ids))
        return pieces


def _fill(
    message: Mapping[str, Any],
    question: str | None = None,
    *,
    context: str | None = None,
    base: Mapping[str, Any] | None = None,
) -> dict[str, Any]:
    """`message` with the question (or, from `base`, the context) filled in."""
    out = dict(base if base is not None else message)
    content = str(out["content"])
    if question is not None:
        content = content.replace(QUESTION, question)
    if context is not None:
        content = content.replace(CONTEXT, context)
    out["content"] = content
    return out


def _common_prefix(a: str, b: str) -> int:
    n = min(len(a), len(b))
    i = 0
    while i < n and a[i] == b[i]:
        i += 1
    return i


def _locate(text: str, texts: Sequence[str], start: int) -> list[tuple[int, int]]:
    """Each document's span in `text`, searched in order from `start` (its stripped form when
    the template trimmed it); stops at the first one that is not there."""
    spans: list[tuple[int, int]] = []
    pos = start
    for doc in texts:
        at = text.find(doc, pos) if doc else -1
        if at < 0:
            core = doc.strip()
            at = text.find(core, pos) if core else -1
            doc = core
        if at < 0:
            break
        spans.append((at, at + len(doc)))
        pos = at + len(doc)
    return spans


def _safe_cut(text: str, at: int) -> int:
    """Where the root should end for a first document at `at`: before the spaces and tabs
    that precede it (a space starts the next piece, as whole tokenization puts it), or after
    the newline run it starts with (a newline run is never split)."""
    cut = at
    while cut > 0 and text[cut - 1] in " \t":
        cut -= 1
    if cut == at and at > 0 and text[at - 1] in "\r\n":
        while cut < len(text) and text[cut] in "\r\n":
            cut += 1
    return cut


def _pieces_whole(encoded: _Encoded, cuts: Sequence[int]) -> tuple[list[tuple[int, ...]], int]:
    """The whole text's ids cut at token boundaries: each character cut moves left to the start
    of a token that straddles it. Returns the pieces (root, nodes, rest) and the moved cuts."""
    ids, starts, ends = encoded.ids, encoded.starts, encoded.ends
    indices, moved, last = [], 0, 0
    for cut in cuts:
        index = bisect.bisect_right(ends, cut)
        if index < len(ids) and starts[index] < cut and ends[index] > cut:
            moved += 1
        index = max(index, last)
        indices.append(index)
        last = index
    bounds = [0, *indices, len(ids)]
    return [tuple(ids[a:b]) for a, b in itertools.pairwise(bounds)], moved
