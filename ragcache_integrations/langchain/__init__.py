"""RAGCache for LangChain (langchain-core 1.x): a runnable for LCEL chains, an LLM and a chat model.

    chain = {"context": retriever, "question": RunnablePassthrough()} | RAGCacheRunnable(cache=c)
    chain = RAGCacheRunnable.from_vectorstore(faiss_store, cache=c)  # retrieves itself
    llm = RAGCacheLLM(cache=c); chain = {...: llm.watch(retriever), ...} | prompt | llm
    chat = RAGCacheChatModel(cache=c)   # a chat model: where ChatOpenAI sat, roles kept

The installed langchain-core is checked first, so an unsupported version fails here with one
clear `UnsupportedFrameworkError` instead of somewhere inside LangChain.
"""

from __future__ import annotations

from ragcache_integrations.langchain._compat import UnsupportedFrameworkError, check_version

check_version()

from ragcache_integrations.langchain.adapters import (  # noqa: E402
    OfflineEmbeddings,
    search_source,
)
from ragcache_integrations.langchain.chat_model import RAGCacheChatModel  # noqa: E402
from ragcache_integrations.langchain.documents import document_id, to_ragcache  # noqa: E402
from ragcache_integrations.langchain.llm import DocumentMemory, PromptSplit, RAGCacheLLM  # noqa: E402
from ragcache_integrations.langchain.runnable import EVENT_NAME, RAGCacheRunnable  # noqa: E402

__all__ = [
    "EVENT_NAME",
    "DocumentMemory",
    "OfflineEmbeddings",
    "PromptSplit",
    "RAGCacheChatModel",
    "RAGCacheLLM",
    "RAGCacheRunnable",
    "UnsupportedFrameworkError",
    "document_id",
    "search_source",
    "to_ragcache",
]
