"""The front door: one HTTP endpoint in front of the sandlot servers of a cluster's nodes.

Every cluster node runs the ordinary sandlot server (``create_app``) on its own address,
with a :class:`~sandlot.server._cluster.ClusterStore` on the shared database; the
front door serves the same URLs (the native ``/v1`` API, E2B's control plane and sandbox
plane, the debug-mode ``/e2b``) and does only three things itself:

* **placement**: a create is admitted against the tenant's quotas over the whole
  cluster and given to the node with the most free slots
  (:meth:`ClusterStore.reserve`), then forwarded to that node;
* **routing**: every later request naming a sandbox (in its path, or in E2B's
  ``E2b-Sandbox-Id`` header) is streamed, unchanged, to the node that holds it (found
  in the shared store, then cached: a sandbox never moves); so is a sandbox's cell
  WebSocket, message by message;
* **loss**: a sandbox whose node left the cluster answers ``NodeLost`` (a
  ``SandboxLost``; on E2B's wire, "sandbox was not found"), its rows are closed with
  ``end_reason`` "node-lost" and its running cells ``killed``/``died``, which releases
  its tenant's quotas.

Authentication, ownership, limits, the audit trail and the E2B tokens stay with the
node that serves the request: the front door holds no per-sandbox state but a cache,
so any number of them can run side by side and one that dies loses nothing. It knows
nothing of Ray: a :class:`Directory` (``sandlot.ray``'s) says which nodes exist.
"""

from __future__ import annotations

import asyncio
import contextlib
import datetime
import hashlib
import json
import logging
import re
import socket
from collections.abc import Callable
from typing import Any, Protocol

import httpx
from starlette.datastructures import Headers
from starlette.types import Message, Receive, Scope, Send

import sandlot
from sandlot.server._cluster import ClusterStore, NodeRef, Placement
from sandlot.server._e2b_control import _token
from sandlot.server._manager import ApiError, effective_quotas
from sandlot.server._relay import (
    Answer,
    NodeConnection,
    NodePool,
    NodeSocket,
    SocketClosed,
    UpstreamError,
    request_head,
)
from sandlot.server._settings import Quotas, ServerSettings
from sandlot.server._state import api_key_of
from sandlot.server._store import Principal

log = logging.getLogger("sandlot.server.door")

_NATIVE_ID = re.compile(r"^/v1/sandboxes/([^/]+)(/.*)?$")
_CONTROL_ID = re.compile(r"^(?:/v2)?/sandboxes/([^/]+)(/.*)?$")
_DEBUG_ID = re.compile(r"^/e2b/sandboxes/([^/]+)(/.*)?$")
_CELLS = re.compile(r"^/v1/sandboxes/([^/]+)/cells$")
_HOP = frozenset(
    {
        b"host",
        b"connection",
        b"keep-alive",
        b"transfer-encoding",
        b"te",
        b"upgrade",
        b"date",
        # The client's "100-continue" was answered by the front door's own server when
        # the body was asked for; the body goes on to the node without waiting.
        b"expect",
    }
)
_HOP_OUT = frozenset({b"connection", b"keep-alive", b"transfer-encoding", b"date", b"server"})
NODE_KEEPALIVE = 30.0
"""Seconds a front door keeps an idle connection to a node. Node servers keep theirs
for 90 s (``sandlot.ray``): the front door always closes first, so it never sends a
request on a connection the node is closing."""
MAX_INFO = 1 << 20
"""Bytes of a sandbox's info (``GET /v1/sandboxes/{id}``) the front door reads to add
its node."""
DEBUG_SANDBOX_ID = "debug"  # E2B's debug mode names no sandbox (sandlot.server._e2b)


class Directory(Protocol):
    """Which sandlot nodes the cluster has (implemented by ``sandlot.ray``)."""

    def nodes(self) -> list[NodeRef]:
        """The live nodes that take new sandboxes (no round trip: the last refresh's)."""

    def refresh(self) -> set[str]:
        """Look again (blocking): start a node service on every node that joined; the
        ids of every node known to have left."""

    def confirm_lost(self, node_id: str) -> bool:
        """Whether ``node_id`` (or its node service) is gone for good (blocking)."""

    def draining(self) -> set[str]:
        """The nodes the cluster itself is draining (as of the last refresh): the front
        door records them in the shared store, where placement skips them."""


class _Surface:
    """How a request's errors are shaped: the native API's, or E2B's."""

    NATIVE = "native"
    CONTROL = "control"
    PLANE = "plane"


def _json_body(status: int, body: dict[str, Any]) -> tuple[int, bytes]:
    # Rendered byte for byte as the nodes' server renders its JSON errors (Starlette's
    # JSONResponse): the front door's "not found" must not differ from a node's by a
    # space, or it would tell a caller which ids exist elsewhere.
    return status, json.dumps(
        body, ensure_ascii=False, allow_nan=False, indent=None, separators=(",", ":")
    ).encode()


def _native(status: int, type_: str, message: str) -> tuple[int, bytes]:
    return _json_body(status, {"type": type_, "message": message})


def _e2b(status: int, message: str) -> tuple[int, bytes]:
    return _json_body(status, {"code": status, "message": message})


class FrontDoor:
    """The front door's ASGI app. ``refresh``: seconds between membership checks."""

    def __init__(
        self,
        settings: ServerSettings,
        store: ClusterStore,
        directory: Directory,
        *,
        refresh: float = 1.0,
    ) -> None:
        self.settings = settings
        self.store = store
        self.directory = directory
        self.refresh_interval = refresh
        self.lost: set[str] = set()
        self._drained: set[str] = set()  # drains of the cluster's already recorded
        self._placements: dict[str, tuple[Placement, NodeRef]] = {}
        self._client = httpx.AsyncClient(
            # No read timeout: a cell's stream lasts as long as the cell, which the node
            # bounds; connecting to a node on the cluster's network is quick or nothing.
            timeout=httpx.Timeout(None, connect=5.0),
            limits=httpx.Limits(
                max_connections=None,
                max_keepalive_connections=512,
                keepalive_expiry=NODE_KEEPALIVE,
            ),
            # A request's head and body go out as two writes: without TCP_NODELAY the
            # second waits for the node's delayed ACK (40 ms on Linux) on every call.
            transport=httpx.AsyncHTTPTransport(
                socket_options=[(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)]
            ),
        )
        # The routed calls' own connections (sandlot.server._relay): a general client
        # costs more per call than the relay itself.
        self._pool = NodePool(keepalive=NODE_KEEPALIVE)
        self._refresher: asyncio.Task[None] | None = None

    # --- membership ---------------------------------------------------------------------
    async def refresh(self) -> None:
        gone = await asyncio.to_thread(self.directory.refresh)
        for node_id in gone - self.lost:
            await self._mark_lost(node_id)
        for node_id in self.directory.draining() - self._drained - self.lost:
            await asyncio.to_thread(
                self.store.drain, node_id, "the cluster drains it (scale-down or preemption)"
            )
            self._drained.add(node_id)
            log.warning("sandlot node %s is draining: no new sandbox goes there", node_id)

    async def _mark_lost(self, node_id: str) -> None:
        boxes, cells = await asyncio.to_thread(self.store.node_lost, node_id)
        self.lost.add(node_id)
        log.warning(
            "sandlot node %s left the cluster: %d sandbox(es) and %d running cell(s) lost",
            node_id,
            boxes,
            cells,
        )

    async def _refresh_forever(self) -> None:
        while True:
            try:
                await self.refresh()
            except Exception:
                log.exception("cluster membership refresh failed")
            await asyncio.sleep(self.refresh_interval)

    # --- ASGI ---------------------------------------------------------------------------
    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "lifespan":
            await self._lifespan(receive, send)
            return
        if scope["type"] == "websocket":
            await self._socket(scope, receive, send)
            return
        if scope["type"] != "http":
            return
        try:
            await self._route(scope, receive, send)
        except _ClientGone:
            return
        except ApiError as exc:
            surface = self._surface_of(scope)
            if surface == _Surface.NATIVE:
                # As the nodes answer it (sandlot.server._app), the 401's header too.
                headers = [(b"www-authenticate", b'Bearer realm="sandlot"')]
                await _answer(
                    send,
                    *_native(exc.status, exc.type, exc.message),
                    headers if exc.status == 401 else None,
                )
            else:
                await _answer(send, *_e2b(exc.status, exc.message))

    async def _lifespan(self, receive: Receive, send: Send) -> None:
        while True:
            message = await receive()
            if message["type"] == "lifespan.startup":
                try:
                    await self.refresh()
                except Exception as exc:
                    await send({"type": "lifespan.startup.failed", "message": str(exc)})
                    return
                self._refresher = asyncio.create_task(self._refresh_forever())
                await send({"type": "lifespan.startup.complete"})
            elif message["type"] == "lifespan.shutdown":
                if self._refresher is not None:
                    self._refresher.cancel()
                    with contextlib.suppress(asyncio.CancelledError):
                        await self._refresher
                await self._client.aclose()
                self._pool.close()
                await asyncio.to_thread(self.store.close)
                await send({"type": "lifespan.shutdown.complete"})
                return

    @staticmethod
    def _surface_of(scope: Scope) -> str:
        path: str = scope["path"]
        if path.startswith("/v1/") or path == "/v1":
            return _Surface.NATIVE
        if any(name == b"e2b-sandbox-id" for name, _ in scope.get("headers", ())):
            return _Surface.PLANE
        if path.startswith("/e2b"):
            return _Surface.NATIVE
        return _Surface.CONTROL

    async def _route(self, scope: Scope, receive: Receive, send: Send) -> None:
        path: str = scope["path"]
        method: str = scope["method"]
        debug = path == "/e2b" or path.startswith("/e2b/")
        header_id = None
        for name, value in scope.get("headers", ()):
            if name == b"e2b-sandbox-id":
                header_id = value.decode("latin-1")
        if header_id is not None and not debug:
            # E2B's sandbox plane (its /health too): the sandbox's node answers.
            await self._to_sandbox(header_id, _Surface.PLANE, scope, receive, send)
            return
        if path == "/health":
            await _answer(
                send, 200, json.dumps({"status": "ok", "version": sandlot.__version__}).encode()
            )
            return
        if path == "/v1/cluster":
            await self._cluster(scope, send)
            return
        if method == "POST" and path in ("/v1/sandboxes", "/sandboxes", "/v2/sandboxes"):
            await self._create(scope, receive, send)
            return
        if method == "GET" and path == "/v1/sandboxes":
            await self._list_native(scope, send)
            return
        if method == "GET" and path in ("/sandboxes", "/v2/sandboxes"):
            await self._list_e2b(scope, send)
            return
        if path == "/files" and b"signature=" in scope.get("query_string", b""):
            await self._signed(scope, receive, send)
            return
        for pattern, surface in (
            (_NATIVE_ID, _Surface.NATIVE),
            (_CONTROL_ID, _Surface.CONTROL),
            (_DEBUG_ID, _Surface.NATIVE),
        ):
            match = pattern.match(path)
            if match:
                await self._to_sandbox(match.group(1), surface, scope, receive, send)
                return
        if debug:
            if header_id and header_id != DEBUG_SANDBOX_ID:
                await self._to_sandbox(header_id, _Surface.NATIVE, scope, receive, send)
                return
            # The tenant's default sandbox lives on one node, the one its name hashes to
            # among the live nodes (rendezvous hashing: a node joining or leaving moves
            # only the tenants it wins or held).
            principal = await self._principal(scope)
            nodes = self._live()
            if principal is None or not nodes:
                raise ApiError(401, "AuthenticationError", "a valid API key is required")
            node = max(
                nodes,
                key=lambda n: hashlib.sha256(f"{principal.tenant}|{n.node_id}".encode()).digest(),
            )
            await self._forward(node, None, _Surface.NATIVE, scope, receive, send)
            return
        # Anything else (the OpenAPI document, a node's metrics, the web app): any node.
        nodes = self._live()
        if not nodes:
            raise ApiError(503, "NoCapacity", "no live sandlot node in the cluster")
        await self._forward(nodes[0], None, _Surface.NATIVE, scope, receive, send)

    def _live(self) -> list[NodeRef]:
        return sorted(
            (n for n in self.directory.nodes() if n.node_id not in self.lost),
            key=lambda n: n.node_id,
        )

    # --- authentication (only where the front door answers itself) -----------------------
    async def _principal(self, scope: Scope) -> Principal | None:
        holder = _HeaderHolder(Headers(scope=scope))
        key = api_key_of(holder)  # type: ignore[arg-type]
        if not key:
            return None
        return await asyncio.to_thread(self.store.authenticate, key)

    async def _authenticated(self, scope: Scope) -> Principal:
        holder = _HeaderHolder(Headers(scope=scope))
        key = api_key_of(holder)  # type: ignore[arg-type]
        principal = await asyncio.to_thread(self.store.authenticate, key) if key else None
        if principal is None:
            # Word for word the nodes' refusal (sandlot.server._state.key_refused): a
            # wrong key gets the same answer for an id no node holds (answered here)
            # as for one a node holds (answered there).
            raise ApiError(
                401,
                "AuthenticationError",
                "a valid API key is required (Authorization: Bearer KEY)"
                if key is None
                else "invalid or revoked API key",
            )
        return principal

    # --- create ---------------------------------------------------------------------------
    async def _create(self, scope: Scope, receive: Receive, send: Send) -> None:
        native = scope["path"] == "/v1/sandboxes"
        body = await _read_body(receive, self.settings.max_body_bytes)
        principal = await self._authenticated(scope)
        memory = await asyncio.to_thread(self._memory_of, principal.tenant, body, native)
        quotas = await asyncio.to_thread(self._quotas, principal.tenant)
        tried: set[str] = set()
        while True:
            candidates = [n for n in self._live() if n.node_id not in tried]
            reservation, node = await asyncio.to_thread(
                self.store.reserve, principal.tenant, quotas, memory, candidates
            )
            try:
                status, headers, content = await self._call(node, scope, body)
            except httpx.TransportError:
                await asyncio.to_thread(self.store.unreserve, reservation)
                tried.add(node.node_id)
                if await asyncio.to_thread(self.directory.confirm_lost, node.node_id):
                    await self._mark_lost(node.node_id)
                continue  # another node (reserve raises NoCapacity when none is left)
            if status != 201:
                await asyncio.to_thread(self.store.unreserve, reservation)
                await _answer(send, status, content, headers)
                return
            info = json.loads(content)
            sandbox_id = str(info["sandbox_id" if native else "sandboxID"])
            granted = (info.get("resources") or {}).get("memory_mb") if native else None
            await asyncio.to_thread(
                self.store.placed, reservation, sandbox_id, int(granted or memory)
            )
            if native:
                info["node"] = {"node_id": node.node_id, "ip": node.ip}
                content = json.dumps(info).encode()
            await _answer(send, status, content, headers)
            return

    def _memory_of(self, tenant: str, body: bytes, native: bool) -> int:
        """The memory the new sandbox will have (what it asks for, else the ceiling)."""
        ceiling = self.store.tenant_ceilings(tenant).get(
            "memory_mb", self.settings.ceilings.memory_mb
        )
        asked = None
        if native:
            with contextlib.suppress(ValueError, AttributeError, TypeError):
                asked = (json.loads(body).get("resources") or {}).get("memory_mb")
        if isinstance(asked, int) and not isinstance(asked, bool) and asked > 0:
            return asked
        return int(ceiling or 0)

    def _quotas(self, tenant: str) -> Quotas:
        return effective_quotas(self.store, self.settings.quotas, tenant)

    async def _call(
        self, node: NodeRef, scope: Scope, body: bytes
    ) -> tuple[int, list[tuple[bytes, bytes]], bytes]:
        """A whole request to a node and its whole answer (small JSON calls)."""
        response = await self._client.request(
            scope["method"],
            node.url + _target(scope),
            headers=_headers_in(scope),
            content=body,
        )
        return response.status_code, _headers_out(response), response.content

    # --- lists ------------------------------------------------------------------------------
    async def _fan_out(self, scope: Scope) -> list[tuple[NodeRef, httpx.Response]]:
        nodes = self._live()

        async def ask(node: NodeRef) -> tuple[NodeRef, httpx.Response] | None:
            try:
                response = await self._client.request(
                    "GET", node.url + _target(scope), headers=_headers_in(scope)
                )
            except httpx.TransportError:
                return None  # its sandboxes are lost; the refresh will say so
            return node, response

        answers = await asyncio.gather(*(ask(node) for node in nodes))
        found = [a for a in answers if a is not None]
        for _, response in found:
            if response.status_code != 200:
                raise _Relay(response)
        return found

    async def _list_native(self, scope: Scope, send: Send) -> None:
        try:
            answers = await self._fan_out(scope)
        except _Relay as relay:
            await _answer(send, relay.response.status_code, relay.response.content)
            return
        items = []
        for node, response in answers:
            for item in response.json():
                item["node"] = {"node_id": node.node_id, "ip": node.ip}
                items.append(item)
        items.sort(key=lambda i: (i.get("started_at", 0), i.get("sandbox_id", "")))
        await _answer(send, 200, json.dumps(items).encode())

    async def _list_e2b(self, scope: Scope, send: Send) -> None:
        try:
            answers = await self._fan_out(scope)
        except _Relay as relay:
            await _answer(send, relay.response.status_code, relay.response.content)
            return
        query = dict(
            item.split("=", 1) if "=" in item else (item, "")
            for item in scope.get("query_string", b"").decode("latin-1").split("&")
            if item
        )
        try:
            limit = int(query.get("limit", "100"))
        except ValueError:
            limit = 100
        ascending = query.get("order") == "asc"
        more = any("x-next-token" in response.headers for _, response in answers)
        items = [item for _, response in answers for item in response.json()]

        def started(item: dict[str, Any]) -> float:
            return datetime.datetime.fromisoformat(str(item["startedAt"])).timestamp()

        items.sort(key=lambda i: (started(i), str(i["sandboxID"])), reverse=not ascending)
        page, rest = items[:limit], items[limit:]
        headers: list[tuple[bytes, bytes]] = []
        if (rest or more) and page:
            last = page[-1]
            # startedAt is the start time rounded to the microsecond, and the nodes
            # compare the exact one: step a microsecond past the last item (in the
            # list's order) so that it is not listed again. (Two sandboxes started
            # within a microsecond of each other do not happen: a start takes ms.)
            moment = started(last) + (1e-6 if ascending else -1e-6)
            headers.append((b"x-next-token", _token((moment, str(last["sandboxID"]))).encode()))
        await _answer(send, 200, json.dumps(page).encode(), headers)

    # --- one sandbox ------------------------------------------------------------------------
    async def _locate(self, sandbox_id: str) -> tuple[Placement, NodeRef] | None:
        """Where ``sandbox_id`` lives (cached: a sandbox never moves; whether its node is
        lost is checked on every call, against ``self.lost``)."""
        known = self._placements.get(sandbox_id)
        if known is None:
            placement = await asyncio.to_thread(self.store.locate, sandbox_id)
            if placement is None:
                return None
            node = NodeRef(placement.node_id, placement.node_ip, placement.url, 0)
            known = (placement, node)
            if not placement.lost:
                if len(self._placements) > 1_000_000:
                    self._placements.clear()
                self._placements[sandbox_id] = known
        return known

    async def _to_sandbox(
        self, sandbox_id: str, surface: str, scope: Scope, receive: Receive, send: Send
    ) -> None:
        known = await self._locate(sandbox_id)
        if known is None:
            await self._gone(sandbox_id, None, surface, scope, send)
            return
        placement, node = known
        if placement.lost or placement.node_id in self.lost:
            self._placements.pop(sandbox_id, None)
            await self._gone(sandbox_id, placement, surface, scope, send)
            return
        if scope["method"] == "DELETE":
            # A kill (or a file's removal): the entry is not wrong after a kill (the
            # node answers that the sandbox is gone), only no longer worth its memory.
            self._placements.pop(sandbox_id, None)
        await self._forward(node, placement, surface, scope, receive, send)

    async def _gone(
        self,
        sandbox_id: str,
        placement: Placement | None,
        surface: str,
        scope: Scope,
        send: Send,
    ) -> None:
        """Answer for a sandbox no node can serve: unknown, or lost with its node."""
        if surface == _Surface.PLANE:
            # E2B's proxy wording, which the SDK reads as "sandbox gone"; the same,
            # word for word, for an unknown id and a lost one: the token cannot be
            # checked any more, so the caller may not learn that the id ever existed.
            await _answer(send, *_e2b(502, f"The sandbox {sandbox_id} was not found"))
            return
        principal = await self._authenticated(scope)
        if placement is None or placement.tenant != principal.tenant:
            if surface == _Surface.NATIVE:
                await _answer(
                    send,
                    *_native(404, "SandboxNotFound", f"sandbox {sandbox_id!r} not found"),
                )
            else:
                await _answer(send, *_e2b(404, f"sandbox {sandbox_id!r} was not found"))
            return
        message = (
            f"sandbox {sandbox_id} was lost with its node {placement.node_ip} "
            f"({placement.node_id}), which left the cluster; its files and state are gone"
        )
        if surface == _Surface.CONTROL:
            await _answer(send, *_e2b(404, f"sandbox {sandbox_id!r} was not found: {message}"))
        elif scope["method"] == "DELETE":
            await _answer(send, 204, b"")  # killing a lost sandbox: it is already gone
        else:
            await _answer(send, *_native(503, "NodeLost", message))

    async def _forward(
        self,
        node: NodeRef,
        placement: Placement | None,
        surface: str,
        scope: Scope,
        receive: Receive,
        send: Send,
    ) -> None:
        """Stream the request to ``node`` and its answer back, unchanged (but the node
        named in a native sandbox's info). The client's disconnect closes the call to
        the node, which interrupts a running cell there as it would on one machine."""
        first = await receive()
        if first["type"] == "http.disconnect":
            return
        chunk: bytes = first.get("body", b"")
        streamed = bool(first.get("more_body", False))
        method: bytes = scope["method"].encode("latin-1")
        headers = _headers_in(scope)
        try:
            _, _, host = self._pool.address(node.url)
            conn, _ = await self._pool.connection(node.url)
        except UpstreamError as exc:
            await self._unreachable(node, placement, surface, scope, send, exc)
            return
        target = _target(scope).encode("latin-1")
        try:
            if not streamed:
                # The whole request in one write: head and body.
                headers = [(k, v) for k, v in headers if k != b"content-length"]
                if chunk or method not in (b"GET", b"HEAD", b"DELETE"):
                    headers.append((b"content-length", str(len(chunk)).encode()))
                await conn.write(request_head(method, target, host, headers) + chunk)
            elif not await self._upload(conn, method, target, host, headers, chunk, receive):
                return  # the client left mid-body
            answer = await conn.head(method)
        except UpstreamError as exc:
            conn.abort()
            await self._unreachable(node, placement, surface, scope, send, exc)
            return
        info = placement is not None and surface == _Surface.NATIVE and _is_info(scope)
        await _relay_answer(conn, answer, method, node if info else None, receive, send)

    async def _socket(self, scope: Scope, receive: Receive, send: Send) -> None:
        """A sandbox's cell WebSocket (``/v1/sandboxes/{id}/cells``), relayed to its
        node message by message once the node accepted the upgrade.

        Every refusal is the same close before the handshake completes, whoever refuses
        and why (an unknown id, a lost or unreachable node, the node's own refusal of a
        key or of another tenant's sandbox): it tells a caller nothing, not even whether
        the id exists, and the SDK then sends the cell over HTTP, whose answer (the
        node's, or the front door's ``_gone``) says what is wrong."""
        if (await receive())["type"] != "websocket.connect":
            return
        match = _CELLS.match(scope["path"])
        node_socket = None
        if match is not None:
            try:
                known = await self._locate(match.group(1))
            except Exception:  # the store is down: HTTP will say so
                log.exception("cannot locate a sandbox for its cell WebSocket")
                known = None
            if known is not None and not known[0].lost and known[0].node_id not in self.lost:
                try:
                    node_socket = await self._open_socket(known[1], scope)
                except UpstreamError as exc:
                    log.info("a cell WebSocket was not relayed: %s", exc)
        if node_socket is None:
            await send({"type": "websocket.close", "code": 1008})
            return
        try:
            await send({"type": "websocket.accept"})
        except BaseException:
            node_socket.abort()
            raise
        await _relay_socket(node_socket, receive, send)

    async def _open_socket(self, node: NodeRef, scope: Scope) -> NodeSocket:
        return await NodeSocket.open(
            self._pool, node.url, _target(scope), list(scope.get("headers", ()))
        )

    async def _signed(self, scope: Scope, receive: Receive, send: Send) -> None:
        """A signed file URL (E2B's ``download_url`` / ``upload_url``) names no sandbox:
        only the node holding the sandbox whose token made the signature can check it.
        It is asked of every live node at once; the first to accept it answers, the
        others (401) are dropped. An upload's body is read whole first (it goes to
        every node; the server's body limit bounds it)."""
        body = await _read_body(receive, self.settings.max_body_bytes)
        nodes = self._live()
        if not nodes:
            raise ApiError(503, "NoCapacity", "no live sandlot node in the cluster")
        method: bytes = scope["method"].encode("latin-1")
        headers = [(k, v) for k, v in _headers_in(scope) if k != b"content-length"]
        if body or method not in (b"GET", b"HEAD", b"DELETE"):
            headers.append((b"content-length", b"%d" % len(body)))
        target = _target(scope).encode("latin-1")

        async def ask(node: NodeRef) -> tuple[NodeConnection, Answer] | None:
            try:
                _, _, host = self._pool.address(node.url)
                conn, _ = await self._pool.connection(node.url)
            except UpstreamError:
                return None  # its sandboxes are lost; the refresh will say so
            try:
                await conn.write(request_head(method, target, host, headers) + body)
                return conn, await conn.head(method)
            except UpstreamError:
                conn.abort()
                return None
            except BaseException:  # cancelled: another node took it
                conn.abort()
                raise

        asks = [asyncio.ensure_future(ask(node)) for node in nodes]
        chosen: tuple[NodeConnection, Answer] | None = None
        refused: tuple[NodeConnection, Answer] | None = None
        try:
            for done in asyncio.as_completed(asks):
                answered = await done
                if answered is None:
                    continue
                if answered[1].status != 401:
                    chosen = answered
                    break
                if refused is None:
                    refused = answered  # relayed if no node accepts the signature
                else:
                    answered[0].abort()
        finally:
            for task in asks:
                task.cancel()
            for task in asks:
                with contextlib.suppress(asyncio.CancelledError):
                    answered = await task
                    if answered is not None and answered is not chosen and answered is not refused:
                        answered[0].abort()
        picked = chosen or refused
        if chosen is not None and refused is not None:
            refused[0].abort()
        if picked is None:
            raise ApiError(503, "NodeUnreachable", "no sandlot node answers for this file URL")
        await _relay_answer(picked[0], picked[1], method, None, receive, send)

    async def _upload(
        self,
        conn: NodeConnection,
        method: bytes,
        target: bytes,
        host: bytes,
        headers: list[tuple[bytes, bytes]],
        chunk: bytes,
        receive: Receive,
    ) -> bool:
        """Stream a request body that comes in several messages; False if the client
        left first (the node's connection is dropped: the call never completes)."""
        chunked = not any(k == b"content-length" for k, _ in headers)
        if chunked:
            headers = [*headers, (b"transfer-encoding", b"chunked")]
        await conn.write(request_head(method, target, host, headers))
        while True:
            if chunk:
                await conn.write(b"%x\r\n%b\r\n" % (len(chunk), chunk) if chunked else chunk)
            message = await receive()
            if message["type"] == "http.disconnect":
                conn.abort()
                return False
            chunk = message.get("body", b"")
            if not message.get("more_body", False):
                break
        if chunk:
            await conn.write(b"%x\r\n%b\r\n" % (len(chunk), chunk) if chunked else chunk)
        if chunked:
            await conn.write(b"0\r\n\r\n")
        return True

    async def _unreachable(
        self,
        node: NodeRef,
        placement: Placement | None,
        surface: str,
        scope: Scope,
        send: Send,
        exc: Exception,
    ) -> None:
        if await asyncio.to_thread(self.directory.confirm_lost, node.node_id):
            await self._mark_lost(node.node_id)
            if placement is not None:
                await self._gone(placement.sandbox_id, placement, surface, scope, send)
                return
        message = f"sandlot node {node.ip} ({node.node_id}) does not answer: {exc}"
        if surface == _Surface.NATIVE:
            await _answer(send, *_native(503, "NodeUnreachable", message))
        else:
            await _answer(send, *_e2b(502 if surface == _Surface.PLANE else 503, message))

    # --- the cluster, for operators and tests ------------------------------------------------
    async def _cluster(self, scope: Scope, send: Send) -> None:
        await self._authenticated(scope)
        # Membership as of the last check (every ``refresh`` seconds): a request never
        # triggers one, so no client can turn its requests into load on the cluster.
        draining = await asyncio.to_thread(self.store.draining)
        live = await asyncio.to_thread(self.store.live_per_node)
        nodes: list[dict[str, Any]] = [
            {
                "node_id": n.node_id,
                "ip": n.ip,
                "slots": n.slots,
                "sandboxes": live.get(n.node_id, 0),
                "draining": draining.get(n.node_id),
                "lost": False,
            }
            for n in self._live()
        ]
        nodes += [{"node_id": node_id, "lost": True} for node_id in sorted(self.lost)]
        await _answer(send, 200, json.dumps({"nodes": nodes}).encode())


class _HeaderHolder:
    """Just enough of a Request for :func:`api_key_of`."""

    def __init__(self, headers: Headers) -> None:
        self.headers = headers


class _ClientGone(Exception):
    """The client left while its request body was being streamed to a node."""


class _Relay(Exception):
    """A node's non-200 answer to a fan-out, relayed as it is."""

    def __init__(self, response: httpx.Response) -> None:
        super().__init__(response.status_code)
        self.response = response


def _is_info(scope: Scope) -> bool:
    match = _NATIVE_ID.match(scope["path"])
    return scope["method"] == "GET" and match is not None and not match.group(2)


def _target(scope: Scope) -> str:
    path: str = scope.get("raw_path", b"").decode("latin-1") or scope["path"]
    query: bytes = scope.get("query_string", b"")
    return f"{path}?{query.decode('latin-1')}" if query else path


def _headers_in(scope: Scope) -> list[tuple[bytes, bytes]]:
    return [(k, v) for k, v in scope.get("headers", ()) if k not in _HOP]


def _headers_out(response: httpx.Response) -> list[tuple[bytes, bytes]]:
    return [(k.lower(), v) for k, v in response.headers.raw if k.lower() not in _HOP_OUT]


async def _read_body(receive: Receive, limit: int) -> bytes:
    parts: list[bytes] = []
    size = 0
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            raise _ClientGone
        part = message.get("body", b"")
        size += len(part)
        if size > limit:
            raise ApiError(
                413,
                "InvalidArgumentError",
                f"request body larger than this server accepts ({limit} bytes)",
            )
        parts.append(part)
        if not message.get("more_body", False):
            return b"".join(parts)


async def _answer(
    send: Send, status: int, body: bytes, headers: list[tuple[bytes, bytes]] | None = None
) -> None:
    out = [(k, v) for k, v in headers or () if k != b"content-length"]
    if not any(k == b"content-type" for k, _ in out) and body:
        out.append((b"content-type", b"application/json"))
    out.append((b"content-length", str(len(body)).encode()))
    await send({"type": "http.response.start", "status": status, "headers": out})
    await send({"type": "http.response.body", "body": body})


async def _relay_answer(
    conn: NodeConnection,
    answer: Answer,
    method: bytes,
    info_of: NodeRef | None,
    receive: Receive,
    send: Send,
) -> None:
    """Relay a node's answer to the client as it arrives; ``info_of``: a sandbox's info
    (read whole, its node added). The client's disconnect closes the call to the node,
    which interrupts a running cell there as it would on one machine."""
    out = [(k, v) for k, v in answer.headers if k not in _HOP_OUT]
    try:
        if info_of is not None:
            content = await answer.read(MAX_INFO)
            if answer.status == 200:
                info = json.loads(content)
                info["node"] = {"node_id": info_of.node_id, "ip": info_of.ip}
                content = json.dumps(info).encode()
            answer.release()
            await _answer(send, answer.status, content, out)
            return
        try:
            step = answer.ready()
        except UpstreamError as exc:
            # Malformed from its first byte: still a cut stream, as below.
            await send({"type": "http.response.start", "status": answer.status, "headers": out})
            raise exc
        if step is not None and step[1] and answer.has_body and method != b"HEAD":
            # The whole answer is here already (a quick cell's few lines, an error):
            # sent with its length, which saves the client a write for the end of
            # a chunked body.
            answer.release()
            out.append((b"content-length", b"%d" % len(step[0])))
            await send({"type": "http.response.start", "status": answer.status, "headers": out})
            await send({"type": "http.response.body", "body": step[0]})
            return
        await send({"type": "http.response.start", "status": answer.status, "headers": out})
        if step is not None and step[0]:
            await send({"type": "http.response.body", "body": step[0], "more_body": True})
        # The request was read whole: from now on the client's only message is its
        # disconnect, which drops the node's connection (interrupting a cell there,
        # as a client leaving does on one machine) and so ends the relay below.
        watch = asyncio.ensure_future(_drop_on_disconnect(receive, conn))
        try:
            last = False
            while not last:
                piece, last = await answer.next()
                if piece or last:
                    await send({"type": "http.response.body", "body": piece, "more_body": not last})
        finally:
            watch.cancel()
    except UpstreamError as exc:
        # The node went away mid-answer (or the client left, which closed it): end
        # the connection unfinished, so the client sees a cut stream (a cell's
        # "died"), never a complete answer.
        conn.abort()
        log.info("the stream from a node was cut: %s", exc)
        raise _ClientGone from None
    answer.release()


async def _relay_socket(node: NodeSocket, receive: Receive, send: Send) -> None:
    """Relay an accepted WebSocket both ways until either side ends it, then end the
    other: a client leaving mid-cell closes the node's WebSocket, which interrupts the
    cell there as a disconnect does on one machine. One message at a time each way: a
    client that does not read holds up ``send``, and so the reads from its node."""

    async def up() -> None:  # client -> node
        while True:
            message = await receive()
            if message["type"] != "websocket.receive":
                return  # websocket.disconnect
            text = message.get("text")
            await node.send(text if text is not None else message.get("bytes") or b"")

    async def down() -> SocketClosed:  # node -> client
        while True:
            got = await node.receive()
            if isinstance(got, SocketClosed):
                return got
            if isinstance(got, str):
                await send({"type": "websocket.send", "text": got})
            else:
                await send({"type": "websocket.send", "bytes": got})

    client = asyncio.ensure_future(up())
    server = asyncio.ensure_future(down())
    try:
        await asyncio.wait((client, server), return_when=asyncio.FIRST_COMPLETED)
    except BaseException:  # the front door shuts down
        node.abort()
        raise
    finally:
        for task in (client, server):
            if not task.done():
                task.cancel()
        for task in (client, server):
            with contextlib.suppress(BaseException):
                await task
    if server.done() and not server.cancelled() and server.exception() is None:
        # The node ended it: its code on to the client (an abrupt end, which has no
        # code on the wire, as an error).
        closed = server.result()
        node.close()
        code = 1011 if closed.code in (1005, 1006, 1015) else closed.code
        with contextlib.suppress(Exception):
            await send({"type": "websocket.close", "code": code, "reason": closed.reason})
        return
    if client.done() and not client.cancelled() and client.exception() is None:
        node.close(1001)  # the client left (or closed): the node's cell is interrupted
        return
    # A side failed: the node broke the protocol or went silent, or the client's
    # connection failed under a send. Both ends go.
    failed = server if server.done() and not server.cancelled() else client
    log.info("a relayed cell WebSocket failed: %r", failed.exception())
    node.abort()
    with contextlib.suppress(Exception):
        await send({"type": "websocket.close", "code": 1011})


async def _drop_on_disconnect(receive: Receive, conn: NodeConnection) -> None:
    """Wait for the client's disconnect; then drop the node's connection."""
    while True:
        message: Message = await receive()
        if message["type"] == "http.disconnect":
            conn.abort()
            return


def create_front_door(
    settings: ServerSettings,
    directory: Directory,
    *,
    refresh: float = 1.0,
    store_factory: Callable[[str], ClusterStore] | None = None,
) -> FrontDoor:
    """The front door's ASGI app over ``directory``'s nodes, on ``settings``' database
    (which every node must share: PostgreSQL)."""
    url = settings.resolved_database_url
    store = (store_factory or (lambda u: ClusterStore(u)))(url)
    return FrontDoor(settings, store, directory, refresh=refresh)
