"""Adapters that put RAGCache into LlamaIndex and LangChain apps.

Thin: they translate, the core decides (`ragcache_core` never imports either framework).
"""
