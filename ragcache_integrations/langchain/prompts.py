"""A LangChain prompt template as RAGCache's `AppPrompt`: the app's own prompt, rendered as
LangChain renders it, with the documents spliced where the template puts its context.

    app_prompt(ChatPromptTemplate.from_messages([("system", "... Context: {context}"),
                                                 ("human", "{input}")]),
               {"input": "Who?"})
      -> AppPrompt(messages=[system "... Context: <CONTEXT>", user "Who?"], separator="\\n\\n")

- `ChatPromptTemplate`: `format_messages` with every input and the context variable set to
  `CONTEXT`; the messages keep their roles (system, user, assistant, tool, or a
  `ChatMessage`'s own role), as `ChatOpenAI` sends them to `vllm serve`, whose chat template
  then renders them.
- a string template (`PromptTemplate`): `format` the same way; the text goes through the
  model's chat template as one user message when the model has one (what a chat model does
  with a string prompt), else as it is.
- each document is `format_document(doc, document_prompt)` (default `"{page_content}"`),
  joined by `document_separator` (default `"\\n\\n"`), as `create_stuff_documents_chain` does.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from langchain_core.documents import Document as LCDocument
from langchain_core.messages import (
    AIMessage,
    BaseMessage,
    ChatMessage,
    HumanMessage,
    SystemMessage,
    ToolMessage,
)
from langchain_core.prompts import BasePromptTemplate, PromptTemplate, format_document
from langchain_core.prompts.chat import BaseChatPromptTemplate

from ragcache_core.app_prompt import CONTEXT, AppPrompt
from ragcache_core.documents import Document, DocumentTemplate
from ragcache_core.errors import InputError
from ragcache_integrations.langchain.documents import to_ragcache

DEFAULT_DOCUMENT_PROMPT = PromptTemplate.from_template("{page_content}")
DEFAULT_SEPARATOR = "\n\n"
VERBATIM = DocumentTemplate(titled="{text}", untitled="{text}")
"""`format_document` with the default `"{page_content}"`, for documents RAGCache retrieves."""


def message_dict(message: BaseMessage) -> dict[str, Any]:
    """A LangChain message as the OpenAI message `ChatOpenAI` would send (role + content)."""
    if isinstance(message, SystemMessage):
        role = "system"
    elif isinstance(message, HumanMessage):
        role = "user"
    elif isinstance(message, AIMessage):
        role = "assistant"
    elif isinstance(message, ToolMessage):
        role = "tool"
    elif isinstance(message, ChatMessage):
        role = message.role
    else:
        raise InputError(f"RAGCache cannot send a {type(message).__name__} to the model")
    content = message.content
    if not isinstance(content, str):
        parts = [p for p in content if isinstance(p, str) or p.get("type") == "text"]
        if len(parts) != len(content):
            raise InputError("only text message content can go to the model")
        content = "\n".join(p if isinstance(p, str) else str(p.get("text", "")) for p in parts)
    out: dict[str, Any] = {"role": role, "content": content}
    if isinstance(message, ToolMessage):
        out["tool_call_id"] = message.tool_call_id
    return out


def app_prompt(
    prompt: BasePromptTemplate,
    inputs: Mapping[str, Any],
    *,
    context_key: str = "context",
    separator: str = DEFAULT_SEPARATOR,
) -> AppPrompt:
    """`prompt` formatted with `inputs` and its context variable at `CONTEXT` (see the module
    docstring). Raises `InputError` when the template lacks the context variable or an input."""
    if context_key not in prompt.input_variables:
        raise InputError(
            f"the prompt has no {{{context_key}}} variable to put the documents in "
            f"(its variables: {sorted(prompt.input_variables)})"
        )
    values = {k: v for k, v in inputs.items() if k in prompt.input_variables}
    values[context_key] = CONTEXT
    try:
        if isinstance(prompt, BaseChatPromptTemplate):
            messages = prompt.format_messages(**values)
            messages = tuple(message_dict(m) for m in messages)
            return AppPrompt(messages=messages, separator=separator, document=VERBATIM)
        return AppPrompt(text=prompt.format(**values), separator=separator, document=VERBATIM)
    except KeyError as exc:
        raise InputError(f"the prompt needs the input {exc.args[0]!r}") from None


def shown_documents(
    documents: Sequence[LCDocument], document_prompt: BasePromptTemplate | None = None
) -> tuple[Document, ...]:
    """The documents as RAGCache documents, each shown as `format_document` renders it."""
    template = document_prompt or DEFAULT_DOCUMENT_PROMPT
    out = []
    for doc in documents:
        converted = to_ragcache(doc)
        try:
            shown = format_document(doc, template)
        except ValueError as exc:
            raise InputError(f"the document prompt cannot format a document: {exc}") from None
        out.append(Document(converted.id, converted.text, converted.metadata, prompt_text=shown))
    return tuple(out)
