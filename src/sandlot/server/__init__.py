"""``sandlot serve``: an authenticated HTTP API for sandboxes (needs the ``server`` extra).

::

    from sandlot.server import ServerSettings, create_app, serve

    serve(ServerSettings(), host="127.0.0.1", port=8000)

The API is E2B-shaped (see docs/server.md); the SDK's remote mode
(``Sandbox(api_url=..., api_key=...)``) and the unmodified ``e2b_code_interpreter``
client both talk to it.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any

from sandlot.server._app import create_app
from sandlot.server._cluster import ClusterStore, NodeRef
from sandlot.server._door import Directory, FrontDoor, create_front_door
from sandlot.server._settings import (
    E2B_TEMPLATES,
    TIMEOUT_CEILINGS,
    Quotas,
    ServerSettings,
    default_state_dir,
)
from sandlot.server._store import Store, TenantQuotas

__all__ = [
    "E2B_TEMPLATES",
    "TIMEOUT_CEILINGS",
    "ClusterStore",
    "Directory",
    "FrontDoor",
    "NodeRef",
    "Quotas",
    "ServerSettings",
    "Store",
    "TenantQuotas",
    "create_app",
    "create_front_door",
    "default_state_dir",
    "serve",
]

log = logging.getLogger("sandlot.server")


def serve(settings: ServerSettings, *, host: str = "127.0.0.1", port: int = 8000) -> None:
    """Run the server until SIGINT/SIGTERM, then shut down gracefully.

    On a signal the server stops taking new cells and sandboxes, lets running cells
    finish for ``settings.shutdown_grace`` seconds, interrupts the rest, logs which
    cells finished and which were interrupted, and kills every sandbox.
    """
    import uvicorn

    app = create_app(settings)
    manager = app.state.sandlot.manager

    class Server(uvicorn.Server):
        async def shutdown(self, sockets: Any = None) -> None:
            # Drain before uvicorn closes connections, so a running cell's stream can
            # still deliver its end (finished or interrupted) to its client.
            await asyncio.to_thread(manager.drain, settings.shutdown_grace)
            await super().shutdown(sockets)

    config = uvicorn.Config(
        app,
        host=host,
        port=port,
        log_level="info",
        access_log=False,  # paths carry sandbox ids only, but keep the log to our own lines
        timeout_graceful_shutdown=5,
        # uvicorn's default (5 s) races clients that reuse a connection after a pause of
        # about that long: the server closes it as the request goes out, and the client
        # sees "connection closed before message completed". Longer than clients keep
        # idle connections (httpx, E2B's SDK: 5-30 s).
        timeout_keep_alive=75,
        lifespan="on",
        # The cell WebSocket (/v1/sandboxes/{id}/cells): a frame over the request body
        # limit is refused before it is buffered whole (the app checks it again).
        ws_max_size=settings.max_body_bytes + 1024,
    )
    Server(config).run()
