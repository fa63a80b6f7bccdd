"""The request path: everything that serves one request in the app process.

`RAGCache` (ragcache.py) is the facade; docs/architecture.md walks a request through the rest
(assembly, speculation, generation and its `Attempt`, admission and the reordering queue, the
prompt builder, the `Lifecycle` that owns the knowledge tree, the engine supervisor, uncached
and synchronous runs). Nothing here is imported by the layers below it.
"""
