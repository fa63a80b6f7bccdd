"""What RAGCache's answers look like to LangChain's tracing: usage, the answer as an
`AIMessage`, and one LLM run reported through LangChain's LLM callbacks.

`RAGCacheChatModel` is a `BaseChatModel`, so LangChain reports its LLM runs itself
(`on_chat_model_start` with the messages, `on_llm_end` with the message and its usage).
`RAGCacheRunnable` is the `prompt | llm` pair in one step: it reports the LLM run inside its
chain run with `report_llm_run`, once the answer is in (its prompt is known only then: the
documents may come from RAGCache's own search): `on_llm_start` with the prompt as the model saw
it (`QueryResult.prompt_text`: the chat template rendered, documents and question in), then
`on_llm_end` with the answer, `usage_metadata` and the report. The chain run around it carries
the call's timing; TTFT is in the report.
"""

from __future__ import annotations

from typing import Any
from uuid import uuid4

from langchain_core.callbacks.manager import AsyncCallbackManager, CallbackManager
from langchain_core.messages import AIMessage
from langchain_core.messages.ai import UsageMetadata
from langchain_core.outputs import ChatGeneration, LLMResult

from ragcache_core.query_result import QueryResult


def usage_metadata(result: QueryResult) -> UsageMetadata:
    """LangChain's usage of one answer: `cache_read` is the prompt tokens the cache served
    (vLLM's prefix cache and RAGCache's host tier), as `ChatOpenAI` reads OpenAI's
    `cached_tokens`."""
    output = len(result.token_ids)
    return UsageMetadata(
        input_tokens=result.prompt_tokens,
        output_tokens=output,
        total_tokens=result.prompt_tokens + output,
        input_token_details={"cache_read": result.hits.cached_tokens},
    )


def response_metadata(result: QueryResult, model: str) -> dict[str, Any]:
    """`response_metadata`: LangChain's keys (`model_name`, `finish_reason`) and RAGCache's
    report under "ragcache" (`QueryResult.report()` with the document ids)."""
    return {
        "model_name": model,
        "finish_reason": result.finish_reason,
        "ragcache": {**result.report(), "documents": [d.id for d in result.sources]},
    }


def ai_message(result: QueryResult, model: str) -> AIMessage:
    """The answer as LangChain's `AIMessage`, with its usage and metadata."""
    return AIMessage(
        content=result.answer,
        usage_metadata=usage_metadata(result),
        response_metadata=response_metadata(result, model),
    )


def llm_result(result: QueryResult, model: str) -> LLMResult:
    """What `on_llm_end` receives: the answer as a chat generation (its message carries the
    usage, where LangSmith and Langfuse read it) and OpenAI-style `token_usage`."""
    return LLMResult(
        generations=[[ChatGeneration(message=ai_message(result, model))]],
        llm_output={"token_usage": result.openai_usage(), "model_name": model},
    )


def _start_args(name: str, model: str, result: QueryResult) -> tuple[dict[str, Any], list[str]]:
    serialized = {"name": name, "id": ["ragcache", name], "kwargs": {"model_name": model}}
    return serialized, [result.prompt_text or ""]


def report_llm_run(manager: CallbackManager, name: str, model: str, result: QueryResult) -> None:
    """One LLM run of `result` through `manager` (the chain run's child): `on_llm_start` with
    the prompt text, `on_llm_end` with the answer and its usage."""
    serialized, prompts = _start_args(name, model, result)
    for run in manager.on_llm_start(serialized, prompts, run_id=uuid4()):
        run.on_llm_end(llm_result(result, model))


async def areport_llm_run(
    manager: AsyncCallbackManager, name: str, model: str, result: QueryResult
) -> None:
    """`report_llm_run` through an async manager."""
    serialized, prompts = _start_args(name, model, result)
    for run in await manager.on_llm_start(serialized, prompts, run_id=uuid4()):
        await run.on_llm_end(llm_result(result, model))
