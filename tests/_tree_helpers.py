"""Small builders shared by the control-plane tests."""

from __future__ import annotations

from ragcache_core.tree import DocKey, DocSpec, KnowledgeTree, RootKey

ROOT = RootKey("model", "tokenizer", "template", "float16")


def doc(name: str, tokens: int = 10) -> DocSpec:
    return DocSpec(DocKey(name, f"h-{name}"), tokens)


def run(cache: KnowledgeTree, *docs: DocSpec, root: int = 0, question: int = 0) -> None:
    """One request that completes normally."""
    cache.confirm(cache.begin_request(root, list(docs), question))
    cache.check_integrity()


def cached_paths(cache: KnowledgeTree) -> dict[tuple[str, ...], set[str]]:
    """Every node as its document-id path -> the tiers holding a copy."""
    out: dict[tuple[str, ...], set[str]] = {}
    for node in cache.iter_nodes():
        path: list[str] = []
        cur = node
        while cur.parent is not None:
            path.append(cur.key.doc_id)  # type: ignore[union-attr]
            cur = cur.parent
        out[tuple(reversed(path))] = {str(t) for t in node.slots}
    return out
