"""A newcomer's first hour (issue 24): quiet terminals, clear lifecycle errors, wrong objects
named at once.

- Wrong objects (the usual mistakes with real LlamaIndex / LangChain objects) raise `TypeError`
  at construction, naming what was expected and what was given.
- A model name on a machine with no reachable hub: `ModelError` before transformers is asked.
- After `close()` every call raises `CacheClosedError` (the loop and the API, no engine).
- A script without `if __name__ == "__main__":`: one `MainGuardError`, no engine started.
- Child interpreters with the real engine: a forgotten `close()` closes at exit with no
  traceback and no resource-tracker warning, calls after it raise `CacheClosedError`, vLLM's
  lines are in the log file, not on the terminal. (`ragcache demo` prints a bounded number
  of lines: tests/test_demo.py, which shares its one demo run with issue 27's checks.)
"""

from __future__ import annotations

import asyncio
import gc
import json
import os
import subprocess
import sys
import textwrap
import threading
import warnings
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from _runs import EngineRuns

from ragcache_core import CacheClosedError, CacheConfig, Document, ModelError, RAGCacheAPI
from ragcache_core.loop import LoopThread

REPO = Path(__file__).resolve().parents[1]
TEXTS = [
    "Hamlet is a tragedy written by William Shakespeare.",
    "A Doll's House is a play by Henrik Ibsen.",
    "Faiss searches dense vectors quickly.",
    "Paris is the capital of France.",
]
# What vLLM's own lines look like on a terminal (its log format, its weight-loading bar).
VLLM_MARKS = ("(EngineCore", "(Worker", "(MainProcess", "Loading safetensors", "[core.py")
NOISE = ("Traceback", "Exception ignored", "resource_tracker", "leaked", "never awaited")


def _env(**extra: str) -> dict[str, str]:
    path = os.pathsep.join(p for p in (str(REPO), os.environ.get("PYTHONPATH", "")) if p)
    env = {k: v for k, v in os.environ.items() if k != "RAGCACHE_VLLM_LOG"}
    return {**env, "PYTHONPATH": path, **extra}


# ---------------------------------------------------------------------------- wrong objects


@pytest.fixture(scope="module")
def llama_objects() -> dict[str, Any]:
    import faiss
    from llama_index.core import StorageContext, VectorStoreIndex
    from llama_index.core.schema import TextNode
    from llama_index.vector_stores.faiss import FaissVectorStore

    from ragcache_core.retrieval.embedder import TfidfSvdEmbedder
    from ragcache_integrations.llama_index import OfflineEmbedding

    embed = OfflineEmbedding(TfidfSvdEmbedder.fit(TEXTS))
    store = FaissVectorStore(faiss_index=faiss.IndexFlatIP(len(embed.get_text_embedding("x"))))
    nodes = [TextNode(id_=f"d{i}", text=t) for i, t in enumerate(TEXTS)]
    storage = StorageContext.from_defaults(vector_store=store)
    index = VectorStoreIndex(nodes, storage_context=storage, embed_model=embed)
    return {"index": index, "store": store, "retriever": index.as_retriever()}


@pytest.fixture(scope="module")
def langchain_objects() -> dict[str, Any]:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        from langchain_community.vectorstores import FAISS

    from ragcache_core.retrieval.embedder import TfidfSvdEmbedder
    from ragcache_integrations.langchain import OfflineEmbeddings

    store = FAISS.from_texts(TEXTS, OfflineEmbeddings(TfidfSvdEmbedder.fit(TEXTS)))
    return {"store": store, "retriever": store.as_retriever()}


class _Cache(RAGCacheAPI):
    """A stand-in `RAGCacheAPI` for the arguments that must be right (isolates the check of
    the wrong one; nothing here answers a question)."""

    config = CacheConfig()
    model = "stand-in"

    def __init__(self) -> None:
        self._loop = LoopThread("test-api")

    def stats(self) -> dict[str, Any]:
        return self._loop.run(_value({"requests": 0}))

    def invalidate(self, doc_id: str) -> int:
        return self._loop.run(_value(0))

    def close(self) -> None:
        self._loop.stop()

    async def _query(self, *args: Any) -> Any:
        return await asyncio.sleep(3600)  # only ever cut short by close()

    async def _answer(self, *args: Any) -> Any:
        return await asyncio.sleep(3600)


async def _value(value: Any) -> Any:
    return value


@pytest.fixture
def stand_in() -> Iterator[_Cache]:
    cache = _Cache()
    yield cache
    cache.close()


def _llama_cases() -> list[tuple[str, Callable[[dict[str, Any], Any], Any], str, str]]:
    from ragcache_integrations.llama_index import RAGCacheQueryEngine, as_query_engine

    return [
        (
            "retriever as index",
            lambda o, c: as_query_engine(o["retriever"], cache=c),
            "expects a LlamaIndex VectorStoreIndex",
            "got VectorIndexRetriever",
        ),
        (
            "vector store as index",
            lambda o, c: as_query_engine(o["store"], cache=c),
            "expects a LlamaIndex VectorStoreIndex",
            "got FaissVectorStore",
        ),
        (
            "retriever as cache",
            lambda o, c: as_query_engine(o["index"], cache=o["retriever"]),
            "expects a RAGCache or a RAGCacheClient",
            "got VectorIndexRetriever",
        ),
        (
            "index as cache",
            lambda o, c: as_query_engine(o["index"], cache=o["index"]),
            "expects a RAGCache or a RAGCacheClient",
            "got VectorStoreIndex",
        ),
        (
            "index as retriever",
            lambda o, c: RAGCacheQueryEngine.from_retriever(o["index"], cache=c),
            "expects a LlamaIndex retriever",
            "got VectorStoreIndex",
        ),
    ]


def _langchain_cases() -> list[tuple[str, Callable[[dict[str, Any], Any], Any], str, str]]:
    from ragcache_integrations.langchain import RAGCacheLLM, RAGCacheRunnable

    return [
        (
            "retriever as store",
            lambda o, c: RAGCacheRunnable.from_vectorstore(o["retriever"], cache=c),
            "expects a LangChain VectorStore",
            "got VectorStoreRetriever",
        ),
        (
            "retriever as cache",
            lambda o, c: RAGCacheRunnable(cache=o["retriever"]),
            "expects a RAGCache or a RAGCacheClient",
            "got VectorStoreRetriever",
        ),
        (
            "store as cache",
            lambda o, c: RAGCacheRunnable(cache=o["store"]),
            "expects a RAGCache or a RAGCacheClient",
            "got FAISS",
        ),
        (
            "retriever as the LLM's cache",
            lambda o, c: RAGCacheLLM(cache=o["retriever"]),
            "RAGCacheLLM(cache=...) expects a RAGCache",
            "got VectorStoreRetriever",
        ),
    ]


@pytest.mark.parametrize("case", range(5))
def test_llama_index_wrong_objects_named_at_construction(
    case: int, llama_objects: dict[str, Any], stand_in: _Cache
) -> None:
    name, build, expected, given = _llama_cases()[case]
    with pytest.raises(TypeError) as caught:
        build(llama_objects, stand_in)
    assert expected in str(caught.value) and given in str(caught.value), name


@pytest.mark.parametrize("case", range(4))
def test_langchain_wrong_objects_named_at_construction(
    case: int, langchain_objects: dict[str, Any], stand_in: _Cache
) -> None:
    name, build, expected, given = _langchain_cases()[case]
    with pytest.raises(TypeError) as caught:
        build(langchain_objects, stand_in)
    assert expected in str(caught.value) and given in str(caught.value), name


def test_right_objects_still_build(
    llama_objects: dict[str, Any], langchain_objects: dict[str, Any], stand_in: _Cache
) -> None:
    from ragcache_integrations.langchain import RAGCacheLLM, RAGCacheRunnable
    from ragcache_integrations.llama_index import RAGCacheQueryEngine, as_query_engine

    assert as_query_engine(llama_objects["index"], cache=stand_in).cache is stand_in
    retriever = llama_objects["retriever"]
    assert RAGCacheQueryEngine.from_retriever(retriever, cache=stand_in).cache is stand_in
    store = langchain_objects["store"]
    assert RAGCacheRunnable.from_vectorstore(store, cache=stand_in).cache is stand_in
    assert RAGCacheLLM(cache=stand_in).ragcache is stand_in


def test_ragcache_arguments_named_before_anything_starts() -> None:
    from ragcache_core import RAGCache

    with pytest.raises(TypeError, match="RAGCache\\(model, config\\) expects a ragcache_core"):
        RAGCache("/no/such/model", {"top_k": 2})  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="got CacheConfig"):
        RAGCache(CacheConfig())  # type: ignore[arg-type]


# ---------------------------------------------------------------------------- model names


@pytest.fixture
def no_tokenizer_calls(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """An empty Hugging Face cache, and transformers' loader failing the test if asked: the
    check must decide before transformers starts its retries."""
    import transformers

    def refuse(*args: Any, **kwargs: Any) -> Any:
        raise AssertionError("transformers was asked to resolve the model name")

    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hub"))
    monkeypatch.setattr(transformers.AutoTokenizer, "from_pretrained", refuse)


def test_model_name_with_an_unreachable_hub_is_a_model_error(
    monkeypatch: pytest.MonkeyPatch, no_tokenizer_calls: None
) -> None:
    from ragcache_core import RAGCache

    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    monkeypatch.setenv("HF_ENDPOINT", "http://127.0.0.1:9")  # the discard port: refused
    for name in ("no_proxy", "NO_PROXY"):  # reached directly, even where a proxy is set
        monkeypatch.setenv(name, "127.0.0.1")
    with pytest.raises(ModelError, match=r"not a local folder.*cannot be reached"):
        RAGCache("nobody/no-such-model")


def test_model_name_offline_is_a_model_error(
    monkeypatch: pytest.MonkeyPatch, no_tokenizer_calls: None
) -> None:
    from ragcache_core import RAGCache

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    with pytest.raises(ModelError, match="not a local folder and HF_HUB_OFFLINE is set"):
        RAGCache("nobody/no-such-model")


# ---------------------------------------------------------------------------- after close()


def test_every_call_after_close_raises_cache_closed_error(stand_in: _Cache) -> None:
    stand_in.close()
    calls: dict[str, Callable[[], Any]] = {
        "query": lambda: stand_in.query("q"),
        "generate": lambda: stand_in.generate("q", [Document("d", "t")]),
        "stream": lambda: list(stand_in.stream("q")),
        "stats": stand_in.stats,
        "invalidate": lambda: stand_in.invalidate("d"),
        "aquery": lambda: asyncio.run(stand_in.aquery("q")),
        "agenerate": lambda: asyncio.run(stand_in.agenerate("q", [Document("d", "t")])),
        "astream": lambda: asyncio.run(_drain(stand_in.astream("q"))),
    }
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        raised = {name: _error_of(call) for name, call in calls.items()}
        gc.collect()  # an unawaited coroutine warns when it is collected
    closed = "CacheClosedError: this RAGCache is closed"
    assert all(error.startswith(closed) for error in raised.values()), raised
    assert not [w for w in seen if "never awaited" in str(w.message)]
    stand_in.close()  # twice is fine


def _error_of(call: Callable[[], Any]) -> str:
    try:
        call()
    except Exception as exc:
        return f"{type(exc).__name__}: {exc}"
    return "no error"


async def _drain(chunks: Any) -> list[Any]:
    return [chunk async for chunk in chunks]


def test_a_call_cut_short_by_close_raises_cache_closed_error() -> None:
    """What `RAGCache.close` does to calls still running (it cancels their tasks)."""
    loop = LoopThread("test-cut", owner="RAGCacheClient")
    started = threading.Event()

    async def long_call() -> None:
        started.set()
        await asyncio.sleep(3600)

    async def cancel_the_others() -> None:
        for task in asyncio.all_tasks():
            if task is not asyncio.current_task():
                task.cancel()

    outcome: list[BaseException] = []

    def call() -> None:
        try:
            loop.run(long_call())
        except BaseException as exc:
            outcome.append(exc)

    caller = threading.Thread(target=call)
    caller.start()
    assert started.wait(10)
    loop.stop(cancel_the_others())
    caller.join(10)
    assert len(outcome) == 1 and isinstance(outcome[0], CacheClosedError), outcome
    assert "RAGCacheClient was closed while this call ran" in str(outcome[0])


# ---------------------------------------------------------------------------- vLLM's output


@pytest.fixture
def vllm_logging() -> Iterator[None]:
    """The process state `quiet_vllm` changes, restored afterwards: three environment
    variables (by hand: monkeypatch does not restore a variable that was absent) and the
    `vllm` logger."""
    import logging

    names = ("RAGCACHE_VLLM_LOG", "VLLM_LOGGING_CONFIG_PATH", "VLLM_CONFIGURE_LOGGING")
    env = {name: os.environ.pop(name, None) for name in names}
    logger = logging.getLogger("vllm")
    saved = (list(logger.handlers), logger.level, logger.propagate)
    yield
    for name, value in env.items():
        if value is None:
            os.environ.pop(name, None)
        else:
            os.environ[name] = value
    for handler in list(logger.handlers):
        logger.removeHandler(handler)
        if handler not in saved[0]:
            handler.close()
    for handler in saved[0]:
        logger.addHandler(handler)
    logger.setLevel(saved[1])
    logger.propagate = saved[2]


def test_quiet_vllm_files_the_logger_and_the_engine_processes_output(
    tmp_path: Path, vllm_logging: None, capfd: pytest.CaptureFixture[str]
) -> None:
    import logging

    from ragcache_core import quiet_vllm
    from ragcache_core.engine.logs import engine_output

    log = quiet_vllm(tmp_path / "logs" / "vllm.log")
    assert log == (tmp_path / "logs" / "vllm.log") and log.read_text() == ""
    assert os.environ["RAGCACHE_VLLM_LOG"] == str(log)
    config = json.loads(Path(os.environ["VLLM_LOGGING_CONFIG_PATH"]).read_text())
    assert config["handlers"]["ragcache_vllm_file"]["filename"] == str(log)  # vLLM's processes
    logging.getLogger("vllm.engine").warning("from the vllm logger")
    with engine_output():  # what vLLM's engine processes inherit while an engine starts
        subprocess.run(
            [sys.executable, "-c", "import sys; print('child out'); sys.stderr.write('child err')"],
            check=True,
        )
    print("after the start")
    terminal = capfd.readouterr()
    text = log.read_text()
    assert "from the vllm logger" in text and "child out" in text and "child err" in text
    assert "child" not in terminal.out + terminal.err and "from the vllm" not in terminal.err
    assert "after the start" in terminal.out  # fds 1 and 2 are back


def test_verbose_leaves_vllm_on_the_terminal(
    tmp_path: Path, vllm_logging: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    """`ragcache demo` / `doctor` file vLLM's lines unless `--verbose` (or `ragcache -v`)."""
    import argparse
    import io

    from ragcache_core.cli.output import vllm_log

    monkeypatch.setenv("RAGCACHE_HOME", str(tmp_path))
    said = io.StringIO()
    quiet = vllm_log(argparse.Namespace(show_vllm=False, verbose=False), "demo", said)
    assert quiet == tmp_path / "logs" / "demo.log"
    assert said.getvalue() == f"vLLM's log: {quiet} (--verbose shows it here)\n"
    for flags in ({"show_vllm": True, "verbose": False}, {"show_vllm": False, "verbose": True}):
        assert vllm_log(argparse.Namespace(**flags), "demo", said) is None
        assert "RAGCACHE_VLLM_LOG" not in os.environ


# ---------------------------------------------------------------------------- __main__ guard


def test_a_script_without_the_main_guard_gets_one_message(tmp_path: Path, tiny_model: Path) -> None:
    script = tmp_path / "unguarded.py"
    script.write_text(
        "from ragcache_core import RAGCache\n\n"
        f"cache = RAGCache({str(tiny_model)!r})\n"
        "print(cache.query('Who wrote Hamlet?'))\n"
    )
    done = subprocess.run(
        [sys.executable, str(script)],
        capture_output=True,
        text=True,
        env=_env(),
        cwd=tmp_path,
        timeout=300,
    )
    assert done.returncode == 1
    assert done.stderr.count("MainGuardError:") == 1, done.stderr[-3000:]
    assert f"line 3 of {script}" in done.stderr
    assert 'if __name__ == "__main__":' in done.stderr
    assert "bootstrapping phase" not in done.stderr
    assert "Engine core initialization failed" not in done.stderr


# ---------------------------------------------------------------------------- real engine

FORGOTTEN = """
import atexit, json, sys

from ragcache_core import CacheConfig, Document, RAGCache, quiet_vllm
from ragcache_core.config import SamplingConfig

DOCS = [Document("d1", "Hamlet is a tragedy written by William Shakespeare.")]


def after_exit_close(box):
    # Registered before the cache, so atexit runs it after the cache's own exit close.
    cache = box[0]
    calls = {
        "generate": lambda: cache.generate("Who wrote Hamlet?", DOCS),
        "query": lambda: cache.query("Who wrote Hamlet?"),
        "stream": lambda: list(cache.stream("Who wrote Hamlet?", documents=DOCS)),
        "stats": cache.stats,
        "invalidate": lambda: cache.invalidate("d1"),
    }
    seen = {}
    for name, call in calls.items():
        try:
            call()
            seen[name] = "no error"
        except Exception as exc:
            seen[name] = f"{type(exc).__name__}: {exc}"
    print("AFTER " + json.dumps(seen), flush=True)


if __name__ == "__main__":
    box = []
    atexit.register(after_exit_close, box)
    print("LOG " + str(quiet_vllm(sys.argv[2])), flush=True)
    config = CacheConfig(
        host_pool_tokens=2048, sampling=SamplingConfig(max_tokens=4)
    )
    box.append(RAGCache(sys.argv[1], config))
    result = box[0].generate("Who wrote Hamlet?", DOCS)
    print("ANSWER " + json.dumps(list(result.token_ids)), flush=True)
    # no close(): the program ends here
"""


def _forgotten(model: Path, folder: Path) -> tuple[subprocess.CompletedProcess[str], Path]:
    script = folder / "forgotten.py"
    script.write_text(textwrap.dedent(FORGOTTEN))
    log = folder / "vllm.log"
    done = subprocess.run(
        [sys.executable, str(script), str(model), str(log)],
        capture_output=True,
        text=True,
        env=_env(),
        cwd=folder,
        timeout=400,
    )
    return done, log


def runners(model: Path) -> dict[str, Callable[[Path], Any]]:
    """The forgotten-close script runs with the suite's other engine runs (`_runs`)."""
    return {
        "test_a_forgotten_close_closes_at_exit_quietly": lambda folder: _forgotten(model, folder)
    }


@pytest.mark.vllm
def test_a_forgotten_close_closes_at_exit_quietly(
    request: pytest.FixtureRequest, engine_runs: EngineRuns
) -> None:
    done, log = engine_runs.result(request)
    output = done.stdout + done.stderr
    assert done.returncode == 0, output[-3000:]
    assert "ANSWER [" in done.stdout
    for noise in NOISE:
        assert noise not in output, f"{noise!r} in:\n{output[-3000:]}"
    for mark in VLLM_MARKS:
        assert mark not in output, f"vLLM's {mark!r} on the terminal:\n{output[-3000:]}"
    assert f"LOG {log}" in done.stdout
    text = log.read_text()
    assert "EngineCore" in text and "Worker" in text  # its processes wrote there
    assert "shutdown" in text  # ... until the exit close
    after = json.loads(done.stdout.split("AFTER ", 1)[1].splitlines()[0])
    assert set(after) == {"generate", "query", "stream", "stats", "invalidate"}
    for name, error in after.items():
        assert error.startswith("CacheClosedError: this RAGCache is closed"), (name, error)
