"""Prompt assembly at token level with the offline tokenizer (no engine)."""

from __future__ import annotations

from pathlib import Path

import pytest

from ragcache_core.config import PromptConfig
from ragcache_core.documents import Document
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
    ]


def test_the_prompt_is_the_rendered_text_piece_by_piece(tokenizer) -> None:  # type: ignore[no-untyped-def]
    """The ids are, in order: BOS, the head with the system prompt, each document rendered
    and tokenized on its own, the question in its template; each document's span sits at
    the offset its spec implies. Expectations are written from the config, not the builder."""
    config = PromptConfig(chat_template=False)
    builder = PromptBuilder(tokenizer, config, "m", "float32")
    question = "What is the capital of France?"
    built = builder.build(question, _docs())
    rendered = [
        "Title: Paris\nParis is the capital of France.\n\n",
        "The Seine flows through Paris.\n\n",
    ]
    head = f"{config.system_prompt}\n\n"
    tail = f"Question: {question}\nAnswer:"
    ids = built.token_ids
    assert ids[0] == tokenizer.bos_token_id and ids.count(tokenizer.bos_token_id) == 1
    assert tokenizer.decode(ids[1:]) == head + "".join(rendered) + tail
    offset = len(built.root_ids)
    assert tokenizer.decode(built.root_ids[1:]) == head
    for spec, text in zip(built.doc_specs, rendered, strict=True):
        alone = tokenizer.encode(text, add_special_tokens=False)
        assert ids[offset : offset + spec.num_tokens] == alone
        offset += spec.num_tokens
    assert tokenizer.decode(ids[offset:]) == tail
    # A document's tokens do not depend on its position, its neighbours or the question.
    swapped = builder.build("Another question?", list(reversed(_docs())))
    assert swapped.doc_ids == tuple(reversed(built.doc_ids))
    assert [s.key for s in swapped.doc_specs] == [s.key for s in reversed(built.doc_specs)]


def test_content_hash_changes_with_text(tokenizer) -> None:  # type: ignore[no-untyped-def]
    """Same document id, new text: a new key and the new text's tokens (never the
    memoized tokens of the old text)."""
    builder = PromptBuilder(tokenizer, PromptConfig(chat_template=False), "m", "float32")
    old = builder.build("q?", [Document("a", "old text")])
    new = builder.build("q?", [Document("a", "new text")])
    a, b = old.doc_specs[0].key, new.doc_specs[0].key
    assert a.doc_id == b.doc_id and a.content_hash != b.content_hash
    assert tokenizer.decode(old.doc_ids[0]) == "old text\n\n"
    assert tokenizer.decode(new.doc_ids[0]) == "new text\n\n"


def test_root_key_depends_on_system_prompt(tokenizer) -> None:  # type: ignore[no-untyped-def]
    one = PromptBuilder(tokenizer, PromptConfig(system_prompt="A"), "m", "float32")
    two = PromptBuilder(tokenizer, PromptConfig(system_prompt="B"), "m", "float32")
    assert one.root_key != two.root_key


def test_chat_template_wraps_documents_in_the_user_turn(tokenizer) -> None:  # type: ignore[no-untyped-def]
    builder = PromptBuilder(tokenizer, PromptConfig(chat_template=True), "m", "float32")
    built = builder.build("Where?", _docs())
    text = tokenizer.decode(built.token_ids)
    assert text.index("system:") < text.index("Title: Paris") < text.index("Where?")
    assert text.rstrip().endswith("assistant:")


def test_bad_questions_are_refused(tokenizer) -> None:  # type: ignore[no-untyped-def]
    builder = PromptBuilder(tokenizer, PromptConfig(), "m", "float32")
    with pytest.raises(InputError, match="empty"):
        builder.build("   ", _docs())
    with pytest.raises(InputError, match="must be a string"):
        builder.build(42, _docs())  # type: ignore[arg-type]
