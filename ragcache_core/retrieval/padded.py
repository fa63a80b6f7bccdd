"""A knowledge base whose search costs what a real one does: real documents padded with
synthetic vectors to a million or more, in an IVF index with compact codes.

There are ~12k real passages here; a real knowledge base holds millions. The index holds the
real documents' embeddings (rows 0..n_real-1) and synthetic vectors after them, drawn from a
Gaussian with the real embeddings' mean and covariance, scaled to unit norm like them:

    rows:  [ real 0 .. n_real-1 | synthetic n_real .. ntotal-1 ]   one IVF, nlist lists,
                                                                   8-bit or float16 codes

A search scans the same lists and codes either kind of row sits in, so its cost is that of a
real index of `ntotal` vectors. A synthetic row has no text: `PaddedSource` drops it from every
stage's top-k (the prompt holds only the real documents among them) and counts it.

Synthetic rows are generated in blocks from a seeded generator per block, so any block can be
generated again (`vectors`, `exact_topk`) without storing float32 copies. A built index is saved
in a folder keyed by its settings and documents (`cached`): building a million vectors takes
about a minute of one core; loading it a second.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import tempfile
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Literal

import numpy as np
import numpy.typing as npt

from ragcache_core.documents import Document
from ragcache_core.errors import ConfigError, InputError
from ragcache_core.retrieval.embedder import EmbedderConfig, TfidfSvdEmbedder
from ragcache_core.retrieval.index_store import (
    BuildTimes,
    embedding_text,
    settings_from_manifest,
    write_search_files,
)
from ragcache_core.retrieval.ivf import ListsPerStage, StagedIVF
from ragcache_core.retrieval.source import SourceFrame
from ragcache_core.search import StageResult

Codes = Literal["sq8", "fp16", "float32"]
CODE_BYTES: dict[str, int] = {"sq8": 1, "fp16": 2, "float32": 4}
"""Bytes per dimension of each code: 8-bit scalar quantizer, float16, float32 (IVFFlat)."""
_FORMAT = "ragcache-padded-index/1"
BLOCK = 65_536
"""Synthetic rows per generated block (the unit of regeneration)."""
_TRAIN_BLOCK = 2**31 - 1
"""The block number of the training sample's synthetic points (never a row of the index)."""


@dataclass(frozen=True)
class PaddedSettings:
    """How a padded index is built. `vectors` counts every row, real and synthetic."""

    vectors: int = 1_000_000
    nlist: int = 1024
    codes: Codes = "fp16"
    train_points: int = 65_536
    seed: int = 0
    embedder: EmbedderConfig = field(default_factory=EmbedderConfig)

    def __post_init__(self) -> None:
        if self.vectors < 1 or self.nlist < 1 or self.train_points < self.nlist:
            raise ConfigError(f"bad padded index settings {self}: need train_points >= nlist")
        if self.codes not in CODE_BYTES:
            raise ConfigError(f"codes must be one of {sorted(CODE_BYTES)}, got {self.codes!r}")

    def key(self, documents: Sequence[Document]) -> str:
        """A name for the cache folder: these settings and the documents' ids and texts."""
        digest = hashlib.sha256(json.dumps(asdict(self), sort_keys=True).encode())
        for d in documents:
            digest.update(f"{d.id}\0{embedding_text(d)}\0".encode())
        return digest.hexdigest()[:16]


@dataclass(frozen=True)
class GaussianModel:
    """A Gaussian over embeddings: `mean` [d] and the Cholesky factor `chol` [d, d] of the
    covariance; samples are scaled to unit norm (the real embeddings are)."""

    mean: npt.NDArray[np.float64]
    chol: npt.NDArray[np.float64]

    @classmethod
    def fit(cls, vectors: npt.NDArray[np.float32]) -> GaussianModel:
        """Mean and covariance of `vectors` [n, d] (a tiny ridge keeps it positive definite)."""
        x = np.asarray(vectors, dtype=np.float64)  # [n, d]
        if x.ndim != 2 or x.shape[0] < 2:
            raise InputError(f"need at least 2 vectors to fit a Gaussian, got {x.shape}")
        cov = np.cov(x, rowvar=False)  # [d, d]
        ridge = 1e-6 * max(float(np.trace(cov)) / cov.shape[0], 1e-12)
        chol = np.linalg.cholesky(cov + ridge * np.eye(cov.shape[0]))  # [d, d]
        return cls(x.mean(axis=0), chol)

    def block(self, seed: int, number: int, size: int) -> npt.NDArray[np.float32]:
        """Synthetic block `number`: `size` unit vectors [size, d], the same on every call."""
        rng = np.random.default_rng((seed, number))
        z = rng.standard_normal((size, self.mean.shape[0]))  # [size, d]
        x = self.mean + z @ self.chol.T  # [size, d]
        x /= np.maximum(np.linalg.norm(x, axis=1, keepdims=True), 1e-12)
        return np.ascontiguousarray(x, dtype=np.float32)


class PaddedIndex:
    """Real documents plus synthetic rows in one IVF index. Read-only after build or load;
    searching never mutates it (concurrent searches from several threads are safe)."""

    def __init__(
        self,
        documents: Sequence[Document],
        embedder: TfidfSvdEmbedder,
        faiss_index: Any,
        model: GaussianModel,
        settings: PaddedSettings,
        times: BuildTimes,
    ) -> None:
        if faiss_index.ntotal != settings.vectors:
            raise InputError(f"index holds {faiss_index.ntotal} rows, settings say {settings}")
        self.documents = tuple(documents)
        self.embedder = embedder
        self.faiss_index = faiss_index
        self.model = model
        self.settings = settings
        self.times = times
        self.folder: Path | None = None
        """Where it is saved (set by `load`), for results worth keeping beside it."""

    @property
    def n_real(self) -> int:
        return len(self.documents)

    @property
    def ntotal(self) -> int:
        return int(self.faiss_index.ntotal)

    @property
    def nlist(self) -> int:
        return int(self.faiss_index.nlist)

    @property
    def synthetic_share(self) -> float:
        """The share of rows that are synthetic padding."""
        return 1.0 - self.n_real / self.ntotal

    def code_bytes(self) -> int:
        """Bytes of vector codes and ids held in the inverted lists (the resident index)."""
        per_vector = CODE_BYTES[self.settings.codes] * self.embedder.dimension
        return self.ntotal * (per_vector + 8)

    def describe(self) -> dict[str, Any]:
        return {
            "vectors": self.ntotal,
            "real": self.n_real,
            "synthetic": self.ntotal - self.n_real,
            "synthetic_share": self.synthetic_share,
            "padding": "synthetic rows drawn from a Gaussian with the real embeddings' mean and "
            "covariance, unit norm; dropped from a prompt when they reach its top-k",
            "dimension": self.embedder.dimension,
            "nlist": self.nlist,
            "codes": self.settings.codes,
            "code_bytes": self.code_bytes(),
            "build_times_s": asdict(self.times),
        }

    # ----------------------------------------------------------------- vectors and exact search

    def vectors(self) -> Iterator[tuple[int, npt.NDArray[np.float32]]]:
        """(first row, float32 vectors [n, d]) for every row in order: the real embeddings,
        then the synthetic blocks generated again."""
        texts = [embedding_text(d) for d in self.documents]
        yield 0, self.embedder.embed(texts)
        yield from _synthetic_blocks(self.model, self.settings, self.n_real)

    def exact_topk(
        self, queries: npt.NDArray[np.float32], k: int
    ) -> tuple[npt.NDArray[np.float32], npt.NDArray[np.int64]]:
        """Exact inner-product top-k rows of `queries` [q, d] over every row's float32 vector
        (not the index's codes): (scores [q, k], rows [q, k]), best first."""
        q = np.ascontiguousarray(queries, dtype=np.float32)
        best_s = np.full((q.shape[0], 0), -np.inf, dtype=np.float32)
        best_i = np.zeros((q.shape[0], 0), dtype=np.int64)
        for first, block in self.vectors():
            scores = q @ block.T  # [q, n]
            take = min(k, scores.shape[1])
            part = np.argpartition(-scores, take - 1, axis=1)[:, :take]  # [q, take]
            s = np.take_along_axis(scores, part, axis=1)
            best_s = np.concatenate([best_s, s], axis=1)
            best_i = np.concatenate([best_i, part + first], axis=1)
            order = np.argsort(-best_s, axis=1, kind="stable")[:, :k]
            best_s = np.take_along_axis(best_s, order, axis=1)
            best_i = np.take_along_axis(best_i, order, axis=1)
        return best_s, best_i

    # ----------------------------------------------------------------- searching

    def staged(self, ratio: float, stages: int) -> StagedIVF:
        """A staged search probing `ratio` of the lists (the paper's search ratio) in `stages`
        equal stages of lists."""
        if not 0.0 < ratio <= 1.0:
            raise ConfigError(f"the search ratio must be in (0, 1], got {ratio}")
        if stages < 1:
            raise ConfigError(f"stages must be >= 1, got {stages}")
        nprobe = max(1, round(ratio * self.nlist))
        per_stage = max(1, -(-nprobe // stages))
        return StagedIVF(self.faiss_index, nprobe=nprobe, sizing=ListsPerStage(per_stage))

    def source(
        self,
        ratio: float,
        stages: int,
        *,
        prepare_thread: Callable[[], None] | None = None,
        log: SearchLog | None = None,
    ) -> PaddedSource:
        """A search source over this index (see `PaddedSource`)."""
        return PaddedSource(self, self.staged(ratio, stages), prepare_thread, log)

    # ----------------------------------------------------------------- build, save, load

    @classmethod
    def build(
        cls, documents: Sequence[Document], settings: PaddedSettings = PaddedSettings()
    ) -> PaddedIndex:
        """Fit the embedder on `documents`, embed them, fit the Gaussian, train the IVF on a
        uniform sample of all rows and add every row (Faiss on one thread: about a minute for
        a million rows). Raises `InputError` when the documents are more than the rows."""
        import faiss

        if not documents:
            raise InputError("empty corpus: nothing to index")
        if len(documents) > settings.vectors:
            raise InputError(f"{len(documents)} documents do not fit {settings.vectors} rows")
        threads = faiss.omp_get_max_threads()
        faiss.omp_set_num_threads(1)  # bounded: the machine is shared
        try:
            return cls._build(documents, settings)
        finally:
            faiss.omp_set_num_threads(threads)

    @classmethod
    def _build(cls, documents: Sequence[Document], settings: PaddedSettings) -> PaddedIndex:
        t0 = time.perf_counter()
        texts = [embedding_text(d) for d in documents]
        embedder = TfidfSvdEmbedder.fit(texts, settings.embedder)
        t1 = time.perf_counter()
        real = embedder.embed(texts)  # [n_real, d]
        model = GaussianModel.fit(real)
        t2 = time.perf_counter()
        index = _new_index(settings, embedder.dimension)
        index.train(_training_sample(real, model, settings))
        t3 = time.perf_counter()
        index.add(real)
        for _, block in _synthetic_blocks(model, settings, len(documents)):
            index.add(block)
        t4 = time.perf_counter()
        times = BuildTimes(t1 - t0, t2 - t1, t3 - t2, t4 - t3)
        return cls(documents, embedder, index, model, settings, times)

    def save(self, folder: Path) -> None:
        """Write the folder: index.faiss, the embedder, gaussian.npz, manifest.json."""
        write_search_files(folder, self.faiss_index, self.embedder)
        np.savez(folder / "gaussian.npz", mean=self.model.mean, chol=self.model.chol)
        manifest = {
            "format": _FORMAT,
            "settings": asdict(self.settings),
            "documents": [d.id for d in self.documents],
            "build_times_s": asdict(self.times),
        }
        (folder / "manifest.json").write_text(json.dumps(manifest), encoding="utf-8")

    @classmethod
    def load(cls, folder: Path, documents: Sequence[Document]) -> PaddedIndex:
        """Read a folder written by `save` for these `documents` (the manifest names their
        ids, in row order). Raises `InputError` when it is missing, damaged or for others."""
        import faiss

        try:
            manifest = json.loads((folder / "manifest.json").read_text(encoding="utf-8"))
            arrays = np.load(folder / "gaussian.npz")
            model = GaussianModel(arrays["mean"], arrays["chol"])
            faiss_index = faiss.read_index(str(folder / "index.faiss"))
        except (OSError, ValueError, KeyError, RuntimeError) as exc:
            raise InputError(f"{folder}: not a whole padded index: {exc}") from exc
        if manifest.get("format") != _FORMAT:
            raise InputError(f"{folder}: unknown format {manifest.get('format')!r}")
        if manifest["documents"] != [d.id for d in documents]:
            raise InputError(f"{folder}: built for other documents")
        settings = settings_from_manifest(manifest, PaddedSettings)
        index = cls(
            documents,
            TfidfSvdEmbedder.load(folder),
            faiss_index,
            model,
            settings,
            BuildTimes(**manifest["build_times_s"]),
        )
        index.folder = folder
        return index

    @classmethod
    def cached(
        cls, documents: Sequence[Document], settings: PaddedSettings, home: Path
    ) -> tuple[PaddedIndex, bool]:
        """The index for these settings and documents from `home/padded-<key>`, built and
        saved there first when absent (written beside it, then renamed: a reader never sees a
        half folder). Returns (index, whether it was built now)."""
        folder = home / f"padded-{settings.key(documents)}"
        if (folder / "manifest.json").is_file():
            return cls.load(folder, documents), False
        index = cls.build(documents, settings)
        home.mkdir(parents=True, exist_ok=True)
        partial = Path(tempfile.mkdtemp(prefix=".padded-", dir=home))
        try:
            index.save(partial)
            if not (folder / "manifest.json").is_file():
                shutil.rmtree(folder, ignore_errors=True)
                os.replace(partial, folder)
        finally:
            shutil.rmtree(partial, ignore_errors=True)
        index.folder = folder
        return index, True


def _new_index(settings: PaddedSettings, dimension: int) -> Any:
    import faiss

    quantizer = faiss.IndexFlatIP(dimension)
    ip = faiss.METRIC_INNER_PRODUCT
    index: Any
    if settings.codes == "float32":
        index = faiss.IndexIVFFlat(quantizer, dimension, settings.nlist, ip)
    else:
        qtype = {"sq8": faiss.ScalarQuantizer.QT_8bit, "fp16": faiss.ScalarQuantizer.QT_fp16}
        index = faiss.IndexIVFScalarQuantizer(
            quantizer, dimension, settings.nlist, qtype[settings.codes], ip
        )
    index.cp.seed = settings.seed + 1234
    index.cp.min_points_per_centroid = 1
    return index


def _synthetic_blocks(
    model: GaussianModel, settings: PaddedSettings, n_real: int
) -> Iterator[tuple[int, npt.NDArray[np.float32]]]:
    """(first row, block) of every synthetic row, in row order."""
    synthetic = settings.vectors - n_real
    for number, start in enumerate(range(0, synthetic, BLOCK)):
        size = min(BLOCK, synthetic - start)
        yield n_real + start, model.block(settings.seed, number, size)


def _training_sample(
    real: npt.NDArray[np.float32], model: GaussianModel, settings: PaddedSettings
) -> npt.NDArray[np.float32]:
    """A uniform sample of all rows, `train_points` of them at most: real rows in their
    share, the rest synthetic (i.i.d., so a block apart from the index's rows will do)."""
    points = min(settings.train_points, settings.vectors)
    n_real = min(len(real), max(1, round(points * len(real) / settings.vectors)))
    rng = np.random.default_rng(settings.seed)
    chosen = real[np.sort(rng.choice(len(real), size=n_real, replace=False))]
    synthetic = model.block(settings.seed, _TRAIN_BLOCK, points - n_real)
    return np.ascontiguousarray(np.concatenate([chosen, synthetic]), dtype=np.float32)


# --------------------------------------------------------------------------- the source


@dataclass(frozen=True)
class SearchRecord:
    """One search through a `PaddedSource`: what each stage found and how long it took."""

    question: str
    embed_s: float
    stage_s: tuple[float, ...]
    """Wall seconds of each stage alone (the first includes the quantizer's list ranking)."""
    stage_rows: tuple[tuple[int, ...], ...]
    """Every stage's top-k rows, synthetic ones included."""
    n_real: int

    @property
    def total_s(self) -> float:
        return self.embed_s + sum(self.stage_s)

    @property
    def final_rows(self) -> tuple[int, ...]:
        return self.stage_rows[-1]

    @property
    def dropped(self) -> int:
        """Synthetic rows in the final top-k (dropped from the prompt)."""
        return sum(1 for r in self.final_rows if r >= self.n_real)

    def real_rows(self, stage: int) -> tuple[int, ...]:
        return tuple(r for r in self.stage_rows[stage] if r < self.n_real)

    @property
    def last_change(self) -> int:
        """The first stage from which the prompt's documents (real rows, in order) stay the
        final ones: the stage an adopted speculation starts from."""
        final = self.real_rows(len(self.stage_rows) - 1)
        stage = len(self.stage_rows) - 1
        while stage > 0 and self.real_rows(stage - 1) == final:
            stage -= 1
        return stage


class SearchLog:
    """The records of the searches run since the last `take()` (thread-safe)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._records: list[SearchRecord] = []

    def add(self, record: SearchRecord) -> None:
        with self._lock:
            self._records.append(record)

    def take(self) -> list[SearchRecord]:
        """The records so far, and forget them."""
        with self._lock:
            records, self._records = self._records, []
        return records


class PaddedSource(SourceFrame):
    """A `SearchSource` over a `PaddedIndex`: embed, staged IVF, real rows to documents.

    Every stage's synthetic rows are dropped, so a stage yields the real documents among its
    top-k (fewer than k when synthetic rows reached it). `prepare_thread()`, when given, runs
    first in the searching thread of every search (to pin it to a core, say). Each finished
    search is recorded in `log`.
    """

    staged: StagedIVF

    def __init__(
        self,
        index: PaddedIndex,
        staged: StagedIVF,
        prepare_thread: Callable[[], None] | None = None,
        log: SearchLog | None = None,
    ) -> None:
        self.index = index
        self.staged = staged
        self._prepare = prepare_thread
        self.log = log if log is not None else SearchLog()

    def _stages(self, question: str, k: int) -> Iterator[StageResult]:
        if self._prepare is not None:
            self._prepare()
        start = time.perf_counter()
        vector = self.index.embedder.embed_query(question)  # [d]
        embedded = time.perf_counter()
        documents = self.index.documents
        n_real = self.index.n_real
        stage_s: list[float] = []
        stage_rows: list[tuple[int, ...]] = []
        mark = embedded
        for stage in self.staged.stages(vector.reshape(1, -1), k):
            stage_s.append(time.perf_counter() - mark)
            rows = tuple(int(r) for r in stage.ids[0])
            stage_rows.append(rows)
            real = [(r, float(s)) for r, s in zip(rows, stage.scores[0], strict=True) if r < n_real]
            if stage.is_last:
                self.log.add(
                    SearchRecord(
                        question, embedded - start, tuple(stage_s), tuple(stage_rows), n_real
                    )
                )
            yield StageResult(
                documents=tuple(documents[r] for r, _ in real),
                scores=tuple(s for _, s in real),
                stage=stage.index,
                is_last=stage.is_last,
                elapsed_s=time.perf_counter() - start,
            )
            mark = time.perf_counter()
