"""Prompt assembly at token level (docs/design.md 3.3).

    prompt ids = root ids (head + system prompt)  ─ the tree's root node
               + doc ids of each document          ─ one tree node per document, tokenized
                                                      on its own, cached by content hash
               + question ids                       ─ never cached

The same ids go to vLLM with the cache on or off, so the cache can never change the prompt.
With a chat template, the model's template is rendered once around a sentinel that marks where
the documents go; the text before it is the head, the text after it (with the question) the tail.
"""

from __future__ import annotations

import hashlib
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from ragcache_core.config import PromptConfig
from ragcache_core.documents import Document, render_document
from ragcache_core.errors import InputError
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


class PromptBuilder:
    """Tokenizes prompts piecewise. Document tokenizations are memoized by content hash (an LRU
    of `cache_size` documents). Not thread-safe."""

    def __init__(
        self,
        tokenizer: Any,
        config: PromptConfig,
        model_name: str,
        kv_dtype: str,
        cache_size: int = 100_000,
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
        self._docs: OrderedDict[str, tuple[int, ...]] = OrderedDict()
        self._cache_size = cache_size

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
        text = render_document(doc, self.config.document)
        digest = content_hash(text)
        ids = self._docs.get(digest)
        if ids is None:
            ids = tuple(self._encode(text))
            self._docs[digest] = ids
            if len(self._docs) > self._cache_size:
                self._docs.popitem(last=False)
        else:
            self._docs.move_to_end(digest)
        return DocKey(doc.id, digest), ids

    def build(self, question: str, documents: Sequence[Document]) -> BuiltPrompt:
        if not isinstance(question, str):
            raise InputError(f"the question must be a string, got {type(question).__name__}")
        if not question.strip():
            raise InputError("the question is empty")
        specs, doc_ids = [], []
        for doc in documents:
            key, ids = self.document_ids(doc)
            specs.append(DocSpec(key, len(ids)))
            doc_ids.append(ids)
        question_ids = tuple(self._encode(self._tail.replace("{question}", question)))
        return BuiltPrompt(self.root_ids, tuple(doc_ids), question_ids, tuple(specs))
