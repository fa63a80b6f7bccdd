"""Prompt assembly with the offline tokenizer (no engine): the pieces are the whole rendered
text's ids, cut so that a node never depends on what follows it; roots are keyed by what
precedes the documents and the tenant's salt."""

from __future__ import annotations

from pathlib import Path

import pytest

from ragcache_core.app_prompt import CONTEXT, QUESTION, AppPrompt, Framing
from ragcache_core.config import PromptConfig
from ragcache_core.documents import Document, DocumentTemplate
from ragcache_core.errors import InputError
from ragcache_core.runtime.prompt import PromptBuilder


@pytest.fixture(scope="module")
def tokenizer(tiny_model: Path):  # type: ignore[no-untyped-def]
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tiny_model)


def _docs() -> list[Document]:
    return [
        Document("a", "Paris is the capital of France.", {"title": "Paris"}),
        Document("b", "The Seine flows through Paris."),
        Document("c", "Lyon is a city in France."),
    ]


def _builder(tokenizer, **prompt: object) -> PromptBuilder:  # type: ignore[no-untyped-def]
    return PromptBuilder(tokenizer, PromptConfig(**prompt), "m", "float32")  # type: ignore[arg-type]


def test_pieces_are_the_whole_texts_ids(tokenizer) -> None:  # type: ignore[no-untyped-def]
    for chat in (False, True):
        builder = _builder(tokenizer, chat_template=chat)
        built = builder.build("What is the capital of France?", _docs())
        text = builder.render("What is the capital of France?", _docs())
        whole = list(tokenizer.encode(text, add_special_tokens=False))
        if not chat:  # RAGCache's own text layout puts BOS in front (add_bos)
            whole = [tokenizer.bos_token_id, *whole]
        assert built.token_ids == whole
        assert len(built.token_ids) == built.num_tokens
        assert [s.num_tokens for s in built.doc_specs] == [len(d) for d in built.doc_ids]
        # The first node starts with its document; the root ends before it.
        assert "Title: Paris" in tokenizer.decode(built.doc_ids[0])
        assert "Paris" not in tokenizer.decode(built.root_ids)


def test_the_user_colon_space_seam_is_the_whole_texts(tokenizer) -> None:  # type: ignore[no-untyped-def]
    """The tiny chat template puts "user: " before the documents: piece by piece that space
    was a lone token ("Ġ" + "Title"), whole it belongs to the next word."""
    builder = _builder(tokenizer, chat_template=True)
    text = builder.render("Where?", _docs())
    assert "user: Title: Paris" in text
    assert builder.build("Where?", _docs()).token_ids == tokenizer.encode(
        text, add_special_tokens=False
    )


def test_a_node_does_not_depend_on_what_follows(tokenizer) -> None:  # type: ignore[no-untyped-def]
    builder = _builder(tokenizer)
    three = builder.build("Q one?", _docs())
    two = builder.build("Q two?", _docs()[:2])
    assert two.root_key == three.root_key
    assert two.doc_specs == three.doc_specs[:2]
    # Another order is another path: the same document, other ids (its neighbour's tail).
    swapped = builder.build("Q?", list(reversed(_docs())))
    assert swapped.doc_specs[0].key.doc_id == "c"


def test_node_keys_change_with_the_text(tokenizer) -> None:  # type: ignore[no-untyped-def]
    builder = _builder(tokenizer)
    after = Document("z", "A last one.")
    a = builder.build("q?", [Document("a", "old text here"), after]).doc_specs
    b = builder.build("q?", [Document("a", "new text here"), after]).doc_specs
    assert a[0].key.doc_id == b[0].key.doc_id and a[0].key != b[0].key


def test_roots_by_system_prompt_and_salt(tokenizer) -> None:  # type: ignore[no-untyped-def]
    one, two = _builder(tokenizer, system_prompt="A"), _builder(tokenizer, system_prompt="B")
    assert one.build("q?", _docs()).root_key != two.build("q?", _docs()).root_key
    plain = one.build("q?", _docs())
    tenant = one.build("q?", _docs(), cache_salt="tenant-1")
    other = one.build("q?", _docs(), cache_salt="tenant-2")
    assert plain.token_ids == tenant.token_ids  # the salt never changes the prompt
    assert len({plain.root_key, tenant.root_key, other.root_key}) == 3
    assert tenant.root_key == one.build("other q?", _docs(), cache_salt="tenant-1").root_key
    with pytest.raises(InputError, match="cache_salt"):
        one.build("q?", _docs(), cache_salt="")
    with pytest.raises(InputError, match="cache_salt"):
        Framing(cache_salt="")


def test_numbered_documents_are_keyed_by_their_rendered_text(tokenizer) -> None:  # type: ignore[no-untyped-def]
    """ "[{position}]" makes a document's tokens depend on where it is; the tree is keyed by
    path, so position i is always depth i: the same document at another position is another
    node (exact), and a repeated prefix still hits."""
    prompt = AppPrompt(
        text="Docs:\n" + CONTEXT + "Q: " + QUESTION,
        document=DocumentTemplate("[{position}] {title}: {text}\n", "[{position}] {text}\n"),
        chat=False,
    )
    builder = _builder(tokenizer)
    first = builder.build("q?", _docs(), prompt)
    assert "[1] Paris" in tokenizer.decode(first.doc_ids[0])
    assert "[2] The Seine" in tokenizer.decode(first.token_ids)
    again = builder.build("other?", _docs()[:2], prompt)
    assert again.doc_specs == first.doc_specs[:2]
    moved = builder.build("q?", _docs()[1:], prompt)  # "b" is now [1]
    assert moved.doc_specs[0].key != first.doc_specs[1].key


def test_documents_already_in_the_text_are_found(tokenizer) -> None:  # type: ignore[no-untyped-def]
    """A prompt without the CONTEXT marker (an LLM that received a rendered prompt): the
    documents are found in it, in order; a document that is not there is computed."""
    docs = _docs()[:2]
    text = f"Answer from these.\n{docs[0].text}\n---\n{docs[1].text}\nQ: where?\nA:"
    shown = [Document(d.id, d.text, prompt_text=d.text) for d in docs]
    prompt = AppPrompt(text=text, chat=False, special_tokens=True)
    builder = _builder(tokenizer)
    built = builder.build("where?", shown, prompt)
    assert built.token_ids == tokenizer.encode(text, add_special_tokens=True)
    assert len(built.doc_specs) == 2 and built.unplaced_docs == 0
    missing = builder.build(
        "where?", [*shown, Document("x", "not in it", prompt_text="nope!")], prompt
    )
    assert missing.unplaced_docs == 1 and missing.token_ids == built.token_ids


def test_bad_input_is_refused(tokenizer) -> None:  # type: ignore[no-untyped-def]
    builder = _builder(tokenizer)
    with pytest.raises(InputError, match="empty"):
        builder.build("   ", _docs())
    with pytest.raises(InputError, match="must be a string"):
        builder.build(42, _docs())  # type: ignore[arg-type]
    with pytest.raises(InputError, match="exactly one"):
        AppPrompt()
    with pytest.raises(InputError, match="more than once"):
        AppPrompt(text=CONTEXT + CONTEXT)
    with pytest.raises(InputError, match="role"):
        AppPrompt(messages=({"content": "x"},))
    raising = AppPrompt(messages=({"role": "user", "content": CONTEXT},), chat_template_kwargs={})
    tokenizer_without = _builder(tokenizer)
    tokenizer_without._tokenizer = type("T", (), {"chat_template": None})()  # no template
    with pytest.raises(InputError, match="no chat template"):
        tokenizer_without.build("q?", _docs(), raising)


def test_app_prompt_json_round_trip() -> None:
    prompt = AppPrompt(
        messages=(
            {"role": "system", "content": "S " + CONTEXT},
            {"role": "user", "content": QUESTION},
        ),
        separator="\n\n",
        chat_template_kwargs={"date_string": "1 Jan 2025"},
    )
    assert AppPrompt.from_json(prompt.to_json()) == prompt
    with pytest.raises(InputError):
        AppPrompt.from_json({"messages": [], "text": None, "bogus": 1, "document": {"x": 1}})


# ---------------------------------------------------------------------- what bad input costs


class _CountingTokenizer:
    """The real tokenizer, counting the characters it was asked to tokenize (a spy: what is
    under test is whether the builder tokenizes, not the tokenizer)."""

    def __init__(self, tokenizer) -> None:  # type: ignore[no-untyped-def]
        self._tokenizer = tokenizer
        self.encoded_chars = 0

    def __call__(self, text: str, **kwargs):  # type: ignore[no-untyped-def]
        self.encoded_chars += len(text)
        return self._tokenizer(text, **kwargs)

    def encode(self, text: str, **kwargs):  # type: ignore[no-untyped-def]
        self.encoded_chars += len(text)
        return self._tokenizer.encode(text, **kwargs)

    def __getattr__(self, name: str):  # type: ignore[no-untyped-def]
        return getattr(self._tokenizer, name)

    def __len__(self) -> int:
        return len(self._tokenizer)


def test_a_prompt_that_cannot_fit_is_refused_before_it_is_memoized(tokenizer) -> None:  # type: ignore[no-untyped-def]
    from ragcache_core.errors import PromptTooLong

    spy = _CountingTokenizer(tokenizer)
    builder = PromptBuilder(spy, PromptConfig(chat_template=False), "m", "float32")
    fits = builder.build("q?", _docs(), max_tokens=4095)
    assert len(builder.memo) == 1 and fits.num_tokens < 100 and spy.encoded_chars > 0
    long_doc = Document("long", "word " * 2000)  # ~2,000 tokens: tokenized, then refused
    with pytest.raises(PromptTooLong, match="at most 1000 fit") as refused:
        builder.build("q?", [*_docs(), long_doc], max_tokens=1000)
    assert refused.value.tokens > 1000 and len(builder.memo) == 1  # nothing memoized
    spy.encoded_chars = 0
    huge = Document("huge", "x" * 5_000_000)  # cannot fit at any tokenization
    with pytest.raises(PromptTooLong, match="characters of text"):
        builder.build("q?", [huge], max_tokens=4095)
    assert spy.encoded_chars == 0 and len(builder.memo) == 1  # not even tokenized
    assert builder.build("q?", [long_doc], max_tokens=4095).num_tokens > 1000  # fits now
    assert len(builder.memo) == 2
    with pytest.raises(PromptTooLong):  # memoized, and still refused where it does not fit
        builder.build("q?", [long_doc], max_tokens=1000)


def test_the_token_memo_is_bounded_in_bytes(tokenizer) -> None:  # type: ignore[no-untyped-def]
    from ragcache_core.runtime.prompt import TokenMemo, _Encoded, memo_entry_bytes

    spy = _CountingTokenizer(tokenizer)
    memo = TokenMemo(max_bytes=200_000)
    config = PromptConfig(chat_template=False)
    builder = PromptBuilder(spy, config, "m", "f", memo=memo)
    docs = [Document(f"d{i}", f"document number {i} " * 40) for i in range(100)]
    for doc in docs:
        builder.build("q?", [doc])
        assert memo.nbytes <= memo.max_bytes
    kept = len(memo)
    assert 0 < kept < len(docs)  # the oldest were dropped
    entries = list(memo._entries.values())
    assert memo.nbytes == sum(memo_entry_bytes(e) for e in entries)
    spy.encoded_chars = 0
    other = PromptBuilder(spy, config, "m", "f", memo=memo)  # one memo, shared
    assert other.build("q?", [docs[-1]]).token_ids == builder.build("q?", [docs[-1]]).token_ids
    assert spy.encoded_chars == 0  # the newest: memoized, for both builders
    builder.build("q?", [docs[0]])
    assert spy.encoded_chars > 0  # the oldest: dropped (least recently used), tokenized again
    small = TokenMemo(max_bytes=10)
    small.put("big", _Encoded(tuple(range(100)), tuple(range(100)), tuple(range(100))))
    assert len(small) == 0 and small.nbytes == 0  # larger than the whole bound: not kept
