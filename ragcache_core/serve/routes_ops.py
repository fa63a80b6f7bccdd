"""`GET /health`, `GET /metrics` (Prometheus text: the cache's collectors and the server's) and
`GET /v1/models` (the one served model, as `vllm serve` lists it)."""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter, Request, Response
from fastapi.responses import JSONResponse
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from ragcache_core.serve.state import state_of


async def health(request: Request) -> Response:
    """200 while serving; 503 while starting or shutting down."""
    state = state_of(request)
    if state.queue.draining:
        return JSONResponse({"status": "draining"}, status_code=503)
    return JSONResponse({"status": "ok"})


async def metrics(request: Request) -> Response:
    state = state_of(request)
    text = generate_latest(state.cache.metrics.registry) + generate_latest(state.metrics.registry)
    return Response(text, media_type=CONTENT_TYPE_LATEST)


async def models(request: Request) -> dict[str, Any]:
    state = state_of(request)
    card = {
        "id": state.settings.model_name,
        "object": "model",
        "created": int(state.started_at),
        "owned_by": "ragcache",
        "root": state.settings.model,
        "max_model_len": state.settings.config.max_model_len,
    }
    return {"object": "list", "data": [card]}


def router() -> APIRouter:
    """This module's routes (a new router per app: nothing is shared between apps)."""
    routes = APIRouter()
    routes.add_api_route("/health", health, methods=["GET"])
    routes.add_api_route("/metrics", metrics, methods=["GET"])
    routes.add_api_route("/v1/models", models, methods=["GET"])
    return routes
