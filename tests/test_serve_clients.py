"""`RAGCacheClient` against a real `ragcache serve` process, alone and inside the two framework
integrations (real llama-index-core and langchain-core), end to end.

Reference for exactness: the same server's uncached path (`/v1/completions` with the prompt's
token ids and no documents: plain vLLM, no plan) on the ids a local `PromptBuilder` builds
for the same question and documents with the server's own prompt settings.
"""

from __future__ import annotations

import asyncio
import warnings
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import faiss
import numpy as np
import pytest
from _integration_helpers import corpus, questions
from _serve_helpers import ServerProcess, assert_idle, started
from langchain_core.documents import Document as LCDocument
from langchain_core.output_parsers import StrOutputParser
from langchain_core.prompts import PromptTemplate
from langchain_core.runnables import RunnablePassthrough
from llama_index.core import StorageContext, VectorStoreIndex
from llama_index.core.schema import TextNode
from llama_index.vector_stores.faiss import FaissVectorStore

from ragcache_core.api import RAGCacheAPI
from ragcache_core.app_prompt import AppPrompt
from ragcache_core.client.client import RAGCacheClient, RemoteError
from ragcache_core.config import SamplingConfig
from ragcache_core.documents import Document
from ragcache_core.errors import InputError, RAGCacheError
from ragcache_core.retrieval.embedder import TfidfSvdEmbedder
from ragcache_core.search import final_result
from ragcache_integrations.langchain import OfflineEmbeddings, RAGCacheLLM, RAGCacheRunnable
from ragcache_integrations.llama_index import OfflineEmbedding, as_query_engine, node_to_document

with warnings.catch_warnings():
    warnings.simplefilter("ignore", DeprecationWarning)  # "langchain-community is being sunset"
    from langchain_community.vectorstores import FAISS

pytestmark = pytest.mark.vllm

KEY = "client-key"
GREEDY = SamplingConfig(max_tokens=8)
DOCS = corpus(60)
QUESTIONS = questions(12)
ARGS = ["--host-pool-tokens", "8192", "--top-k", "2"]
ARGS += ["--max-tokens", "8"]


@pytest.fixture(scope="module")
def index_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from ragcache_core.retrieval.index_store import IndexSettings, build_index

    folder = tmp_path_factory.mktemp("client-index")
    settings = IndexSettings(kind="ivf", nlist=8, nprobe=4, lists_per_stage=2)
    build_index(list(DOCS), settings, progress=False).save(folder)
    return folder


@pytest.fixture(scope="module")
def server(
    tiny_model: Path, index_dir: Path, engine_pool: Any, tmp_path_factory: Any
) -> Iterator[ServerProcess]:
    engine_pool.close()  # one engine at a time
    log = tmp_path_factory.mktemp("client-log") / "server.log"
    yield from started(tiny_model, [*ARGS, "--index", str(index_dir)], log, api_key=KEY)


@pytest.fixture(scope="module")
def client(server: ServerProcess) -> Iterator[RAGCacheClient]:
    with RAGCacheClient(server.url, api_key=KEY) as instance:
        yield instance


@pytest.fixture(autouse=True)
def nothing_leaks(request: pytest.FixtureRequest) -> Iterator[None]:
    yield
    if "server" in request.fixturenames:
        assert_idle(request.getfixturevalue("server"))


@pytest.fixture(scope="module")
def plain(server: ServerProcess, client: RAGCacheClient, tiny_model: Path) -> Any:
    """question, documents -> plain vLLM's token ids for the prompt the cache would build."""
    from transformers import AutoTokenizer

    from ragcache_core.runtime.prompt import PromptBuilder

    tokenizer = AutoTokenizer.from_pretrained(tiny_model)
    config = client.config
    builder = PromptBuilder(tokenizer, config.prompt, client.model, config.dtype or "")

    def run(question: str, documents: Sequence[Document], prompt: Any = None) -> tuple[int, ...]:
        ids = builder.build(question, documents, prompt).token_ids
        body = {"prompt": ids, "max_tokens": 8, "temperature": 0, "return_token_ids": True}
        with server.client() as http:
            data = http.post("/v1/completions", json=body).json()
        assert data["ragcache"]["cached"] is False
        return tuple(data["choices"][0]["token_ids"])

    return run


# ---------------------------------------------------------------------- the client alone


def test_the_client_satisfies_the_protocol_and_reads_the_server(
    server: ServerProcess, client: RAGCacheClient
) -> None:
    assert isinstance(client, RAGCacheAPI)
    assert client.config.top_k == 2 and client.config.host_pool_tokens == 8192
    assert client.config.sampling.max_tokens == 8
    assert client.model.endswith("tiny-mha") and client.has_index
    with pytest.raises(RemoteError) as wrong:
        RAGCacheClient(server.url, api_key="wrong")
    assert wrong.value.status == 401
    with pytest.raises(RAGCacheError, match="cannot reach"):
        RAGCacheClient("http://127.0.0.1:9", api_key=KEY)


def test_generate_equals_plain_vllm_and_repeats_hit(client: RAGCacheClient, plain: Any) -> None:
    docs = (DOCS[0], DOCS[1])
    first = client.generate(QUESTIONS[0], docs, sampling=GREEDY)
    assert first.token_ids == plain(QUESTIONS[0], docs)
    assert first.hits.computed_docs == 2
    assert [d.id for d in first.sources] == [d.id for d in docs]
    again = asyncio.run(client.agenerate(QUESTIONS[0], docs, sampling=GREEDY))
    assert again.hits.gpu_docs == 2 and again.token_ids == first.token_ids
    assert again.ttft_s > 0 and again.prompt_tokens == first.prompt_tokens


def test_cache_document_order_over_the_wire(
    server: ServerProcess, client: RAGCacheClient, plain: Any
) -> None:
    """Issue 40 through `ragcache serve`: the request field reorders the documents sent, the
    result lists them as served (exact against plain vLLM on those ids), and the OpenAI
    route's `ragcache` report too."""
    docs = (DOCS[40], DOCS[41])
    client.generate(QUESTIONS[5], docs, sampling=GREEDY)  # stores d40 -> d41
    swapped = (docs[1], docs[0])
    served = client.generate(QUESTIONS[6], swapped, sampling=GREEDY, document_order="cache")
    assert [d.id for d in served.sources] == [d.id for d in docs]
    assert served.retrieval_ranks == (1, 0) and served.hits.hit_docs == 2
    assert served.token_ids == plain(QUESTIONS[6], docs)
    kept = client.generate(QUESTIONS[6], swapped, sampling=GREEDY)
    assert [d.id for d in kept.sources] == [d.id for d in swapped]

    def chat(documents: tuple[Document, ...], **extra: Any) -> dict[str, Any]:
        sent = [{"id": d.id, "text": d.text, "metadata": dict(d.metadata)} for d in documents]
        body = {"messages": [{"role": "user", "content": QUESTIONS[7]}], "documents": sent}
        return {**body, "max_tokens": 4, **extra}

    # Other documents: both orders of d40 and d41 are cached now (a tie goes by rank).
    other = (DOCS[42], DOCS[43])
    with server.client() as http:
        assert http.post("/v1/chat/completions", json=chat(other)).status_code == 200
        answer = http.post("/v1/chat/completions", json=chat(other[::-1], document_order="cache"))
        report = answer.json()["ragcache"]
        assert report["documents"] == [d.id for d in other]
        assert report["retrieval_ranks"] == [1, 0]
        wrong = http.post("/v1/rag/query", json={"question": "q", "document_order": "best"})
        assert wrong.status_code == 400


def test_stream_and_astream_and_an_early_close_aborts(
    server: ServerProcess, client: RAGCacheClient
) -> None:
    docs = (DOCS[2], DOCS[3])
    whole = client.generate(QUESTIONS[1], docs, sampling=GREEDY)
    chunks = list(client.stream(QUESTIONS[1], documents=docs, sampling=GREEDY))
    assert "".join(c.delta for c in chunks) == whole.answer
    assert chunks[-1].result is not None and chunks[-1].result.token_ids == whole.token_ids

    async def collect() -> list[Any]:
        return [c async for c in client.astream(QUESTIONS[1], documents=docs, sampling=GREEDY)]

    assert "".join(c.delta for c in asyncio.run(collect())) == whole.answer

    before = server.stats()["requests"]
    long = SamplingConfig(max_tokens=3000, ignore_eos=True)
    stream = client.stream(QUESTIONS[1], documents=docs, sampling=long)
    assert next(stream).delta
    stream.close()  # type: ignore[attr-defined]
    assert assert_idle(server)["requests"] == before  # aborted on the server


def test_query_searches_the_server_index_or_a_local_source(
    client: RAGCacheClient, index_dir: Path
) -> None:
    from ragcache_core.retrieval.index_store import LocalIndex

    remote = client.query(QUESTIONS[2], sampling=GREEDY)
    assert len(remote.sources) == 2 and remote.retrieval_s > 0
    source = LocalIndex.load(index_dir).source()  # the same index, searched here
    local = client.query(QUESTIONS[2], search=source, sampling=GREEDY)
    final = final_result(source, QUESTIONS[2], 2)
    assert [d.id for d in local.sources] == list(final.doc_ids) == [d.id for d in remote.sources]
    assert local.scores == pytest.approx(final.scores)
    assert local.token_ids == remote.token_ids
    assert local.hits.gpu_docs == 2  # the remote query cached them
    assert local.ttft_s >= local.retrieval_s > 0


def test_stats_and_invalidate(client: RAGCacheClient) -> None:
    # Ids no other test uses: what invalidation removes depends only on this test.
    docs = (Document("only-here-a", DOCS[4].text), Document("only-here-b", DOCS[5].text))
    client.generate(QUESTIONS[3], docs, sampling=GREEDY)
    stats = client.stats()
    assert stats["requests"] >= 1 and stats["tree"]["nodes"] >= 3
    assert stats["serve"]["capacity"] == 16 + 64
    assert client.invalidate("only-here-a") == 2  # the node and the one computed after it
    # The document changed under its id (at its start): its new text is computed, and so is
    # the one after it (vLLM's blocks of the old text never match the new token ids; an edit
    # at its end would leave its unchanged blocks matching, exactly).
    edited = (Document("only-here-a", "Edited. " + DOCS[4].text), docs[1])
    assert client.generate(QUESTIONS[3], edited, sampling=GREEDY).hits.computed_docs == 2


def test_bad_input_raises_input_error(server: ServerProcess, client: RAGCacheClient) -> None:
    with pytest.raises(InputError, match="empty"):
        client.generate("   ", [DOCS[0]])
    with pytest.raises(InputError, match="Document"):
        client.generate("q", ["not a document"])  # type: ignore[list-item]
    with pytest.raises(InputError, match="document 'e' has no text"):
        client.generate("q", [DOCS[0], Document("e", "")])  # refused before it is sent
    with server.client() as http:
        body = {"question": "q", "documents": [{"id": "e", "text": "  "}]}
        refused = http.post("/v1/rag/query", json=body)
    assert refused.status_code == 400 and "'e' has no text" in refused.text  # the server's own
    with pytest.raises(InputError, match="fit"):
        client.generate("q", [Document("big", "word " * 5000)])
    with pytest.raises(InputError, match="max_tokens"):
        client.generate("q", [DOCS[0]], sampling=SamplingConfig(max_tokens=5000))


# ---------------------------------------------------------------------- LlamaIndex


@pytest.fixture(scope="module")
def ivf_index() -> VectorStoreIndex:
    embed_model = OfflineEmbedding(TfidfSvdEmbedder.fit([d.text for d in DOCS]))
    vectors = np.asarray(embed_model.get_text_embedding_batch([d.text for d in DOCS]), "float32")
    dim = vectors.shape[1]
    ivf = faiss.IndexIVFFlat(faiss.IndexFlatIP(dim), dim, 4, faiss.METRIC_INNER_PRODUCT)
    ivf.train(vectors)
    ivf.nprobe = 2
    nodes = [TextNode(id_=d.id, text=d.text, metadata={"title": d.title}) for d in DOCS]
    storage = StorageContext.from_defaults(vector_store=FaissVectorStore(faiss_index=ivf))
    return VectorStoreIndex(nodes, storage_context=storage, embed_model=embed_model)


def test_llama_index_query_engine_through_the_client(
    client: RAGCacheClient, ivf_index: VectorStoreIndex, plain: Any
) -> None:
    engine = as_query_engine(ivf_index, cache=client, sampling=GREEDY)
    question = QUESTIONS[4]
    response = engine.query(question)
    own = ivf_index.as_retriever(similarity_top_k=2).retrieve(question)
    assert [n.node.node_id for n in response.source_nodes] == [h.node.node_id for h in own]
    assert [n.score for n in response.source_nodes] == pytest.approx([h.score for h in own])
    documents = tuple(node_to_document(n.node) for n in response.source_nodes)
    # The engine's prompt (LlamaIndex's own) travelled to the server with the documents.
    assert tuple(response.metadata["token_ids"]) == plain(question, documents, engine.app_prompt)
    again = asyncio.run(engine.aquery(question))
    assert again.metadata["cache_hits"]["gpu_docs"] == 2
    assert again.response == response.response

    streaming = as_query_engine(ivf_index, cache=client, sampling=GREEDY, streaming=True)
    streamed = streaming.query(question)
    assert "".join(streamed.response_gen) == response.response
    assert streamed.metadata["token_ids"] == response.metadata["token_ids"]


# ---------------------------------------------------------------------- LangChain


@pytest.fixture(scope="module")
def store() -> FAISS:
    embeddings = OfflineEmbeddings(TfidfSvdEmbedder.fit([d.text for d in DOCS]))
    lc_docs = [LCDocument(page_content=d.text, metadata={"title": d.title}) for d in DOCS]
    return FAISS.from_documents(lc_docs, embeddings, ids=[d.id for d in DOCS])


def test_langchain_runnable_through_the_client(
    client: RAGCacheClient, store: FAISS, plain: Any
) -> None:
    from ragcache_integrations.langchain import to_ragcache

    retriever = store.as_retriever(search_kwargs={"k": 2})
    chain = (
        {"context": retriever, "question": RunnablePassthrough()}
        | RAGCacheRunnable(cache=client, sampling=GREEDY)
        | StrOutputParser()
    )
    question = QUESTIONS[5]
    answer = chain.invoke(question)
    documents = tuple(to_ragcache(d) for d in retriever.invoke(question))
    result = client.generate(question, documents, sampling=GREEDY)
    assert answer == result.answer and result.hits.gpu_docs == 2  # the chain cached them
    assert result.token_ids == plain(question, documents)
    assert "".join(chain.stream(question)) == answer
    assert asyncio.run(chain.ainvoke(question)) == answer

    searching = RAGCacheRunnable.from_vectorstore(store, cache=client, k=2, sampling=GREEDY)
    assert searching.invoke(question) == answer  # searched here, the same documents


def test_langchain_llm_through_the_client(client: RAGCacheClient, store: FAISS, plain: Any) -> None:
    llm = RAGCacheLLM(cache=client, sampling=GREEDY)
    retriever = store.as_retriever(search_kwargs={"k": 2})
    prompt = PromptTemplate.from_template("{context}\n\nQuestion: {question}\nAnswer:")

    def format_docs(docs: list[LCDocument]) -> str:
        return "\n\n".join(d.page_content for d in docs)

    context = {"context": llm.watch(retriever) | format_docs, "question": RunnablePassthrough()}
    question = QUESTIONS[6]
    answer = (context | prompt | llm | StrOutputParser()).invoke(question)
    rendered = (context | prompt).invoke(question).to_string()
    found = llm.memory.find(rendered)
    assert len(found) == 2
    exact = AppPrompt(text=rendered, chat=False)  # the text exactly as LangChain rendered it
    expected = plain(question, found, exact)
    again = client.generate(question, found, sampling=GREEDY, prompt=exact)
    assert again.token_ids == expected and answer == again.answer
    assert again.hits.gpu_docs == 2  # the chain's call cached both documents on the server


def test_langchain_chat_model_and_llm_runs_through_the_client(
    client: RAGCacheClient, store: FAISS, plain: Any, tiny_model: Path
) -> None:
    """RAGCacheChatModel on a RAGCacheClient: the messages' ids (the chat template's) are
    answered as plain vLLM answers them, the watched retriever's documents hit on a repeat;
    the Runnable's LLM run carries the prompt the server rendered (`return_prompt` over the
    wire)."""
    from langchain_core.callbacks import BaseCallbackHandler
    from langchain_core.prompts import ChatPromptTemplate
    from transformers import AutoTokenizer

    from ragcache_integrations.langchain import RAGCacheChatModel

    prompt = ChatPromptTemplate.from_messages(
        [("system", "Answer from the context.\n\n{context}"), ("human", "{question}")]
    )
    llm = RAGCacheChatModel(cache=client, sampling=GREEDY)
    retriever = llm.watch(store.as_retriever(search_kwargs={"k": 2}))

    def format_docs(docs: list[LCDocument]) -> str:
        return "\n\n".join(d.page_content for d in docs)

    chain = {"context": retriever | format_docs, "question": RunnablePassthrough()} | prompt | llm
    question = QUESTIONS[7]
    first = chain.invoke(question)
    again = chain.invoke(question)
    docs = store.similarity_search(question, k=2)
    messages = prompt.format_messages(context=format_docs(docs), question=question)
    roles = {"system": "system", "human": "user"}
    dicts = tuple({"role": roles[m.type], "content": str(m.content)} for m in messages)
    found = tuple(
        Document(d.id, d.text, d.metadata, prompt_text=d.text)
        for d in (to_ragcache_doc(x) for x in docs)
    )
    expected = plain(question, found, AppPrompt(messages=dicts))
    assert tuple(first.response_metadata["ragcache"]["token_ids"]) == expected
    assert again.content == first.content
    assert again.usage_metadata["input_token_details"]["cache_read"] > 0
    hits = again.response_metadata["ragcache"]["cache_hits"]
    assert hits["gpu_docs"] + hits["host_docs"] == 2  # both documents read, not computed

    class Prompts(BaseCallbackHandler):
        def __init__(self) -> None:
            self.prompts: list[str] = []

        def on_llm_start(self, serialized: Any, prompts: list[str], **kwargs: Any) -> None:
            self.prompts.extend(prompts)

    runnable = RAGCacheRunnable(cache=client, sampling=GREEDY, prompt=prompt)
    seen = Prompts()
    (
        {"context": store.as_retriever(search_kwargs={"k": 2}), "question": RunnablePassthrough()}
        | runnable
    ).invoke(question, config={"callbacks": [seen]})
    tokenizer = AutoTokenizer.from_pretrained(tiny_model)
    text = tokenizer.apply_chat_template(list(dicts), tokenize=False, add_generation_prompt=True)
    assert seen.prompts == [text]


def to_ragcache_doc(doc: LCDocument) -> Document:
    from ragcache_integrations.langchain import to_ragcache

    return to_ragcache(doc)
