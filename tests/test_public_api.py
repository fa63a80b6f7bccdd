"""The public surface, pinned: what `ragcache_core` and each integration export, the layers the
package tree promises (no module imports a layer above its own), and a client that imports
nothing heavier than httpx and the shared types. A change to any of these is a change to the
API, made here on purpose."""

from __future__ import annotations

import ast
import json
import subprocess
import sys
import warnings
from pathlib import Path
from typing import Any

import pytest

PACKAGE = Path(__file__).resolve().parents[1] / "ragcache_core"


def test_ragcache_core_exports() -> None:
    import ragcache_core

    assert sorted(ragcache_core.__all__) == [
        "AppPrompt",
        "CONTEXT",
        "CacheClosedError",
        "CacheConfig",
        "CacheHits",
        "ConfigError",
        "Document",
        "InputError",
        "MainGuardError",
        "ModelError",
        "PromptConfig",
        "QUESTION",
        "QueryResult",
        "RAGCache",
        "RAGCacheAPI",
        "RAGCacheClient",
        "RAGCacheError",
        "SamplingConfig",
        "StreamChunk",
        "__version__",
        "quiet_vllm",
    ]
    for name in ragcache_core.__all__:
        assert getattr(ragcache_core, name) is not None, name


def test_langchain_exports() -> None:
    import ragcache_integrations.langchain as lc

    assert sorted(lc.__all__) == [
        "DocumentMemory",
        "EVENT_NAME",
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
    for name in lc.__all__:
        assert getattr(lc, name) is not None, name


def test_llama_index_exports() -> None:
    import ragcache_integrations.llama_index as li

    assert sorted(li.__all__) == [
        "OfflineEmbedding",
        "RAGCacheChatEngine",
        "RAGCacheQueryEngine",
        "UnsupportedFrameworkError",
        "as_chat_engine",
        "as_query_engine",
        "node_to_document",
        "prompt_config",
        "search_source",
    ]
    for name in li.__all__:
        assert getattr(li, name) is not None, name


def test_both_caches_implement_the_one_api() -> None:
    """`RAGCacheAPI` is the one declaration: both implementations subclass it, so a missing
    method is an error at class creation, not at a user's first call."""
    from ragcache_core import RAGCache, RAGCacheAPI, RAGCacheClient

    assert issubclass(RAGCache, RAGCacheAPI) and issubclass(RAGCacheClient, RAGCacheAPI)
    assert not RAGCacheAPI.__abstractmethods__ - {
        "_answer",
        "_query",
        "close",
        "invalidate",
        "stats",
    }
    assert not RAGCache.__abstractmethods__ and not RAGCacheClient.__abstractmethods__


# Lower numbers are lower layers. A module may import its own package and any lower layer.
LAYERS: dict[str, int] = {
    # shared types and helpers (the top of ragcache_core)
    **dict.fromkeys(
        ["errors", "documents", "query_result", "config", "plan", "capacity", "search", "loop"], 0
    ),
    **dict.fromkeys(["app_prompt"], 0),
    **dict.fromkeys(["api", "trace", "data"], 0),
    # the model makers (random-weight and fetched): folders for the engine, from the shared types
    "models": 0,
    # control plane and data plane below the runtime
    **dict.fromkeys(["policy", "cost", "storage", "retrieval"], 1),
    "tree": 2,
    **dict.fromkeys(["engine", "metrics"], 3),
    # the request path, and the client beside it
    **dict.fromkeys(["runtime", "client"], 4),
    # what runs over it
    **dict.fromkeys(["serve", "sim"], 5),
    "bench": 6,
    # The command line sits above everything it runs: `bench` measures, `cli` parses and
    # prints, and nothing below `cli` imports it (its `CliError` lives in `errors`).
    "cli": 7,
    **dict.fromkeys(["__init__", "__main__"], 8),
}


def _imports(path: Path) -> list[str]:
    """The `ragcache_core` modules that `path` imports: import statements, and the literal
    names passed to `importlib.import_module`, which a drawing of the imports would miss."""
    names = []
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names.append(node.module)
        elif isinstance(node, ast.Import):
            names.extend(alias.name for alias in node.names)
        elif (
            isinstance(node, ast.Call)
            and isinstance(node.func, ast.Attribute | ast.Name)
            and getattr(node.func, "attr", getattr(node.func, "id", "")) == "import_module"
        ):
            names.extend(
                arg.value
                for arg in node.args[:1]
                if isinstance(arg, ast.Constant) and isinstance(arg.value, str)
            )
    return [n for n in names if n.startswith("ragcache_core")]


def test_no_module_imports_a_layer_above_its_own() -> None:
    upward = []
    for path in sorted(PACKAGE.rglob("*.py")):
        me = path.relative_to(PACKAGE).with_suffix("").parts[0]
        assert me in LAYERS, f"{me} has no layer: add it to LAYERS"
        for module in _imports(path):
            other = module.split(".")[1] if "." in module else "__init__"
            if other != me and LAYERS[other] > LAYERS[me]:
                upward.append(f"{path.relative_to(PACKAGE)} imports {module}")
    assert not upward, "\n".join(upward)


def test_the_client_imports_only_httpx_and_the_shared_types() -> None:
    """`from ragcache_core import RAGCacheClient` in an app process loads no runtime, no numpy,
    no torch, no vLLM (checked in a fresh interpreter)."""
    code = (
        "import json, sys\n"
        "from ragcache_core import RAGCacheClient\n"
        "RAGCacheClient.__init__\n"
        "print(json.dumps(sorted(m for m in sys.modules)))\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=120
    )
    loaded = set(json.loads(out.stdout))
    assert "httpx" in loaded
    heavy = {"numpy", "torch", "vllm", "transformers", "faiss", "prometheus_client", "fastapi"}
    assert not heavy & loaded, heavy & loaded
    ours = {m for m in loaded if m.startswith("ragcache_core.")}
    allowed = {
        "ragcache_core.api",
        "ragcache_core.app_prompt",
        "ragcache_core.client",
        "ragcache_core.client.affinity",
        "ragcache_core.client.client",
        "ragcache_core.client.wire",
        "ragcache_core.config",
        "ragcache_core.documents",
        "ragcache_core.errors",
        "ragcache_core.loop",
        "ragcache_core.query_result",
        "ragcache_core.search",
    }
    assert ours <= allowed, ours - allowed


def _fake_api() -> Any:
    from ragcache_core import CacheConfig, RAGCacheAPI

    class Fake(RAGCacheAPI):
        config = CacheConfig()
        model = "fake"

        def stats(self) -> dict[str, Any]:
            return {}

        def invalidate(self, doc_id: str) -> int:
            return 0

        def close(self) -> None:
            return None

        async def _query(self, *args: Any) -> Any:
            raise NotImplementedError("not used here")

        async def _answer(self, *args: Any) -> Any:
            raise NotImplementedError("not used here")

    return Fake()


def test_the_answering_calls_take_their_keywords_from_one_declaration() -> None:
    """query, generate, stream and their async forms take the keywords of `AnswerOptions` /
    `QueryOptions` / `StreamOptions` (declared once in api.py): each keyword reaches the bodies
    as the spelled-out signatures passed it, left-out ones take their defaults, and an unknown
    keyword is Python's TypeError (its words), before anything runs."""
    import asyncio

    from ragcache_core import AppPrompt, CacheConfig, RAGCacheAPI, SamplingConfig
    from ragcache_core.api import ANSWER_KEYWORDS, QUERY_KEYWORDS, STREAM_KEYWORDS
    from ragcache_core.app_prompt import Framing
    from ragcache_core.documents import Document
    from ragcache_core.loop import LoopThread
    from ragcache_core.query_result import CacheHits, QueryResult

    calls: list[tuple[Any, ...]] = []

    def answer(text: str) -> QueryResult:
        return QueryResult(text, (1,), (), 0.0, 0.0, 0.0, CacheHits(), 1)

    class Recording(RAGCacheAPI):
        config = CacheConfig()
        model = "fake"
        _loop = LoopThread(owner="test")

        def stats(self) -> dict[str, Any]:
            return {}

        def invalidate(self, doc_id: str) -> int:
            return 0

        def close(self) -> None:
            self._loop.stop()

        async def _query(self, question: str, *args: Any) -> QueryResult:
            calls.append(("query", question, *args[:3], args[4]))
            return answer("q")

        async def _answer(self, question: str, *args: Any) -> QueryResult:
            calls.append(("answer", question, *args[:2], args[3]))
            return answer("a")

    assert {
        "sampling",
        "prompt",
        "cache_salt",
        "return_prompt",
        "document_order",
    } == ANSWER_KEYWORDS
    assert ANSWER_KEYWORDS | {"search", "top_k"} == QUERY_KEYWORDS
    assert QUERY_KEYWORDS | {"documents"} == STREAM_KEYWORDS
    sampling, app, docs = (
        SamplingConfig(max_tokens=3),
        AppPrompt(text="{context} {question}"),
        [Document("d", "text")],
    )
    framed = Framing(app, "tenant", True, "cache")
    every = {
        "sampling": sampling,
        "prompt": app,
        "cache_salt": "tenant",
        "return_prompt": True,
        "document_order": "cache",
    }
    with Recording() as cache:
        assert cache.query("q1", top_k=3, **every).answer == "q"
        assert asyncio.run(cache.aquery("q2")).answer == "q"
        assert cache.generate("g1", docs, **every).answer == "a"
        assert asyncio.run(cache.agenerate("g2", docs, sampling=sampling)).answer == "a"
        assert [c.delta for c in cache.stream("s1", documents=docs, cache_salt="tenant")] == [""]
        assert [c.result.answer for c in cache.stream("s2", top_k=1) if c.result] == ["q"]

        async def astream() -> list[Any]:
            return [c async for c in cache.astream("s3", search=None, **every)]

        assert asyncio.run(astream())[-1].result.answer == "q"
        assert calls == [
            ("query", "q1", None, 3, sampling, framed),
            ("query", "q2", None, None, None, Framing()),
            ("answer", "g1", docs, sampling, framed),
            ("answer", "g2", docs, sampling, Framing()),
            ("answer", "s1", docs, None, Framing(cache_salt="tenant")),
            ("query", "s2", None, 1, None, Framing()),
            ("query", "s3", None, None, sampling, framed),
        ]
        calls.clear()
        wrong = "RAGCacheAPI\\.a?[a-z]+\\(\\) got an unexpected keyword argument"
        for call in (
            lambda: cache.query("q", topk=3),
            lambda: cache.generate("q", docs, top_k=3),
            lambda: cache.stream("q", document=docs),
        ):
            with pytest.raises(TypeError, match=wrong):
                call()  # type: ignore[call-arg]

        async def first_chunk() -> Any:
            return await anext(cache.astream("q", salt="x"))  # type: ignore[call-arg]

        for awaited in (
            lambda: cache.aquery("q", k=1),
            lambda: cache.agenerate("q", docs, search=None),
            first_chunk,
        ):
            with pytest.raises(TypeError, match=wrong):
                asyncio.run(awaited())  # type: ignore[call-arg]
        assert calls == []


def test_the_langchain_llm_takes_cache_only() -> None:
    """`cache=` is the RAGCache; `ragcache=` (its old keyword, removed) does not give one."""
    from ragcache_integrations.langchain import RAGCacheLLM

    fake = _fake_api()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        llm = RAGCacheLLM(cache=fake)
    assert llm.ragcache is fake and llm.cache is None  # LangChain's own cache stays unset
    with pytest.raises(TypeError, match=r"RAGCacheLLM\(cache=\.\.\.\)"):
        RAGCacheLLM(ragcache=fake)
