"""Prompt assembly at token level (docs/design.md 3.3).

    prompt ids = root ids (head + system prompt)  ─ the tree's root node
               + doc ids of each document          ─ one tree node per document, tokenized
                                                      on its own, memoized by content hash
                                                      (TokenMemo: an LRU bounded in bytes)
               + question ids                       ─ never cached

The same ids go to vLLM with the cache on or off, so the cache can never change the prompt.
With a chat template, the model's template is rendered once around a sentinel that marks where
the documents go; the text before it is the head, the text after it (with the question) the tail.

Bad input costs nothing: `build(..., max_tokens=)` refuses a prompt that cannot fit before any
of it is memoized, and one whose text alone is too long before any of it is tokenized.
"""

from __future__ import annotations

import hashlib
import threading
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from ragcache_core.config import PromptConfig
from ragcache_core.documents import Document, render_document
from ragcache_core.errors import InputError, PromptTooLong
from ragcache_core.tree.keys import DocKey, DocSpec, RootKey

_SENTINEL = "\u2063RAGCACHE_DOCUMENTS\u2063"


@dataclass(frozen=True)
class BuiltPrompt:
    """The token ids of one request, in pieces that map onto tree nodes."""

    root_ids: tuple[int, ...]
    doc_ids: tuple[tuple[int, ...], ...]
    question_ids: tuple[int, ...]
    doc_specs: tuple[DocSpec, ...]

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


DEFAULT_MEMO_BYTES = 64 * 2**20
"""The default bound of a `TokenMemo` (about 1.8M memoized tokens)."""
_TOKEN_BYTES = 36
"""What one memoized token costs at most: its tuple slot (8) and its int object (28)."""
_ENTRY_BYTES = 200
"""What one memo entry costs beside its tokens: the key, the dict entry, the tuple header."""


def memo_entry_bytes(ids: Sequence[int]) -> int:
    """The bytes one memoized tokenization is counted for (an upper estimate)."""
    return _ENTRY_BYTES + _TOKEN_BYTES * len(ids)


class TokenMemo:
    """Document tokenizations by content hash: a least-recently-used memo bounded in bytes
    (`memo_entry_bytes` each), so its memory is bounded whatever documents come. An entry
    larger than the whole bound is not kept. Thread-safe (one lock around the dict; callers
    tokenize outside it), so the builders of one tokenizer can share one memo across
    threads (`ragcache serve`'s render lanes and the cache's loop)."""

    def __init__(self, max_bytes: int = DEFAULT_MEMO_BYTES) -> None:
        if max_bytes < 0:
            raise ValueError(f"max_bytes cannot be negative, got {max_bytes}")
        self.max_bytes = max_bytes
        self.nbytes = 0
        self._entries: OrderedDict[str, tuple[int, ...]] = OrderedDict()
        self._lock = threading.Lock()

    def __len__(self) -> int:
        return len(self._entries)

    def get(self, digest: str) -> tuple[int, ...] | None:
        """The memoized ids of `digest` (now the most recently used), or None."""
        with self._lock:
            ids = self._entries.get(digest)
            if ids is not None:
                self._entries.move_to_end(digest)
            return ids

    def put(self, digest: str, ids: tuple[int, ...]) -> None:
        """Memoize `ids`, dropping the least recently used entries past the bound."""
        size = memo_entry_bytes(ids)
        if size > self.max_bytes:
            return
        with self._lock:
            if digest in self._entries:
                self._entries.move_to_end(digest)
                return
            self._entries[digest] = ids
            self.nbytes += size
            while self.nbytes > self.max_bytes:
                _, dropped = self._entries.popitem(last=False)
                self.nbytes -= memo_entry_bytes(dropped)


class PromptBuilder:
    """Tokenizes prompts piecewise. Document tokenizations are memoized by content hash in a
    `TokenMemo` (bounded in bytes; pass `memo` to share one between builders of the same
    tokenizer and document template, and `max_token_chars` to skip reading the vocabulary
    again). `build` with `max_tokens` refuses a prompt that does
    not fit before anything of it is memoized. Safe to use from several threads: the only
    state that changes is the memo, and the tokenizer is only asked to `encode`."""

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
            use_chat = bool(getattr(tokenizer, "chat_template", None))
        self.uses_chat_template = use_chat
        head, tail = self._split_template(use_chat)
        root = self._encode(head)
        bos = getattr(tokenizer, "bos_token_id", None)
        if config.add_bos and not use_chat and bos is not None:
            root = [bos, *root]
        self.root_ids: tuple[int, ...] = tuple(root)
        self._tail = tail
        self.root_key = RootKey(
            model=model_name,
            tokenizer=f"{type(tokenizer).__name__}:{len(tokenizer)}",
            template=hashlib.sha256(repr((self.root_ids, tail)).encode()).hexdigest()[:24],
            kv_dtype=kv_dtype,
        )
        self.memo = memo if memo is not None else TokenMemo()
        self.max_token_chars = max_token_chars or longest_token_chars(tokenizer)
        """No token stands for more characters of text than this (the longest entry of the
        vocabulary), so a text of n characters has at least n / max_token_chars tokens."""

    def _split_template(self, use_chat: bool) -> tuple[str, str]:
        cfg = self.config
        if not use_chat:
            return cfg.head.format(system=cfg.system_prompt), cfg.question
        user = _SENTINEL + cfg.question
        messages = [
            {"role": "system", "content": cfg.system_prompt},
            {"role": "user", "content": user},
        ]
        try:
            text = self._tokenizer.apply_chat_template(
                messages, tokenize=False, add_generation_prompt=True
            )
        except Exception:  # templates without a system role: fold it into the user turn
            messages = [{"role": "user", "content": cfg.system_prompt + "\n\n" + user}]
            text = self._tokenizer.apply_chat_template(
                messages, tokenize=False, add_generation_prompt=True
            )
        head, sep, tail = str(text).partition(_SENTINEL)
        if not sep:
            raise InputError("the chat template dropped the user message; set chat_template=False")
        return head, tail

    def _encode(self, text: str) -> list[int]:
        return list(self._tokenizer.encode(text, add_special_tokens=False))

    def document_ids(self, doc: Document) -> tuple[DocKey, tuple[int, ...]]:
        """One document's key and token ids (memoized)."""
        text = render_document(doc, self.config.document)
        digest = content_hash(text)
        ids = self.memo.get(digest)
        if ids is None:
            ids = tuple(self._encode(text))
            self.memo.put(digest, ids)
        return DocKey(doc.id, digest), ids

    def build(
        self, question: str, documents: Sequence[Document], *, max_tokens: int | None = None
    ) -> BuiltPrompt:
        """The prompt's ids. With `max_tokens`, a longer prompt raises `PromptTooLong` before
        any of its documents is memoized: at once when its text alone has more characters than
        `max_tokens` tokens can hold (nothing is tokenized), else as soon as the documents
        tokenized so far are too many tokens (the rest are not tokenized)."""
        if not isinstance(question, str):
            raise InputError(f"the question must be a string, got {type(question).__name__}")
        if not question.strip():
            raise InputError("the question is empty")
        texts = [render_document(doc, self.config.document) for doc in documents]
        tail = self._tail.replace("{question}", question)
        if max_tokens is not None:
            self._check_chars(sum(map(len, texts)) + len(tail), max_tokens)
        specs, doc_ids, fresh = [], [], []
        used = len(self.root_ids)
        for doc, text in zip(documents, texts, strict=True):
            digest = content_hash(text)
            ids = self.memo.get(digest)
            if ids is None:
                ids = tuple(self._encode(text))
                fresh.append((digest, ids))
            used += len(ids)
            if max_tokens is not None and used > max_tokens:
                raise PromptTooLong(
                    f"the prompt has at least {used} tokens but at most {max_tokens} fit",
                    tokens=used,
                    limit=max_tokens,
                )
            specs.append(DocSpec(DocKey(doc.id, digest), len(ids)))
            doc_ids.append(ids)
        question_ids = tuple(self._encode(tail))
        built = BuiltPrompt(self.root_ids, tuple(doc_ids), question_ids, tuple(specs))
        if max_tokens is not None and built.num_tokens > max_tokens:
            raise PromptTooLong(
                f"the prompt has {built.num_tokens} tokens but at most {max_tokens} fit",
                tokens=built.num_tokens,
                limit=max_tokens,
            )
        for digest, ids in fresh:  # it fits: only now are its documents memoized
            self.memo.put(digest, ids)
        return built

    def _check_chars(self, chars: int, max_tokens: int) -> None:
        """`PromptTooLong` when `chars` characters of text beside the root cannot fit."""
        check_text_fits(chars, max_tokens, self.max_token_chars, fixed_tokens=len(self.root_ids))


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
