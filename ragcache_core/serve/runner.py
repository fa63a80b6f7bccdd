"""Run one server: uvicorn with one worker, draining on SIGTERM/SIGINT.

    SIGTERM ─► the queue refuses new requests (503) and uvicorn stops accepting connections
            ─► requests in flight finish (at most `drain_timeout_s`, then they are cancelled:
               each cancellation aborts its request in vLLM and releases its pins)
            ─► the lifespan closes the cache: engine stopped, shared-memory host pool removed

A second signal during the drain stops at once (uvicorn's force exit).
"""

from __future__ import annotations

import logging
from types import FrameType

import uvicorn

from ragcache_core.serve.app import create_app
from ragcache_core.serve.settings import ServeSettings
from ragcache_core.serve.state import ServeState

logger = logging.getLogger(__name__)


class _DrainingServer(uvicorn.Server):
    """uvicorn's server, closing the bounded queue as soon as the exit signal arrives (uvicorn
    alone would keep answering requests on open keep-alive connections while it drains)."""

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        state = getattr(getattr(self.config.app, "state", None), "serve", None)
        if isinstance(state, ServeState):
            state.queue.close()
            logger.info("draining %d request(s) in flight", state.queue.in_flight)
        super().handle_exit(sig, frame)


def run(settings: ServeSettings) -> None:
    """Serve until a signal; returns after the drain and the cache's close."""
    app = create_app(settings)
    config = uvicorn.Config(
        app,
        host=settings.host,
        port=settings.port,
        workers=1,  # one process owns the engine
        lifespan="on",  # a failed startup (no engine) is fatal
        log_level=settings.log_level,
        timeout_graceful_shutdown=max(1, round(settings.drain_timeout_s)),
    )
    _DrainingServer(config).run()
