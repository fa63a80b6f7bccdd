"""LlamaIndex's query-engine conventions, as far as RAGCache can honour them.

`index.as_query_engine(**kwargs)` takes LlamaIndex's keywords (`text_qa_template`,
`node_postprocessors`, `response_mode`, `filters`, ...); `as_query_engine(index, cache=...)`
takes the same names where RAGCache does what they mean, and refuses the others by name:

- `check_keywords`: an unknown keyword is a `TypeError` naming the public call and listing
  the engine's keywords and the search adapter's (`nprobe`, `sizing`, `ef_search`), so it never
  reaches an internal function.
- `check_response_mode`: "compact" (LlamaIndex's default) is served: one LLM call with every
  node in the QA template, nodes joined by a blank line, which is what `CompactAndRefine`
  sends when the nodes fit the context window (when they do not, RAGCache raises
  `PromptTooLong` instead of refining). Every other mode is refused with its reason.
- `ResponsePrompts`: the prompt module a stock `RetrieverQueryEngine` reports as
  `response_synthesizer`, so `get_prompts()` / `update_prompts()` take the stock keys.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any

from llama_index.core.postprocessor.types import BaseNodePostprocessor
from llama_index.core.prompts.base import BasePromptTemplate
from llama_index.core.prompts.chat_prompts import (
    CHAT_CONTENT_QA_PROMPT,
    CHAT_CONTENT_REFINE_PROMPT,
)
from llama_index.core.prompts.default_prompt_selectors import (
    DEFAULT_REFINE_PROMPT_SEL,
    DEFAULT_TEXT_QA_PROMPT_SEL,
)
from llama_index.core.prompts.mixin import PromptDictType, PromptMixin, PromptMixinType
from llama_index.core.response_synthesizers.type import ResponseMode

from ragcache_core.errors import ConfigError, wrong_type

SEARCH_KEYWORDS = ("embed_model", "nprobe", "sizing", "ef_search", "plan")
"""The search adapter's own keywords (`adapters.search_source`: the question's embed model, as
the stock engine passes it to its retriever, and the Faiss IVF / HNSW settings)."""
_HINTS = {
    "llm": "RAGCache answers with the cache's own model",
    "summary_template": "it belongs to response_mode='tree_summarize', which RAGCache refuses",
    "simple_template": "it belongs to response_mode='generation', which RAGCache refuses",
}

SERVED_MODE = ResponseMode.COMPACT
REFUSED_MODES = {
    ResponseMode.REFINE: "it makes one LLM call per node, each refining the previous answer",
    ResponseMode.TREE_SUMMARIZE: "it makes several LLM calls (summaries of summaries)",
    ResponseMode.ACCUMULATE: "it makes one LLM call per node and concatenates the answers",
    ResponseMode.COMPACT_ACCUMULATE: "it makes one LLM call per packed chunk and concatenates "
    "the answers",
    ResponseMode.SIMPLE_SUMMARIZE: "it joins the nodes with one newline and truncates them to "
    "the context window, and RAGCache never truncates a document",
    ResponseMode.GENERATION: "it ignores the retrieved nodes, so there is nothing to cache",
    ResponseMode.NO_TEXT: "it makes no LLM call (use index.as_retriever() for the nodes alone)",
    ResponseMode.CONTEXT_ONLY: "it makes no LLM call (use index.as_retriever() for the nodes "
    "alone)",
}


def check_keywords(where: str, given: Mapping[str, Any], engine_keywords: Sequence[str]) -> None:
    """`TypeError` naming `where` and listing both keyword sets (the engine's
    `engine_keywords`, the search adapter's), unless every keyword in `given` is one of the
    search adapter's."""
    unknown = sorted(set(given) - set(SEARCH_KEYWORDS))
    if not unknown:
        return
    hints = "; ".join(f"{name}: {_HINTS[name]}" for name in unknown if name in _HINTS)
    raise TypeError(
        f"{where} got keywords it does not take: {unknown}"
        + (f" ({hints})" if hints else "")
        + f". It takes the query engine's {list(engine_keywords)} and the search adapter's "
        f"{list(SEARCH_KEYWORDS)}"
    )


def check_postprocessors(given: object) -> list[BaseNodePostprocessor]:
    """`given` (None or a sequence of LlamaIndex node postprocessors) as a list; `TypeError`
    naming the first item that is no `BaseNodePostprocessor`."""
    if given is None:
        return []
    if isinstance(given, BaseNodePostprocessor) or not isinstance(given, list | tuple):
        raise wrong_type("node_postprocessors=", "a list of node postprocessors", given)
    for index, postprocessor in enumerate(given):
        if not isinstance(postprocessor, BaseNodePostprocessor):
            raise wrong_type(
                f"node_postprocessors[{index}]",
                "a LlamaIndex node postprocessor (BaseNodePostprocessor)",
                postprocessor,
            )
    return list(given)


def check_response_mode(mode: object) -> ResponseMode:
    """The `ResponseMode` for `mode` when RAGCache serves it ("compact"); `NotImplementedError`
    with the reason for another LlamaIndex mode, `ConfigError` for a value that is none."""
    try:
        wanted = ResponseMode(mode)
    except ValueError:
        names = [m.value for m in ResponseMode]
        raise ConfigError(
            f"response_mode={mode!r} is not a LlamaIndex ResponseMode ({names})"
        ) from None
    if wanted is not SERVED_MODE:
        raise NotImplementedError(
            f"response_mode={wanted.value!r} is not served by RAGCache: {REFUSED_MODES[wanted]}. "
            "RAGCache makes one LLM call with every node in the QA template: "
            "response_mode='compact' (LlamaIndex's default)"
        )
    return wanted


class ResponsePrompts(PromptMixin):
    """The prompts a stock compact-mode synthesizer reports, under the same keys.

    `text_qa_template` is the QA template the engine renders; `on_text_qa(template)` is called
    with a new one (the engine re-renders its prompt, raising `ConfigError` for a template it
    cannot fill, in which case nothing changes). `refine_template` and the `chat_content_*`
    templates are kept and reported but never used: LlamaIndex uses the first only when the
    nodes overflow one call (RAGCache raises `PromptTooLong` then) and the others only for
    multimodal content.
    """

    def __init__(
        self,
        text_qa_template: BasePromptTemplate | None,
        refine_template: BasePromptTemplate | None,
        on_text_qa: Callable[[BasePromptTemplate], None],
    ) -> None:
        self._prompts: dict[str, BasePromptTemplate] = {
            "text_qa_template": text_qa_template or DEFAULT_TEXT_QA_PROMPT_SEL,
            "refine_template": refine_template or DEFAULT_REFINE_PROMPT_SEL,
            "chat_content_qa_template": CHAT_CONTENT_QA_PROMPT,
            "chat_content_refine_template": CHAT_CONTENT_REFINE_PROMPT,
        }
        self._on_text_qa = on_text_qa

    def _get_prompts(self) -> PromptDictType:
        return dict(self._prompts)

    def _get_prompt_modules(self) -> PromptMixinType:
        return {}

    def _update_prompts(self, prompts_dict: PromptDictType) -> None:
        """Keys a stock synthesizer does not have are ignored, as a stock one ignores them."""
        for key, template in prompts_dict.items():
            if key not in self._prompts:
                continue
            if not isinstance(template, BasePromptTemplate):
                raise ConfigError(
                    f"update_prompts: response_synthesizer:{key} must be a LlamaIndex prompt "
                    f"template, got {type(template).__name__}"
                )
            if key == "text_qa_template":
                self._on_text_qa(template)
            self._prompts[key] = template


__all__ = [
    "REFUSED_MODES",
    "SEARCH_KEYWORDS",
    "ResponsePrompts",
    "check_keywords",
    "check_postprocessors",
    "check_response_mode",
]
