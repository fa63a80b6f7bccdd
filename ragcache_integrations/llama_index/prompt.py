"""LlamaIndex QA templates as RAGCache prompts: `app_prompt` (the app's own prompt, rendered as
LlamaIndex renders it; what the query engine uses) and, older, `prompt_config` (a
`PromptConfig` in RAGCache's own layout: roles become plain text, kept for compatibility).

The prompt's head and system prompt are a root of the knowledge tree: each prompt gets its own
root, so engines with different prompts share one `RAGCache` (their documents' KV is cached
under each root apart). A LlamaIndex template maps onto a `PromptConfig` like this:

    "{pre}{context_str}{post with {query_str}}"
        pre   -> system prompt (the cached root; head "{system}")
        each retrieved node -> one document through the document template (cached per node)
        post  -> question template, {query_str} -> {question} (never cached)
"""

from __future__ import annotations

from dataclasses import replace
from string import Formatter
from typing import Any

from llama_index.core.prompts.base import BasePromptTemplate

from ragcache_core.app_prompt import CONTEXT, QUESTION, AppPrompt, default_prompt
from ragcache_core.config import PromptConfig
from ragcache_core.documents import DocumentTemplate
from ragcache_core.errors import ConfigError

CONTEXT_VAR = "context_str"
QUERY_VAR = "query_str"
NODE_SEPARATOR = "\n\n"
"""What LlamaIndex's compact response mode puts between two nodes (`PromptHelper.repack`)."""
VERBATIM = DocumentTemplate(titled="{text}", untitled="{text}")


def prompt_config(
    template: BasePromptTemplate | str, base: PromptConfig | None = None
) -> PromptConfig:
    """The `PromptConfig` that renders like `template` (a LlamaIndex QA template or its text).

    `base` supplies the settings a template does not carry (document wrapper, chat template,
    BOS). Pure. Raises `ConfigError` when the template lacks `{context_str}` or `{query_str}`,
    puts the query before the context, or uses other variables (they would have no value).
    """
    text = template if isinstance(template, str) else template.get_template()
    names = {name for _, name, _, _ in Formatter().parse(text) if name is not None}
    extra = names - {CONTEXT_VAR, QUERY_VAR}
    if extra:
        raise ConfigError(
            f"the prompt template uses variables RAGCache cannot fill: {sorted(extra)}"
        )
    pre, sep, post = text.partition("{" + CONTEXT_VAR + "}")
    if not sep:
        raise ConfigError(f"the prompt template has no {{{CONTEXT_VAR}}}: {text!r}")
    if "{" + QUERY_VAR + "}" not in post:
        raise ConfigError(f"the prompt template needs {{{QUERY_VAR}}} after {{{CONTEXT_VAR}}}")
    # Literal braces are written doubled in a format string; the PromptConfig parts are not.
    pre = pre.replace("{{", "{").replace("}}", "}")
    question = post.replace("{" + QUERY_VAR + "}", "\0").replace("{{", "{").replace("}}", "}")
    return replace(
        base or PromptConfig(),
        system_prompt=pre,
        head="{system}",
        question=question.replace("\0", "{question}"),
    )


def app_prompt(
    template: BasePromptTemplate | str | PromptConfig | None, *, chat: bool
) -> AppPrompt:
    """A LlamaIndex QA template as RAGCache's `AppPrompt`, rendered as LlamaIndex renders it
    (docs/guide-llamaindex.md): `{context_str}` is where the nodes go (each node as
    `get_content(MetadataMode.LLM)`, stripped, joined by blank lines, as the compact response
    mode packs them) and `{query_str}` is the question.

    - None: LlamaIndex's default, `DEFAULT_TEXT_QA_PROMPT_SEL` (`CHAT_TEXT_QA_PROMPT` for a
      chat model: `chat`, whether the model has a chat template; else `DEFAULT_TEXT_QA_PROMPT`);
    - a `ChatPromptTemplate`: its messages and roles, through the model's chat template;
    - a `PromptTemplate` (or its text): the text, through the chat template as one user
      message when the model has one (as LlamaIndex gives a chat LLM a text prompt), else as it
      is (as a completion LLM gets it);
    - a `PromptConfig`: RAGCache's own layout.

    Raises `ConfigError` when the template lacks `{context_str}` or uses other variables."""
    from llama_index.core.prompts import ChatPromptTemplate, PromptTemplate, SelectorPromptTemplate
    from llama_index.core.prompts.default_prompt_selectors import DEFAULT_TEXT_QA_PROMPT_SEL

    if isinstance(template, PromptConfig):
        return default_prompt(template, chat)
    if template is None:
        template = DEFAULT_TEXT_QA_PROMPT_SEL
    if isinstance(template, SelectorPromptTemplate):
        template = _select(template, chat)
    if isinstance(template, str):
        template = PromptTemplate(template)
    names = set(template.template_vars)
    if CONTEXT_VAR not in names:
        raise ConfigError(f"the prompt template has no {{{CONTEXT_VAR}}}")
    extra = names - {CONTEXT_VAR, QUERY_VAR} - set(template.kwargs)
    if extra:
        raise ConfigError(
            f"the prompt template uses variables RAGCache cannot fill: {sorted(extra)}"
        )
    values = {CONTEXT_VAR: CONTEXT, QUERY_VAR: QUESTION}
    if isinstance(template, ChatPromptTemplate):
        messages = tuple(
            {"role": m.role.value, "content": m.content or ""}
            for m in template.format_messages(**values)
        )
        return AppPrompt(messages=messages, separator=NODE_SEPARATOR, document=VERBATIM)
    return AppPrompt(text=template.format(**values), separator=NODE_SEPARATOR, document=VERBATIM)


def _select(selector: Any, chat: bool) -> BasePromptTemplate:
    """The template a `SelectorPromptTemplate` picks for a chat (or completion) model."""
    for condition, template in selector.conditionals or ():
        if condition(_ChatFlag(chat)):
            return template  # type: ignore[no-any-return]
    return selector.default_template  # type: ignore[no-any-return]


class _ChatFlag:
    """What `is_chat_model(llm)` reads: `llm.metadata.is_chat_model`."""

    def __init__(self, chat: bool) -> None:
        self.metadata = type("Metadata", (), {"is_chat_model": chat})()
