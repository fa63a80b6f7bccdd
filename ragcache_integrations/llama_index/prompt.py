"""LlamaIndex QA templates as RAGCache `PromptConfig`s.

The prompt's head and system prompt are the knowledge tree's root, so they belong to the
`RAGCache` (its `CacheConfig.prompt`), not to one query engine: two engines with different
heads could never share KV. A LlamaIndex template maps onto a `PromptConfig` like this:

    "{pre}{context_str}{post with {query_str}}"
        pre   -> system prompt (the cached root; head "{system}")
        each retrieved node -> one document through the document template (cached per node)
        post  -> question template, {query_str} -> {question} (never cached)
"""

from __future__ import annotations

from dataclasses import replace
from string import Formatter

from llama_index.core.prompts.base import BasePromptTemplate

from ragcache_core.config import PromptConfig
from ragcache_core.errors import ConfigError

CONTEXT_VAR = "context_str"
QUERY_VAR = "query_str"


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


def check_prompt(cache_prompt: PromptConfig, wanted: PromptConfig) -> None:
    """Raise `ConfigError` unless the cache already renders prompts as `wanted`."""
    if cache_prompt != wanted:
        raise ConfigError(
            "this RAGCache renders a different prompt (the prompt head is part of the cache key, "
            "so it is set once per RAGCache): build it with "
            "CacheConfig(prompt=prompt_config(template))"
        )
