"""`ragcache index`: build a staged-searchable index (offline embedder + Faiss) from JSONL."""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

from ragcache_core.errors import CliError


def register(subparsers: Any) -> None:
    parser = subparsers.add_parser(
        "index",
        help="index JSONL corpora (TF-IDF+SVD embedder, Faiss IVF/HNSW/flat)",
        description=(
            "Fit the offline TF-IDF + SVD embedder on the corpus, embed every document and "
            "build a Faiss index; save all of it in --out. Field options take comma-separated "
            "candidates, the first present in a record wins. With several --corpus files, ids "
            "are prefixed with the file name ('file:id')."
        ),
    )
    parser.add_argument("--corpus", type=Path, action="append", required=True, metavar="JSONL")
    parser.add_argument("--text-field", default="text", help="default: %(default)s")
    parser.add_argument("--id-field", default="id,doc_id", help="default: %(default)s")
    parser.add_argument("--out", type=Path, required=True, metavar="DIR")
    parser.add_argument("--kind", choices=("ivf", "hnsw", "flat"), default="ivf")
    parser.add_argument("--nlist", type=int, default=None, help="IVF lists (default ~4*sqrt(N))")
    parser.add_argument("--nprobe", type=int, default=32, help="IVF lists probed (%(default)s)")
    parser.add_argument("--lists-per-stage", type=int, default=4, help="IVF (%(default)s)")
    parser.add_argument("--ef-search", type=int, default=128, help="HNSW (%(default)s)")
    parser.add_argument("--dimension", type=int, default=256, help="embedding size (%(default)s)")
    parser.add_argument("--overwrite", action="store_true", help="replace an existing index")
    parser.add_argument("--no-progress", action="store_true", help="hide the progress bars")
    parser.set_defaults(func=_run)


def _run(args: argparse.Namespace) -> int:
    from ragcache_core.retrieval.corpus import load_corpus
    from ragcache_core.retrieval.embedder import EmbedderConfig
    from ragcache_core.retrieval.index_store import IndexSettings, build_index

    if (args.out / "manifest.json").exists() and not args.overwrite:
        raise CliError(f"{args.out} already holds an index (use --overwrite to replace it)")
    settings = IndexSettings(
        kind=args.kind,
        nlist=args.nlist,
        nprobe=args.nprobe,
        lists_per_stage=args.lists_per_stage,
        ef_search=args.ef_search,
        embedder=EmbedderConfig(dimension=args.dimension),
    )
    documents = load_corpus(
        args.corpus,
        text_fields=args.text_field,
        id_fields=args.id_field,
        options=("--text-field", "--id-field"),
    )
    index = build_index(documents, settings, progress=not args.no_progress)
    index.save(args.out)
    lists = f", {index.nlist} lists" if index.nlist else ""
    print(
        f"indexed {len(documents)} documents ({args.kind}{lists}, dimension "
        f"{index.embedder.dimension}) in {index.times.total_s:.2f} s -> {args.out}"
    )
    return 0
