"""Our own document index: corpus + offline embedder + Faiss index, saved and loaded together.

A saved index is a folder:

    manifest.json    format, kind, settings, document count, dimension, build times
    index.faiss      the Faiss index (row i = documents.jsonl line i)
    embedder.json    TF-IDF vocabulary and config  } the offline embedder (see embedder.py)
    embedder.npz     idf weights, SVD components   }
    documents.jsonl  {"id", "text", "metadata"} per row

Vectors are unit-norm, the metric is the inner product (cosine similarity). What is embedded is
the title and the text ("{title}\n{text}"); what the prompt shows is `render_document`.
"""

from __future__ import annotations

import json
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Literal, TypeVar

import numpy as np
import numpy.typing as npt

from ragcache_core.documents import Document
from ragcache_core.errors import ConfigError, InputError
from ragcache_core.retrieval.base import StagedSearch
from ragcache_core.retrieval.embedder import Embedder, EmbedderConfig, TfidfSvdEmbedder
from ragcache_core.retrieval.flat import staged_search_for
from ragcache_core.retrieval.ivf import ListsPerStage, StageSizing, default_nlist
from ragcache_core.retrieval.source import StagedSource

IndexKind = Literal["ivf", "hnsw", "flat"]
INDEX_KINDS: tuple[IndexKind, ...] = ("ivf", "hnsw", "flat")
_FORMAT = "ragcache-index/1"
_BATCH = 1024
SettingsT = TypeVar("SettingsT")


@dataclass(frozen=True)
class IndexSettings:
    """How to build (and by default search) an index. `nlist=None`: about 4 x sqrt(N)."""

    kind: IndexKind = "ivf"
    nlist: int | None = None
    nprobe: int = 32
    lists_per_stage: int = 4
    hnsw_m: int = 32
    ef_construction: int = 80
    ef_search: int = 128
    embedder: EmbedderConfig = field(default_factory=EmbedderConfig)

    def __post_init__(self) -> None:
        if self.kind not in INDEX_KINDS:
            raise ConfigError(f"index kind must be one of {INDEX_KINDS}, got {self.kind!r}")
        numbers = (self.nprobe, self.lists_per_stage, self.hnsw_m, self.ef_construction)
        if min(numbers) < 1 or self.ef_search < 1 or (self.nlist is not None and self.nlist < 1):
            raise ConfigError(f"index settings must be positive: {self}")


@dataclass(frozen=True)
class BuildTimes:
    """Wall seconds of each build step."""

    fit_embedder_s: float
    embed_s: float
    train_s: float
    add_s: float

    @property
    def total_s(self) -> float:
        return self.fit_embedder_s + self.embed_s + self.train_s + self.add_s


def embedding_text(doc: Document) -> str:
    """The text embedded for a document: its title (when any) and its text."""
    return f"{doc.title}\n{doc.text}" if doc.title else doc.text


class LocalIndex:
    """A built or loaded index. Read-only: searching never mutates it; safe to share by threads."""

    def __init__(
        self,
        documents: Sequence[Document],
        embedder: Embedder,
        faiss_index: Any,
        settings: IndexSettings,
        times: BuildTimes,
    ) -> None:
        if faiss_index.ntotal != len(documents):
            raise InputError(
                f"index holds {faiss_index.ntotal} vectors but {len(documents)} documents"
            )
        self.documents = tuple(documents)
        self.embedder = embedder
        self.faiss_index = faiss_index
        self.settings = settings
        self.times = times
        self._row_of = {d.id: i for i, d in enumerate(self.documents)}

    @property
    def nlist(self) -> int:
        return int(getattr(self.faiss_index, "nlist", 0))

    def row_of(self, doc_id: str) -> int:
        """Row of a document id; raises `InputError` for an unknown id."""
        try:
            return self._row_of[doc_id]
        except KeyError:
            raise InputError(f"unknown document id {doc_id!r}") from None

    def documents_for(self, rows: Sequence[int]) -> list[Document]:
        return [self.documents[r] for r in rows]

    def staged(
        self,
        *,
        nprobe: int | None = None,
        sizing: StageSizing | None = None,
        ef_search: int | None = None,
    ) -> StagedSearch:
        """A staged search over this index (defaults from the build settings)."""
        s = self.settings
        return staged_search_for(
            self.faiss_index,
            nprobe=s.nprobe if nprobe is None else nprobe,
            sizing=sizing or ListsPerStage(s.lists_per_stage),
            ef_search=s.ef_search if ef_search is None else ef_search,
        )

    def source(self, staged: StagedSearch | None = None) -> StagedSource:
        """A `SearchSource` (question -> documents, stage by stage) over this index."""
        return StagedSource(self.embedder.embed_query, staged or self.staged(), self.documents_for)

    def save(self, folder: Path | str) -> None:
        """Write the index folder (created if needed; existing files are replaced)."""

        if not isinstance(self.embedder, TfidfSvdEmbedder):
            raise NotImplementedError(
                f"saving an index embedded by {type(self.embedder).__name__} is not supported "
                "yet (only the offline TF-IDF + SVD embedder is saved with an index)"
            )
        folder = Path(folder)
        write_search_files(folder, self.faiss_index, self.embedder)
        with (folder / "documents.jsonl").open("w", encoding="utf-8") as out:
            for d in self.documents:
                record = {"id": d.id, "text": d.text, "metadata": dict(d.metadata)}
                out.write(json.dumps(record, ensure_ascii=False) + "\n")
        manifest = {
            "format": _FORMAT,
            "documents": len(self.documents),
            "dimension": self.embedder.dimension,
            "settings": asdict(self.settings),
            "nlist": self.nlist,
            "build_times_s": asdict(self.times),
        }
        (folder / "manifest.json").write_text(json.dumps(manifest, indent=2), encoding="utf-8")

    @classmethod
    def load(cls, folder: Path | str) -> LocalIndex:
        """Load a folder written by `save`. Raises `InputError` when it is missing or damaged."""
        import faiss

        folder = Path(folder)
        manifest_path = folder / "manifest.json"
        try:
            manifest = json.loads(manifest_path.read_text(encoding="utf-8"))
        except (OSError, ValueError) as exc:
            raise InputError(f"{folder}: not a RAGCache index (cannot read manifest.json)") from exc
        if manifest.get("format") != _FORMAT:
            raise InputError(f"{manifest_path}: unknown format {manifest.get('format')!r}")
        settings = settings_from_manifest(manifest, IndexSettings)
        try:
            faiss_index = faiss.read_index(str(folder / "index.faiss"))
        except RuntimeError as exc:
            raise InputError(f"{folder}/index.faiss: cannot read: {exc}") from exc
        documents = load_documents(folder)
        return cls(
            documents,
            TfidfSvdEmbedder.load(folder),
            faiss_index,
            settings,
            BuildTimes(**manifest["build_times_s"]),
        )


def write_search_files(folder: Path, faiss_index: Any, embedder: TfidfSvdEmbedder) -> None:
    """What every saved index folder holds first (this one's and `retrieval.padded`'s): the
    folder, index.faiss and the embedder's files. The caller writes manifest.json last."""
    import faiss

    folder.mkdir(parents=True, exist_ok=True)
    faiss.write_index(faiss_index, str(folder / "index.faiss"))
    embedder.save(folder)


def settings_from_manifest(manifest: dict[str, Any], cls: type[SettingsT]) -> SettingsT:
    """A saved index's settings dataclass from its manifest (the embedder's config nested)."""
    raw = dict(manifest["settings"])
    return cls(**{**raw, "embedder": EmbedderConfig(**raw["embedder"])})


def load_documents(folder: Path | str) -> list[Document]:
    """The documents of an index folder written by `LocalIndex.save` (no vectors read)."""
    return [
        Document(id=str(r["id"]), text=str(r["text"]), metadata=r.get("metadata", {}))
        for r in _read_jsonl(Path(folder) / "documents.jsonl")
    ]


def _read_jsonl(path: Path) -> list[dict[str, Any]]:
    from ragcache_core.retrieval.corpus import iter_jsonl

    return [record for _, record in iter_jsonl(path)]


def build_index(
    documents: Sequence[Document],
    settings: IndexSettings = IndexSettings(),
    *,
    progress: bool = False,
    embedder: Embedder | None = None,
) -> LocalIndex:
    """Fit the embedder on `documents` (or use `embedder`, already built), embed them and
    build the Faiss index (pure w.r.t. input).

    `progress` shows tqdm bars on stderr. Raises `InputError` for an empty corpus or duplicate ids.
    """
    from tqdm import tqdm

    if not documents:
        raise InputError("empty corpus: nothing to index")
    ids = [d.id for d in documents]
    if len(set(ids)) != len(ids):
        dup = next(i for i in ids if ids.count(i) > 1)
        raise InputError(f"duplicate document id {dup!r}")
    texts = [embedding_text(d) for d in documents]
    t0 = time.perf_counter()
    if embedder is None:
        embedder = TfidfSvdEmbedder.fit(texts, settings.embedder)
    t1 = time.perf_counter()
    chunks: list[npt.NDArray[np.float32]] = []
    with tqdm(total=len(texts), desc="embed", unit="doc", disable=not progress) as bar:
        for i in range(0, len(texts), _BATCH):
            chunks.append(embedder.embed(texts[i : i + _BATCH]))  # [batch, d]
            bar.update(len(chunks[-1]))
    vectors = np.concatenate(chunks)  # [N, d]
    t2 = time.perf_counter()
    index = _new_faiss_index(settings, embedder.dimension, len(documents))
    if not index.is_trained:
        index.train(vectors)
    t3 = time.perf_counter()
    with tqdm(total=len(vectors), desc="add", unit="vec", disable=not progress) as bar:
        for i in range(0, len(vectors), _BATCH):
            index.add(vectors[i : i + _BATCH])
            bar.update(min(_BATCH, len(vectors) - i))
    t4 = time.perf_counter()
    times = BuildTimes(t1 - t0, t2 - t1, t3 - t2, t4 - t3)
    return LocalIndex(documents, embedder, index, settings, times)


def _new_faiss_index(settings: IndexSettings, dimension: int, n: int) -> Any:
    import faiss

    ip = faiss.METRIC_INNER_PRODUCT
    if settings.kind == "flat":
        return faiss.IndexFlatIP(dimension)
    if settings.kind == "hnsw":
        hnsw = faiss.IndexHNSWFlat(dimension, settings.hnsw_m, ip)
        hnsw.hnsw.efConstruction = settings.ef_construction
        hnsw.hnsw.efSearch = settings.ef_search
        return hnsw
    nlist = min(settings.nlist or default_nlist(n), n)
    quantizer = faiss.IndexFlatIP(dimension)
    index = faiss.IndexIVFFlat(quantizer, dimension, nlist, ip)
    # ~4 x sqrt(N) lists is a deliberate choice (docs/design.md 2.8); fewer than Faiss's 39 training
    # points per list is expected at our sizes, so silence its warning.
    index.cp.min_points_per_centroid = 1
    index.cp.seed = settings.embedder.seed + 1234
    index.nprobe = min(settings.nprobe, nlist)
    return index
