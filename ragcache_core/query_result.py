"""What a `RAGCache` request returns: typed, frozen, safe to keep and share."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any

from ragcache_core.documents import Document


@dataclass(frozen=True)
class CacheHits:
    """What one request read from the cache."""

    gpu_docs: int = 0
    host_docs: int = 0
    computed_docs: int = 0
    root_cached: bool = False
    cached_tokens: int = 0
    computed_tokens: int = 0

    @property
    def hit_docs(self) -> int:
        return self.gpu_docs + self.host_docs


@dataclass(frozen=True)
class Candidate:
    """One token the engine scored at a step: its id, log-probability, rank (1 = most likely)
    and text (None when the engine did not decode it)."""

    token_id: int
    logprob: float
    rank: int | None = None
    text: str | None = None


@dataclass(frozen=True)
class TokenLogprobs:
    """One generated token's log-probability (`SamplingConfig.logprobs`), with the candidates
    the engine returned for its step, in the engine's order: the sampled token first, then the
    most likely ones by rank. `logprob` and `text` are None when the step did not score the
    sampled token (only `logprob_token_ids` were asked for)."""

    token_id: int
    logprob: float | None
    text: str | None
    candidates: tuple[Candidate, ...] = ()


@dataclass(frozen=True)
class QueryResult:
    """The answer to one question, with where it came from and how fast."""

    answer: str
    token_ids: tuple[int, ...]
    sources: tuple[Document, ...]
    ttft_s: float
    """From the call to the first token that could be shown (search included)."""
    retrieval_s: float
    queue_wait_s: float
    hits: CacheHits
    prompt_tokens: int
    finish_reason: str | None = None
    speculative: bool = False
    """True when the answer came from a speculative generation started before the search ended."""
    search_hidden_s: float = 0.0
    """The part of `retrieval_s` that the adopted speculative generation overlapped (from its
    start to the search's end); 0 when the answer was not speculative. `retrieval_s -
    search_hidden_s` is the search time the answer waited for (non-overlapped)."""
    retries: int = 0
    scores: tuple[float, ...] = ()
    """The search scores of `sources` (empty when the caller gave the documents)."""
    retrieval_ranks: tuple[int, ...] = ()
    """Each source's retrieval rank (0: retrieved first), parallel to `sources`, which list
    the documents in the order the model read them: with `document_order="cache"` that order
    may differ from retrieval's (a citing app cites `sources` as served)."""
    timings: dict[str, float] = field(default_factory=dict)
    """Where the request's time went, in seconds: `plan` (tree walk, eviction, plan check and
    serialization), `engine_first_token` (submit to first token: scheduling, copies, prefill),
    `load_copy` / `store_copy` (the worker's copies in this request's steps, shared with the
    other requests of those steps), `window_copy` (the eviction-time host writes that ran after
    the forward passes of the steps computing this request's prompt), `settle` (the final report
    applied)."""
    logprobs: tuple[TokenLogprobs, ...] = ()
    """One per generated token when `SamplingConfig.logprobs` (or `logprob_token_ids`) asked
    for them, else empty."""
    prompt_text: str | None = None
    """The prompt as the model saw it, when the call asked for it (`return_prompt=True`): the
    app's prompt (or the cache's layout) with the documents and the question in, rendered
    through the model's chat template (or as its text): the text the prompt ids were tokenized
    from. None when not asked for (rendering it again costs a chat-template pass)."""

    def openai_usage(self) -> dict[str, Any]:
        """OpenAI's `usage`, with `prompt_tokens_details.cached_tokens` as `vllm serve
        --enable-prompt-tokens-details` fills it: the prompt tokens served from the cache
        (vLLM's prefix cache and RAGCache's host tier; `CacheHits.cached_tokens`), 0 when none
        were. Where OpenAI clients read cached tokens (LangChain's `ChatOpenAI` maps it to
        `usage_metadata["input_token_details"]["cache_read"]`); the server's responses, the
        LlamaIndex LLM events and the LangChain `token_usage` all carry this one shape."""
        completion = len(self.token_ids)
        return {
            "prompt_tokens": self.prompt_tokens,
            "completion_tokens": completion,
            "total_tokens": self.prompt_tokens + completion,
            "prompt_tokens_details": {"cached_tokens": self.hits.cached_tokens},
        }

    def report(self) -> dict[str, Any]:
        """The measurements as plain values (what the framework integrations attach as
        metadata)."""
        return {
            "ttft_s": self.ttft_s,
            "retrieval_s": self.retrieval_s,
            "queue_wait_s": self.queue_wait_s,
            "speculative": self.speculative,
            "prompt_tokens": self.prompt_tokens,
            "token_ids": list(self.token_ids),
            "no_context": not self.sources,
            "cache_hits": asdict(self.hits),
        }


@dataclass(frozen=True)
class StreamChunk:
    """A piece of a streamed answer: its text, the tokens generated since the previous chunk
    (and their logprobs, when asked for); the last one carries the full `result`."""

    delta: str
    result: QueryResult | None = None
    token_ids: tuple[int, ...] = ()
    logprobs: tuple[TokenLogprobs, ...] = ()
