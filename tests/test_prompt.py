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


def test_pieces_concatenate_to_the_prompt(tokenizer) -> None:  # type: ignore[no-untyped-def]
    builder = PromptBuilder(tokenizer, PromptConfig(chat_template=False), "m", "float32")
    built = builder.build("What is the capital of France?", _docs())
    ids = built.token_ids
    assert ids[: len(built.root_ids)] == list(built.root_ids)
    assert ids[-len(built.question_ids) :] == list(built.question_ids)
    assert len(ids) == built.num_tokens
    assert [s.num_tokens for s in built.doc_specs] == [len(d) for d in built.doc_ids]
    # A document's tokens do not depend on its position or neighbours.
    swapped = builder.build("Another question?", list(reversed(_docs())))
    assert swapped.doc_ids == tuple(reversed(built.doc_ids))
    assert tokenizer.decode(built.doc_ids[0]) == "Title: Paris\nParis is the capital of France.\n\n"


def test_content_hash_changes_with_text(tokenizer) -> None:  # type: ignore[no-untyped-def]
    builder = PromptBuilder(tokenizer, PromptConfig(chat_template=False), "m", "float32")
    a = builder.build("q?", [Document("a", "old text")]).doc_specs[0].key
    b = builder.build("q?", [Document("a", "new text")]).doc_specs[0].key
    assert a.doc_id == b.doc_id and a.content_hash != b.content_hash


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
