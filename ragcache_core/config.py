"""`CacheConfig`: every setting of a `RAGCache`, with sensible defaults.

Grouped by the part that reads it: pools and policy (the knowledge tree and the KV connector),
scheduling (reordering and speculation), prompt (template, system prompt, document wrapper),
engine (vLLM) and fault tolerance.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, field, fields, replace
from typing import Any, ClassVar

from ragcache_core.documents import DEFAULT_DOC_TEMPLATE, DocumentTemplate
from ragcache_core.errors import ConfigError, InputError, SamplingError

SPECULATION_MIN_SEARCH_S = 0.1
"""Speculation's gate by default: on a source whose searches take under 100 ms (every shipped
workload's but search-heavy's: well under 1 ms) speculation was measured to cost, above it to
gain; docs/benchmarks.md, "Search-heavy"."""

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


SEED_MIN, SEED_MAX = -(2**63), 2**63 - 1
"""The seeds vLLM accepts (its engine's transport carries 64-bit integers); -1 is random."""
LOGIT_BIAS_LIMIT = 100.0
"""vLLM clamps every logit bias to [-100, 100]."""


@dataclass(frozen=True)
class StructuredOutputs:
    """Constrained decoding (vLLM's `StructuredOutputsParams`): exactly one of `json` (a JSON
    schema, as a dict or its text), `regex`, `choice`, `grammar` (EBNF), `json_object` (any
    JSON object) or `structural_tag`; the other fields tune it."""

    json: str | Mapping[str, Any] | None = field(default=None, metadata={"lax_str": True})
    regex: str | None = None
    choice: tuple[str, ...] | None = None
    grammar: str | None = None
    json_object: bool | None = None
    structural_tag: str | None = None
    disable_any_whitespace: bool = False
    disable_additional_properties: bool = False
    whitespace_pattern: str | None = None

    CONSTRAINTS: ClassVar[tuple[str, ...]] = (
        "json",
        "regex",
        "choice",
        "grammar",
        "json_object",
        "structural_tag",
    )

    def __post_init__(self) -> None:
        if self.choice is not None:
            object.__setattr__(self, "choice", tuple(self.choice))
        given = [name for name in self.CONSTRAINTS if getattr(self, name) is not None]
        if len(given) != 1:
            raise SamplingError(
                "structured outputs take exactly one constraint (json, regex, choice, grammar, "
                f"json_object or structural_tag), got {len(given)}: {given}",
                param="structured_outputs",
            )


@dataclass(frozen=True)
class RepetitionDetection:
    """Stop when the output repeats an n-gram (vLLM's `RepetitionDetectionParams`): patterns of
    `min_pattern_size`..`max_pattern_size` tokens seen `min_count` times in a row."""

    max_pattern_size: int = 0
    min_pattern_size: int = 0
    min_count: int = 0

    def __post_init__(self) -> None:
        if not 0 <= self.min_pattern_size <= self.max_pattern_size:
            raise SamplingError(
                "max_pattern_size, min_pattern_size must be >=0, with min_pattern_size <= "
                "max_pattern_size. Set both to 0 to disable repetitive pattern detection.",
                param="repetition_detection",
            )
        if self.max_pattern_size > 0 and self.min_count < 2:
            raise SamplingError(
                "min_count must be >= 2 to detect repetitive patterns in engine output. If you "
                "do not wish to detect repetitive patterns, set max_pattern_size to 0.",
                param="repetition_detection.min_count",
            )


@dataclass(frozen=True)
class SamplingConfig:
    """Generation settings of one request: vLLM's `SamplingParams`, field for field (the same
    names, defaults and ranges; `ragcache serve` maps OpenAI requests onto it as `vllm serve`
    maps them onto `SamplingParams`, docs/deploy.md). Out-of-range values raise
    `SamplingError` (a `ConfigError` and an `InputError`) naming the field, with vLLM's
    message, before anything runs. Checks that need the model (token ids in the vocabulary,
    the logprobs limit, a grammar) run when a request starts (`RAGCache.check_sampling`).

    - `temperature` 0 is greedy; `top_k` 0 (or -1) and `min_p` 0 turn those filters off.
    - `seed` in [-2^63, 2^63 - 1]; None or -1: random.
    - `logprobs`: None (none), 0 (the sampled token's), N (and the N most likely), -1 (all).
    - `logit_bias`: token id -> bias, clamped to [-100, 100] as vLLM does.
    - `stop_token_ids`, `bad_words`, `allowed_token_ids`, `min_tokens`,
      `include_stop_str_in_output`, `skip_special_tokens`, `spaces_between_special_tokens`,
      `logprob_token_ids`, `structured_outputs`, `repetition_detection`, `stream_interval`:
      as in vLLM.

    The one declaration of the sampling fields: the wire models of `/v1/rag/query`'s
    `sampling` and of the OpenAI routes' sampling fields (`serve.sampling_in`, with
    `StructuredOutputs` and `RepetitionDetection`), the OpenAI routes' field table
    (`serve.fields`) and the vLLM `SamplingParams` (`engine.sampling`) are derived from these
    fields. A field's `metadata` holds what only the wire states: bounds (`ge`, `le`; the
    checks here word the error when a `SamplingConfig` is built directly), `lax_str` (plain
    `str` rather than pydantic's `StrictStr`, as vLLM's model types it), and
    `generation_config` (one of the seven knobs a model's `generation_config.json` sets for
    an OpenAI request that leaves it null: `GENERATION_CONFIG_KNOBS`), with `vllm_default`
    where vLLM's default differs from this one.
    """

    max_tokens: int = 64
    temperature: float = field(
        default=0.0, metadata={"generation_config": True, "vllm_default": 1.0}
    )
    top_p: float = field(default=1.0, metadata={"generation_config": True})
    stop: tuple[str, ...] = ()
    seed: int | None = field(default=None, metadata={"ge": SEED_MIN, "le": SEED_MAX})
    ignore_eos: bool = False
    top_k: int = field(default=0, metadata={"generation_config": True})
    min_p: float = field(default=0.0, metadata={"generation_config": True})
    presence_penalty: float = field(default=0.0, metadata={"generation_config": True})
    frequency_penalty: float = field(default=0.0, metadata={"generation_config": True})
    repetition_penalty: float = field(default=1.0, metadata={"generation_config": True})
    logit_bias: Mapping[int, float] | Mapping[str, float] | None = None
    min_tokens: int = 0
    stop_token_ids: tuple[int, ...] = ()
    include_stop_str_in_output: bool = False
    bad_words: tuple[str, ...] = ()
    allowed_token_ids: tuple[int, ...] | None = None
    logprobs: int | None = None
    logprob_token_ids: tuple[int, ...] | None = None
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True
    structured_outputs: StructuredOutputs | None = None
    repetition_detection: RepetitionDetection | None = None
    stream_interval: int | None = field(default=None, metadata={"ge": 1})

    def __post_init__(self) -> None:
        self._normalize()
        _check_sampling(self)

    def _normalize(self) -> None:
        """Sequences as tuples, the bias as a {token id: clamped float} dict (as vLLM)."""
        for name in ("stop", "stop_token_ids", "bad_words"):
            value = getattr(self, name)
            if isinstance(value, str):
                raise SamplingError(f"{name} must be a sequence, not a string", param=name)
            object.__setattr__(self, name, tuple(value or ()))
        for name in ("allowed_token_ids", "logprob_token_ids"):
            value = getattr(self, name)
            if value is not None:
                object.__setattr__(self, name, tuple(value))
        if self.logit_bias is not None:
            object.__setattr__(self, "logit_bias", _clamped_bias(self.logit_bias))


GENERATION_CONFIG_KNOBS: Mapping[str, float] = {
    f.name: f.metadata.get("vllm_default", f.default)
    for f in fields(SamplingConfig)
    if f.metadata.get("generation_config")
}
"""The sampling knobs a model's `generation_config.json` sets (vLLM's
`_DEFAULT_SAMPLING_PARAMS`), each with vLLM's default: what an OpenAI request that leaves one
null gets when the model sets none (`serve.jobs.sampling_for`)."""


def _check_sampling(s: SamplingConfig) -> None:
    """vLLM's `SamplingParams._verify_args` ranges, each error naming its field."""
    _check_ints(s)
    _check_floats(s)
    for name, low, high in (
        ("presence_penalty", -2.0, 2.0),
        ("frequency_penalty", -2.0, 2.0),
        ("min_p", 0.0, 1.0),
    ):
        if not low <= getattr(s, name) <= high:
            raise SamplingError(
                f"{name} must be in [{low:g}, {high:g}], got {getattr(s, name)}.", param=name
            )
    if s.repetition_penalty <= 0:
        raise SamplingError(
            f"repetition_penalty must be greater than zero, got {s.repetition_penalty}.",
            param="repetition_penalty",
        )
    if s.temperature < 0:
        raise SamplingError(
            f"temperature must be non-negative, got {s.temperature}.", param="temperature"
        )
    if s.temperature > 2:
        raise SamplingError(
            f"temperature must be in [0, 2], got {s.temperature}.", param="temperature"
        )
    if not 0 < s.top_p <= 1:
        raise SamplingError(f"top_p must be in (0, 1], got {s.top_p}.", param="top_p")
    _check_counts(s)
    _check_tokens_and_words(s)


def _check_ints(s: SamplingConfig) -> None:
    names = ("max_tokens", "top_k", "min_tokens")
    optional = ("seed", "logprobs", "stream_interval")
    for name in (*names, *optional):
        value = getattr(s, name)
        if value is None and name in optional:
            continue
        if isinstance(value, bool) or not isinstance(value, int):
            raise SamplingError(
                f"{name} must be an integer, got {type(value).__name__}", param=name
            )
    for name in ("stop_token_ids", "allowed_token_ids", "logprob_token_ids"):
        for token in getattr(s, name) or ():
            if isinstance(token, bool) or not isinstance(token, int):
                raise SamplingError(
                    f"{name} must contain only integers, got {token!r}.", param=name
                )


def _check_floats(s: SamplingConfig) -> None:
    for name in (
        "temperature",
        "top_p",
        "min_p",
        "presence_penalty",
        "frequency_penalty",
        "repetition_penalty",
    ):
        value = getattr(s, name)
        if isinstance(value, bool) or not isinstance(value, int | float):
            raise SamplingError(f"{name} must be a number, got {type(value).__name__}", param=name)
        if not math.isfinite(value):
            raise SamplingError(f"{name} must be a finite number, got {value}.", param=name)


def _check_counts(s: SamplingConfig) -> None:
    if s.max_tokens < 1:
        raise SamplingError(
            f"max_tokens must be at least 1, got {s.max_tokens}.", param="max_tokens"
        )
    if s.top_k < -1:
        raise SamplingError(
            f"top_k must be 0 (disable), or at least 1, got {s.top_k}.", param="top_k"
        )
    if s.min_tokens < 0:
        raise SamplingError(
            f"min_tokens must be greater than or equal to 0, got {s.min_tokens}.",
            param="min_tokens",
        )
    if s.min_tokens > s.max_tokens:
        raise SamplingError(
            f"min_tokens must be less than or equal to max_tokens={s.max_tokens}, got "
            f"{s.min_tokens}.",
            param="min_tokens",
        )
    if s.seed is not None and not SEED_MIN <= s.seed <= SEED_MAX:
        raise SamplingError(
            f"seed must be in [{SEED_MIN}, {SEED_MAX}], got {s.seed}.", param="seed"
        )
    if s.logprobs is not None and s.logprobs < -1:
        raise SamplingError(
            f"logprobs must be non-negative or -1, got {s.logprobs}.", param="logprobs"
        )
    if s.stream_interval is not None and s.stream_interval < 1:
        raise SamplingError(
            f"stream_interval must be at least 1, got {s.stream_interval}.",
            param="stream_interval",
        )


def _check_tokens_and_words(s: SamplingConfig) -> None:
    for name in ("stop", "bad_words"):
        for word in getattr(s, name):
            if not isinstance(word, str):
                raise SamplingError(f"{name} must contain only strings, got {word!r}.", param=name)
    if any(not word for word in s.stop):
        raise SamplingError("stop cannot contain an empty string.", param="stop")
    if any(not word for word in s.bad_words):
        raise SamplingError(
            f"bad_words cannot contain an empty string. Got bad_words={list(s.bad_words)}",
            param="bad_words",
        )
    for name in ("stop_token_ids", "allowed_token_ids", "logprob_token_ids"):
        bad = [t for t in getattr(s, name) or () if t < 0]
        if bad:
            raise SamplingError(f"{name} cannot contain negative token ids: {bad}", param=name)
    if s.allowed_token_ids is not None and not s.allowed_token_ids:
        raise SamplingError("allowed_token_ids is not None and empty!", param="allowed_token_ids")


def _clamped_bias(bias: Mapping[Any, Any]) -> dict[int, float]:
    """{token id: bias in [-100, 100]}, as vLLM's `SamplingParams.from_optional` makes it."""
    if not isinstance(bias, Mapping):
        raise SamplingError(
            f"logit_bias must map token ids to biases, got {type(bias).__name__}",
            param="logit_bias",
        )
    out: dict[int, float] = {}
    bad_keys = []
    for key, value in bias.items():
        try:
            token = int(key)
        except (TypeError, ValueError):
            bad_keys.append(key)
            continue
        if isinstance(value, bool) or not isinstance(value, int | float) or math.isnan(value):
            raise SamplingError(
                f"logit_bias[{key!r}] must be a number, got {value!r}",
                param=f"logit_bias.{key}",
            )
        if token < 0:
            raise SamplingError(f"logit_bias has a negative token id: {token}", param="logit_bias")
        out[token] = min(LOGIT_BIAS_LIMIT, max(-LOGIT_BIAS_LIMIT, float(value)))
    if bad_keys:
        raise SamplingError(
            "logit_bias contains key(s) that cannot be converted to integer token IDs: "
            f"{bad_keys!r}",
            param="logit_bias",
        )
    return out


DOCUMENT_ORDERS = ("retrieval", "cache")
"""`document_order` values: "retrieval" (the default: the prompt shows the documents in
retrieval order) or "cache" (the order that follows the cached path, `tree.order.cache_order`;
docs/configuration.md "Document order")."""


def check_document_order(value: object) -> str:
    """`value` if it is a known document order; raises `InputError` naming it otherwise."""
    if value not in DOCUMENT_ORDERS:
        raise InputError(
            f"unknown document_order {value!r}; choose one of {', '.join(DOCUMENT_ORDERS)}"
        )
    return str(value)


DEFAULT_POLICY = "dgdsf"
"""The replacement policy a cache, the simulators and the commands use unless told otherwise
(`CacheConfig.policy`; DGDSF: docs/benchmarks.md, "Decayed frequency")."""
REMOVED_POLICIES = {
    "apgdsf": "adaptive PGDSF, an experiment that lost: 0.80 of the best policy at worst, "
    'docs/benchmarks.md "Policy hit rates"',
}
"""Policies that were removed, refused by name (`refuse_removed_policy`)."""


def refuse_removed_policy(name: str) -> None:
    """`ConfigError` naming the default policy when `name` is a removed one."""
    if name in REMOVED_POLICIES:
        raise ConfigError(
            f"policy {name!r} was removed ({REMOVED_POLICIES[name]}); "
            f"use the default, {DEFAULT_POLICY!r}"
        )


@dataclass(frozen=True)
class CacheConfig:
    """Settings of a `RAGCache`. Immutable; derive variants with `with_(...)`."""

    # Tiers and policy.
    host_pool_tokens: int = 65_536
    """Capacity of the host-tier pool (shared memory) in tokens; 0 turns the host tier off."""
    page_size: int = 16
    """Tokens per pool slot (see docs/data-plane.md, "Page size")."""
    policy: str = DEFAULT_POLICY
    """The host tier's replacement policy: "dgdsf" (the default: GDSF's Cost/Size times a
    frequency whose retrievals' weights halve every 2,000 final requests; measured at 0.995 or
    more of the best of LRU, LFU, GDSF, PGDSF and ARC in every cell of the eviction-time policy
    table, where PGDSF falls to 0.654: docs/benchmarks.md, "Decayed frequency"), "pgdsf" (the
    paper's), "gdsf", "lru", "lfu" or "arc" (docs/design.md 2.3). A removed policy ("apgdsf")
    is refused, naming the default."""
    store_policy: str = "always"
    """Which computed documents are stored: "always" (the paper), "second" (only a document
    met before at the same prefix) or "no_evict" (only into free room). See
    docs/control-plane.md for the measurement."""
    host_write: str = "eviction"
    """When the host tier is written: "eviction" (the default: as a document leaves vLLM's
    blocks, so the two tiers hold different documents: the connector watches the head of vLLM's
    free-block queue each step and copies the documents the tree keeps; measured ahead of
    write-through at equal memory, docs/benchmarks.md "Eviction-time host writes: equal memory,
    3 rounds") or "compute" (write-through: every document the store policy admits is copied to
    the host as it is computed, as vLLM's `OffloadingConnector` does). Either way the tree knows
    both tiers: a document held only in vLLM's blocks is a node (`Node.resident`, docs/design.md
    2.2), with its hits, its place in the cache's document order and its invalidation. The
    store policy decides which documents are written either way. With the host tier off
    (`host_pool_tokens=0`) nothing is written."""
    host_write_at_handout: bool = True
    """With `host_write="eviction"`: copy a kept document in the step in which vLLM hands one
    of its blocks out for other tokens (vLLM's reuse callback, `BlockPool.unpin_blocks`), before
    the step's loads and forward pass write that block, so no burst of long prefills lets one
    go while the lease has room (docs/design.md 2.2, "Copies at hand-out"). False copies only
    what the look-ahead sees, as vLLM's own lazy offload does (its proxy,
    `ragcache-offload-proxy-lazy`): a document a step takes from beyond the look-ahead is
    lost."""
    host_write_window_tokens: int = 0
    """With `host_write="eviction"`: a look-ahead, in tokens of vLLM's free-block queue watched
    from its head each step, whose kept documents are copied (after the step's forward pass)
    before vLLM hands their blocks out; 0, the default: none, every copy is made at hand-out.
    Copies run synchronously within the step either way, so the look-ahead saves no step time
    (docs/benchmarks.md, "Copies at hand-out"); it is what vLLM's lazy offload does, and its
    proxy uses it (one step's budget, `max_num_batched_tokens`)."""
    host_write_return: str = "head"
    """With a look-ahead: where a document's blocks go back in vLLM's free-block queue after
    their copy: "head" (where they were, so it leaves vLLM's blocks next and the two tiers hold
    different documents) or "tail" (vLLM's `free_blocks`, as its own lazy offload does: the
    document gets a second turn in vLLM's LRU; measured worse, docs/benchmarks.md
    "Eviction-time host writes")."""
    host_lease_victims: bool = True
    """With `host_write="eviction"`: the host lease (the slots the engine copies into) is the
    host tier's least-wanted copies, lent as victims that stay readable until the engine
    overwrites one (True, the default: the host tier holds its whole size), rather than room
    emptied by evicting them as the lease is topped up (False: the lease's slots sit empty
    until a copy lands). docs/design.md 2.2, "The lease of victims"."""
    host_report_interval_s: float = 1.0
    """With `host_write="eviction"`: the engine's eviction-time changes (copies done, documents
    let go) reach the tree with the next report of any request. When none has come for this
    long while requests run, or since the last one finished, a one-token probe request
    fetches them (`runtime/report_probe.py`), so a lease's slots and the copies do not wait for
    a request to finish. 0 turns the probe off."""
    max_cached_depth: int | None = None
    """Cache only the first j documents of a sequence (paper 2.7); None caches all."""
    document_order: str = "retrieval"
    """The prompt's document order when a call names none: "retrieval" (as retrieved) or
    "cache" (the order that follows the cached path: more reuse with top-k > 1, but the model
    reads the documents in another order; docs/configuration.md "Document order")."""
    cost_profile: str | None = None
    """A `ragcache profile` JSON for the policies' cost model (DGDSF's and GDSF's T(0, n) / n,
    PGDSF's T(alpha, beta) / beta); None uses the built-in analytic one."""

    # Scheduling.
    reorder: bool = True
    reorder_window: int = 8
    """A waiting request is overtaken at most this many times (starvation bound)."""
    max_prefill_bs: int = 16
    """Requests in prefill at once at most. Admission also keeps the tokens to compute of the
    requests in prefill within `prefill_token_budget`; the rest wait in the reordering queue.
    Speculation starts only while both have room."""
    prefill_token_budget: int | None = None
    """Tokens to compute, summed over the requests in prefill, at most (None:
    `max_num_batched_tokens`, what vLLM's next step can take). Larger keeps the next request
    inside vLLM when a prefill ends, at the cost of fewer requests left to reorder."""
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
    """vLLM's own paged KV cache, which is RAGCache's GPU tier (its prefix cache): None is
    1 GiB on CPU; on CUDA vLLM sizes it from `gpu_memory_utilization`."""
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
        refuse_removed_policy(self.policy)
        if self.host_pool_tokens < 0:
            raise ConfigError(f"host_pool_tokens cannot be negative, got {self.host_pool_tokens}")
        if self.page_size < 1:
            raise ConfigError(f"page_size must be at least 1, got {self.page_size}")
        if self.max_prefill_bs < 1:
            raise ConfigError(f"max_prefill_bs must be at least 1, got {self.max_prefill_bs}")
        if self.prefill_token_budget is not None and self.prefill_token_budget < 1:
            raise ConfigError(
                f"prefill_token_budget must be at least 1, got {self.prefill_token_budget}"
            )
        if self.top_k < 1:
            raise ConfigError(f"top_k must be at least 1, got {self.top_k}")
        if self.reorder_window < 0:
            raise ConfigError(f"reorder_window cannot be negative, got {self.reorder_window}")
        if self.host_write not in ("compute", "eviction"):
            raise ConfigError(
                f"unknown host_write {self.host_write!r}; choose 'compute' or 'eviction'"
            )
        if self.host_write_return not in ("tail", "head"):
            raise ConfigError(
                f"unknown host_write_return {self.host_write_return!r}; choose 'tail' or 'head'"
            )
        if not self.host_report_interval_s >= 0:  # NaN too
            raise ConfigError(
                f"host_report_interval_s cannot be negative, got {self.host_report_interval_s}"
            )
        if self.host_write_window_tokens < 0:
            raise ConfigError(
                f"host_write_window_tokens cannot be negative, got {self.host_write_window_tokens}"
            )
        if self.document_order not in DOCUMENT_ORDERS:
            raise ConfigError(
                f"unknown document_order {self.document_order!r}; "
                f"choose one of {', '.join(DOCUMENT_ORDERS)}"
            )
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

    @property
    def writes_at_eviction(self) -> bool:
        """Whether the host tier is written as documents leave vLLM's blocks (there is a host
        tier and `host_write="eviction"`; without a host tier the engine still follows the
        documents in vLLM's blocks for the tree, and copies nothing)."""
        return self.host_write == "eviction" and self.host_pool_tokens > 0

    def with_(self, **changes: Any) -> CacheConfig:
        return replace(self, **changes)
