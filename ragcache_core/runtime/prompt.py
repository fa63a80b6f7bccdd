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
memoized by text (`TokenMemo`: an LRU bounded in bytes, shared across threads); the chat
template is rendered per request.

Bad input costs nothing: `build(..., max_tokens=)` refuses a prompt that cannot fit before any
of it is memoized, and one whose text alone is too long before any of it is tokenized.
"""

from __future__ import annotations

import bisect
import hashlib
import itertools
import logging
import re
import threading
from array import array
from collections import OrderedDict
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace
from typing import Any

from ragcache_core.app_prompt import (
    CONTEXT,
    QUESTION,
    AppPrompt,
    conversation_prompt,
    default_prompt,
)
from ragcache_core.config import PromptConfig
from ragcache_core.documents import Document, render_document
from ragcache_core.errors import InputError, PromptTooLong
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
    order: tuple[int, ...] | None = None
    """The served documents' retrieval ranks (`document_order="cache"`, `Generator.build`):
    `doc_specs[i]` is the document retrieved at rank `order[i]`; None: retrieval order."""

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


DEFAULT_MEMO_BYTES = 64 * 2**20
"""The default bound of a `TokenMemo` (about 600k memoized tokens with their offsets)."""
_TOKEN_BYTES = 3 * 36
"""What one memoized token costs at most: three tuple slots (8 each) and their int objects
(28 each): its id, where it starts and where it ends."""
_ENTRY_BYTES = 300
"""What one memo entry costs beside its tokens: the key, the dict entry, the tuple headers."""


def memo_entry_bytes(encoded: _Encoded) -> int:
    """The bytes one memoized tokenization is counted for (an upper estimate)."""
    return _ENTRY_BYTES + _TOKEN_BYTES * len(encoded.ids)


class TokenMemo:
    """Whole-prompt tokenizations (with their offsets) by content hash: a least-recently-used
    memo bounded in bytes (`memo_entry_bytes` each), so its memory is bounded whatever prompts
    come. An entry larger than the whole bound is not kept. Thread-safe (one lock around the
    dict; callers tokenize outside it), so the builders of one tokenizer can share one memo
    across threads (`ragcache serve`'s render lanes and the cache's loop)."""

    def __init__(self, max_bytes: int = DEFAULT_MEMO_BYTES) -> None:
        if max_bytes < 0:
            raise ValueError(f"max_bytes cannot be negative, got {max_bytes}")
        self.max_bytes = max_bytes
        self.nbytes = 0
        self._entries: OrderedDict[str, _Encoded] = OrderedDict()
        self._lock = threading.Lock()

    def __len__(self) -> int:
        return len(self._entries)

    def get(self, digest: str) -> _Encoded | None:
        """The memoized tokenization of `digest` (now the most recently used), or None."""
        with self._lock:
            found = self._entries.get(digest)
            if found is not None:
                self._entries.move_to_end(digest)
            return found

    def put(self, digest: str, encoded: _Encoded) -> None:
        """Memoize `encoded`, dropping the least recently used entries past the bound."""
        size = memo_entry_bytes(encoded)
        if size > self.max_bytes:
            return
        with self._lock:
            if digest in self._entries:
                self._entries.move_to_end(digest)
                return
            self._entries[digest] = encoded
            self.nbytes += size
            while self.nbytes > self.max_bytes:
                _, dropped = self._entries.popitem(last=False)
                self.nbytes -= memo_entry_bytes(dropped)


def memo_key(text: str, specials: bool, bos: bool) -> str:
    """The memo's key of one whole tokenization."""
    return content_hash(f"{int(specials)}{int(bos)}\0{text}")


class PromptBuilder:
    """Builds a request's prompt ids from the app's prompt (see the module docstring). Whole
    tokenizations are memoized in a `TokenMemo` (bounded in bytes; pass `memo` to share one
    between builders of the same tokenizer, and `max_token_chars` to skip reading the
    vocabulary again). `build` with `max_tokens` refuses a prompt that does not fit before
    anything of it is memoized. Safe to use from several threads: the only state that changes
    is the memo, and the tokenizer is only asked to encode and render."""

    def __init__(
        self,
        tokenizer: Any,
        config: PromptConfig,
        model_name: str,
        kv_dtype: str,
        *,
        memo: TokenMemo | None = None,
        max_token_chars: int | None = None,
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
        self.memo = memo if memo is not None else TokenMemo()
        self.max_token_chars = max_token_chars or longest_token_chars(tokenizer)
        """No token stands for more characters of text than this (the longest entry of the
        vocabulary), so a text of n characters has at least n / max_token_chars tokens."""
        self.default_prompt = self._checked_default(config, use_chat)
        self.root_key = RootKey(self._model, self._tokenizer_name, "default", kv_dtype)
        """The tree's default root key (every built prompt names its own)."""

    @property
    def has_chat_template(self) -> bool:
        return bool(getattr(self._tokenizer, "chat_template", None))

    @property
    def system_role(self) -> bool:
        """Whether the layout's chat template takes a system message."""
        messages = self.default_prompt.messages
        return bool(messages) and messages[0]["role"] == "system"

    def conversation(
        self, history: Sequence[Mapping[str, Any]], system_prompt: str | None = None
    ) -> AppPrompt:
        """The cache's layout for a conversation with earlier turns `history` (role/content
        messages before the final user turn): `app_prompt.conversation_prompt` with the
        configured (or given) system prompt and document template. Pure. Raises `InputError`
        for a bad turn, or a model without a chat template (turns need roles)."""
        if not self.uses_chat_template:
            raise InputError(
                "earlier turns need the model's chat template (this layout renders text): "
                "send the conversation as the app's own AppPrompt(text=...)"
            )
        system = self.config.system_prompt if system_prompt is None else system_prompt
        return conversation_prompt(
            system, history, document=self.config.document, system_role=self.system_role
        )

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
        *,
        max_tokens: int | None = None,
    ) -> BuiltPrompt:
        """The ids of `prompt` (None: the `PromptConfig` layout) with `documents` and
        `question`, cut into root, nodes and rest. Raises `InputError` for a question that is
        not a non-empty string, a bad salt, or a prompt the chat template refuses. With
        `max_tokens`, a longer prompt raises `PromptTooLong` before it is memoized: at once
        when its text alone has more characters than `max_tokens` tokens can hold (nothing is
        tokenized), else once tokenized."""
        if not isinstance(question, str):
            raise InputError(f"the question must be a string, got {type(question).__name__}")
        if not question.strip():
            raise InputError("the question is empty")
        salt = salt_hash(cache_salt)
        prompt = prompt or self.default_prompt
        texts = [render_document(d, prompt.document, i + 1) for i, d in enumerate(documents)]
        rendered, search_from, specials = self._render(prompt, question, texts)
        if max_tokens is not None:
            check_text_fits(len(rendered), max_tokens, self.max_token_chars)
        spans = _locate(rendered, texts, search_from)
        if len(spans) < len(texts):
            logger.debug(
                "%d of %d documents not found in the prompt", len(texts) - len(spans), len(texts)
            )
        cuts = self._cuts(rendered, spans, search_from if prompt.has_context else 0)
        encoded = self._encode(rendered, specials, prompt.bos, max_tokens)
        if encoded is None:
            pieces, moved = self._pieces_apart(rendered, cuts, specials, prompt.bos), 0
            _check_tokens(sum(map(len, pieces)), max_tokens)
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

    def _encode(
        self, text: str, specials: bool, bos: bool, max_tokens: int | None
    ) -> _Encoded | None:
        """The whole text's ids with character spans (None: no offsets from this tokenizer),
        memoized only when they fit `max_tokens` (`PromptTooLong` otherwise)."""
        if not self._fast:
            return None
        key = memo_key(text, specials, bos)
        found = self.memo.get(key)
        if found is not None:
            _check_tokens(len(found.ids), max_tokens)
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
        _check_tokens(len(found.ids), max_tokens)
        self.memo.put(key, found)  # it fits: only now is it memoized
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


def _check_tokens(tokens: int, max_tokens: int | None) -> None:
    """`PromptTooLong` when a prompt of `tokens` does not fit `max_tokens`."""
    if max_tokens is not None and tokens > max_tokens:
        raise PromptTooLong(
            f"the prompt has {tokens} tokens but at most {max_tokens} fit",
            tokens=tokens,
            limit=max_tokens,
        )


def longest_token_chars(tokenizer: Any) -> int:
    """The most characters of text one token of `tokenizer` stands for: the longest entry
    of its vocabulary (added tokens included), as written there. A byte-level BPE entry
    spells each byte as one character and a SentencePiece one writes spaces as one, so no
    token covers more characters of the text than its entry has (tokenizers whose
    normalizer drops characters are the exception; decoder LLMs' do not)."""
    vocab = tokenizer.get_vocab()
    return max((len(token) for token in vocab), default=1) or 1


def check_text_fits(
    chars: int, max_tokens: int, max_token_chars: int, *, fixed_tokens: int = 0
) -> None:
    """`PromptTooLong` when `fixed_tokens` plus a text of `chars` characters cannot fit in
    `max_tokens` tokens: the text has at least ceil(chars / max_token_chars) of them. Costs
    nothing (no tokenizing)."""
    at_least = fixed_tokens + -(-chars // max(1, max_token_chars))
    if at_least > max_tokens:
        raise PromptTooLong(
            f"the prompt has at least {at_least} tokens ({chars} characters of text, and no "
            f"token is longer than {max_token_chars}) but at most {max_tokens} fit",
            tokens=at_least,
            limit=max_tokens,
        )


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
