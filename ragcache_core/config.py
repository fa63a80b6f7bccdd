"""`CacheConfig`: every setting of a `RAGCache`, with sensible defaults.

Grouped by the part that reads it: pools and policy (the knowledge tree and the KV connector),
scheduling (reordering and speculation), prompt (template, system prompt, document wrapper),
engine (vLLM) and fault tolerance.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Any

from ragcache_core.documents import DEFAULT_DOC_TEMPLATE, DocumentTemplate
from ragcache_core.errors import ConfigError

SPECULATION_MIN_SEARCH_S = 0.0
"""Speculation's gate by default: searches under 100 ms have too little to hide (the figures:
docs/benchmarks.md, "Search-heavy")."""

DEFAULT_SYSTEM_PROMPT = (
    "You are a helpful assistant. Answer the question using the documents below."
)


@dataclass(frozen=True)
class PromptConfig:
    """How a request's prompt is assembled (docs/design.md 3.3).

    prompt = head + system prompt (the tree's root) + each document through `document`
    (position independent) + `question` (never cached). With a chat template (`chat_template`
    True, or None and the tokenizer has one) the head and the question part come from the
    model's chat template instead, with the documents inside the user turn.
    """

    system_prompt: str = DEFAULT_SYSTEM_PROMPT
    head: str = "{system}\n\n"
    document: DocumentTemplate = DEFAULT_DOC_TEMPLATE
    question: str = "Question: {question}\nAnswer:"
    chat_template: bool | None = None
    add_bos: bool = True

    def __post_init__(self) -> None:
        if "{question}" not in self.question:
            raise ConfigError(
                f"the question template must contain '{{question}}': {self.question!r}"
            )
        if "{system}" not in self.head:
            raise ConfigError(f"the head template must contain '{{system}}': {self.head!r}")


@dataclass(frozen=True)
class SamplingConfig:
    """Generation settings of one request."""

    max_tokens: int = 64
    temperature: float = 0.0
    top_p: float = 1.0
    stop: tuple[str, ...] = ()
    seed: int | None = None
    ignore_eos: bool = False

    def __post_init__(self) -> None:
        if self.max_tokens < 1:
            raise ConfigError(f"max_tokens must be at least 1, got {self.max_tokens}")
        if self.temperature < 0:
            raise ConfigError(f"temperature cannot be negative, got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise ConfigError(f"top_p must be in (0, 1], got {self.top_p}")


@dataclass(frozen=True)
class CacheConfig:
    """Settings of a `RAGCache`. Immutable; derive variants with `with_(...)`."""

    # Pools and policy.
    gpu_pool_tokens: int = 16_384
    """Capacity of the GPU-tier pool in tokens (on CPU-only machines: a second pool in RAM)."""
    host_pool_tokens: int = 65_536
    """Capacity of the host-tier pool (shared memory) in tokens; 0 turns the host tier off."""
    page_size: int = 16
    """Tokens per pool slot (see docs/data-plane.md, "Page size")."""
    policy: str = "pgdsf"
    store_policy: str = "always"
    """Which computed documents are stored: "always" (the paper), "second" (only a document
    met before at the same prefix) or "no_evict" (only into free room). See
    docs/control-plane.md for the measurement."""
    max_cached_depth: int | None = None
    """Cache only the first j documents of a sequence (paper 2.7); None caches all."""
    cost_profile: str | None = None
    """A `ragcache profile` JSON for PGDSF's cost model; None uses the built-in analytic one."""

    # Scheduling.
    reorder: bool = True
    reorder_window: int = 8
    """A waiting request is overtaken at most this many times (starvation bound)."""
    max_prefill_bs: int = 16
    """Requests in prefill at once at most. Admission also keeps the tokens to compute of the
    requests in prefill within `max_num_batched_tokens` (vLLM's per-step budget); the rest
    wait in the reordering queue. Speculation starts only while both have room."""
    speculation: bool = True
    speculation_min_search_s: float = SPECULATION_MIN_SEARCH_S
    """Speculate only while this RAGCache's recent searches (a moving mean per search source,
    `runtime.speculation.SearchClock`) took at least this long; 0 always speculates. Below it
    there is too little search to hide (docs/benchmarks.md, "Search-heavy")."""
    top_k: int = 2

    # Prompt and sampling.
    prompt: PromptConfig = field(default_factory=PromptConfig)
    sampling: SamplingConfig = field(default_factory=SamplingConfig)

    # Engine (None: the device's default, see ragcache_core/engine/settings.py).
    dtype: str | None = None
    """KV and model dtype: None is float32 on CPU, bfloat16 on CUDA."""
    max_model_len: int = 4096
    block_size: int | None = None
    """vLLM's block size: None is 32 on CPU (a multiple of 32 is required there), 16 on CUDA."""
    vllm_kv_cache_gib: float | None = None
    """vLLM's own paged KV cache: None is 1 GiB on CPU; on CUDA vLLM sizes it from
    `gpu_memory_utilization`, which leaves room for the GPU pool."""
    gpu_memory_utilization: float | None = None
    max_num_seqs: int = 16
    max_num_batched_tokens: int | None = None
    """vLLM's per-step token budget and admission's prefill budget (None: 4,096 on CPU,
    8,192 on CUDA)."""
    engine_extra: dict[str, Any] = field(default_factory=dict)
    """Further vLLM engine arguments; keys that contradict the connector are refused
    (`engine.settings.RESERVED_EXTRA`)."""

    # Fault tolerance.
    request_timeout_s: float = 120.0
    max_retries: int = 1
    restart_engine: bool = True

    def __post_init__(self) -> None:
        for name in ("gpu_pool_tokens", "host_pool_tokens"):
            if getattr(self, name) < 0:
                raise ConfigError(f"{name} cannot be negative, got {getattr(self, name)}")
        if self.page_size < 1:
            raise ConfigError(f"page_size must be at least 1, got {self.page_size}")
        if self.max_prefill_bs < 1:
            raise ConfigError(f"max_prefill_bs must be at least 1, got {self.max_prefill_bs}")
        if self.top_k < 1:
            raise ConfigError(f"top_k must be at least 1, got {self.top_k}")
        if self.reorder_window < 0:
            raise ConfigError(f"reorder_window cannot be negative, got {self.reorder_window}")
        if self.max_cached_depth is not None and self.max_cached_depth < 0:
            raise ConfigError(f"max_cached_depth cannot be negative, got {self.max_cached_depth}")
        if self.request_timeout_s <= 0:
            raise ConfigError(f"request_timeout_s must be positive, got {self.request_timeout_s}")
        if not self.speculation_min_search_s >= 0:  # NaN too
            raise ConfigError(
                f"speculation_min_search_s cannot be negative, got {self.speculation_min_search_s}"
            )
        if self.max_retries < 0:
            raise ConfigError(f"max_retries cannot be negative, got {self.max_retries}")

    def with_(self, **changes: Any) -> CacheConfig:
        return replace(self, **changes)
