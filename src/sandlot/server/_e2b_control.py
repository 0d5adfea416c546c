"""E2B's control plane, as the unmodified E2B SDKs call it in their normal mode.

With ``E2B_API_URL`` set to this server, ``Sandbox.create()``, ``Sandbox.list()``,
``Sandbox.connect(id)``, ``get_info``, ``set_timeout``, ``kill`` and ``get_metrics``
arrive here (``/v2/sandboxes``, ``/sandboxes/{id}``...), with the sandlot API key in
``X-API-Key``. Every call goes through the :class:`SandboxManager`, so tenants,
ceilings, quotas and the audit trail apply as on ``/v1``.

A sandbox created here gets an access token (E2B's ``envdAccessToken``, also handed out
as its ``trafficAccessToken``): the sandbox plane (:mod:`sandlot.server._e2b_plane`)
serves a request for the sandbox only with that token or an API key of its tenant.

Errors have E2B's shape, ``{"code": STATUS, "message": ...}``, which the SDK turns into
its exceptions (404: ``SandboxNotFoundException``, 401: ``AuthenticationException``...).
Pause (keeping memory), resume/connect, snapshots (create, list, delete, start from)
and fork work on sandboxes the server started checkpointable (``sandlot serve
--checkpointable``; docs/persistence.md); a paused sandbox keeps its access token.
Filesystem-only pauses and network updates answer 400/501 in E2B's shape.

These routes are E2B's API, described by E2B's own OpenAPI document; they are left
out of sandlot's.
"""

from __future__ import annotations

import base64
import binascii
import datetime
import hmac
import secrets
import threading
import time
import urllib.parse
from collections.abc import Callable, Coroutine, Mapping
from dataclasses import dataclass
from typing import Annotated, Any

from fastapi import APIRouter, Depends, Request, Response
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from fastapi.routing import APIRoute
from pydantic import BaseModel, ConfigDict, Field, ValidationError

import sandlot
from sandlot.server._manager import DEFAULT_MARK, ApiError, ManagedSandbox
from sandlot.server._state import ServerState, authenticate, state_of
from sandlot.server._store import Principal

ENVD_VERSION = "0.6.4"
"""The envd version sandlot answers as, which the E2B SDK gates features on. The lowest
that turns on all that sandlot serves: octet-stream and gzip uploads (0.5.7), file
metadata in ``X-Metadata-*`` headers (0.6.2), the entry of each watch event
(``include_entry``, 0.6.3) and ``allow_network_mounts`` (0.6.4: accepted; the workspace
is never a network mount). No SDK gate sits between those; see docs/e2b.md."""
CLIENT_ID = "sandlot"
DEFAULT_TIMEOUT = 300
"""E2B's default sandbox lifetime (seconds) when ``timeout`` is not sent."""
TOKEN_HEADER = "x-access-token"
TRAFFIC_TOKEN_HEADER = "e2b-traffic-access-token"
MAX_SECONDS = 2**31 - 1
"""The most seconds a timeout field takes (E2B's are int32): larger ones are refused
as bad input before they overflow a float."""


# --- the registry of tokens -----------------------------------------------------------


@dataclass(frozen=True, slots=True)
class WireRecord:
    """What the E2B wire knows of a sandbox beyond the manager: its token and the E2B
    names it was created with."""

    principal: Principal
    token: str
    template: str
    allow_internet_access: bool


class WireRegistry:
    """Access tokens of the sandboxes the E2B wire handed out, by sandbox id.

    In memory: a restart kills every sandbox anyway (see ``SandboxManager.recover``).
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._records: dict[str, WireRecord] = {}

    def add(self, sandbox_id: str, record: WireRecord) -> None:
        with self._lock:
            self._records[sandbox_id] = record

    def get(self, sandbox_id: str) -> WireRecord | None:
        with self._lock:
            return self._records.get(sandbox_id)

    def ensure(self, entry: ManagedSandbox, principal: Principal) -> WireRecord:
        """The sandbox's record, made now (with a fresh token) for a sandbox created
        elsewhere (``/v1``, the default sandbox) that an E2B client connects to."""
        with self._lock:
            record = self._records.get(entry.sandbox_id)
            if record is None:
                record = WireRecord(
                    principal=principal,
                    token=new_token(),
                    template=entry.template,
                    allow_internet_access=bool(entry.sandbox.network.allow_out),
                )
                self._records[entry.sandbox_id] = record
            return record

    def records(self) -> list[tuple[str, WireRecord]]:
        with self._lock:
            return list(self._records.items())

    def prune(self, live: set[str]) -> None:
        """Forget the sandboxes that are gone."""
        with self._lock:
            for sandbox_id in [key for key in self._records if key not in live]:
                del self._records[sandbox_id]


def new_token() -> str:
    return secrets.token_urlsafe(32)


_NO_TOKEN = new_token()
"""Compared against when the sandbox has no record, so an unknown id takes as long."""


def token_matches(record: WireRecord | None, offered: str) -> bool:
    """Constant-time; False for no record."""
    expected = record.token if record is not None else _NO_TOKEN
    return hmac.compare_digest(expected.encode(), offered.encode()) and record is not None


def registry_of(request: Request) -> WireRegistry:
    registry: WireRegistry = request.app.state.e2b_wire
    return registry


# --- errors in E2B's shape --------------------------------------------------------------


def e2b_error(status: int, message: str) -> JSONResponse:
    return JSONResponse({"code": status, "message": message}, status_code=status)


def status_of(exc: Exception, table: tuple[tuple[type[Exception], int], ...]) -> int:
    return next((code for cls, code in table if isinstance(exc, cls)), 500)


class E2bRoute(APIRoute):
    """A route whose errors answer in E2B's shape (``{"code", "message"}``)."""

    status_table: tuple[tuple[type[Exception], int], ...] = ()

    def get_route_handler(self) -> Callable[[Request], Coroutine[Any, Any, Response]]:
        handler = super().get_route_handler()
        table = self.status_table

        async def handle(request: Request) -> Response:
            try:
                return await handler(request)
            except ApiError as exc:
                return e2b_error(exc.status, exc.message)
            except RequestValidationError as exc:
                summary = "; ".join(
                    f"{'.'.join(str(p) for p in item.get('loc', ()))}: {item.get('msg', '')}"
                    for item in exc.errors()
                )
                return e2b_error(400, f"invalid request: {summary}")
            except sandlot.SandlotError as exc:
                return e2b_error(status_of(exc, table), f"{type(exc).__name__}: {exc}")

        return handle


# --- request bodies -----------------------------------------------------------------------


class _Loose(BaseModel):
    # E2B's bodies grow fields; the ones sandlot cannot honour are checked by name.
    model_config = ConfigDict(extra="allow", populate_by_name=True)


class NewSandbox(_Loose):
    template_id: str = Field(..., alias="templateID", min_length=1, max_length=256)
    timeout: int | None = Field(None, ge=1, le=MAX_SECONDS)
    metadata: dict[str, str] | None = None
    env_vars: dict[str, str] | None = Field(None, alias="envVars")
    allow_internet_access: bool | None = None
    auto_pause: bool | None = Field(None, alias="autoPause")
    secure: bool | None = None
    network: dict[str, Any] | None = None


class Timeout(_Loose):
    timeout: int = Field(..., ge=0, le=MAX_SECONDS)


class ConnectBody(_Loose):
    timeout: int | None = Field(None, ge=0, le=MAX_SECONDS)


class PauseBody(_Loose):
    memory: bool | None = None


class SnapshotBody(_Loose):
    name: str | None = Field(None, max_length=200)
    memory: bool | None = None


class ForkBody(_Loose):
    timeout: int | None = Field(None, ge=1, le=MAX_SECONDS)
    count: int | None = Field(None, ge=1, le=20)


def _memory_only(memory: bool | None) -> None:
    if memory is False:
        raise ApiError(
            400,
            "InvalidArgumentError",
            "sandlot pauses and snapshots keep memory (mode='full'); filesystem-only ones "
            "are not offered",
        )


_UNSUPPORTED = {
    "iam": "IAM tokens",
    "volumeMounts": "volumes",
}


def _body(model: type[BaseModel], raw: Any) -> Any:
    try:
        return model.model_validate(raw)
    except ValidationError as exc:
        summary = "; ".join(
            f"{'.'.join(str(p) for p in item['loc'])}: {item['msg']}" for item in exc.errors()
        )
        raise ApiError(400, "InvalidArgumentError", f"invalid request: {summary}") from None


async def _json(request: Request) -> Any:
    body = await request.body()
    if not body:
        return {}
    try:
        return await request.json()
    except ValueError:
        raise ApiError(400, "InvalidArgumentError", "the body must be JSON") from None


# --- answers ----------------------------------------------------------------------------


def _iso(moment: float) -> str:
    return datetime.datetime.fromtimestamp(moment, datetime.UTC).isoformat()


_EPOCH = datetime.datetime(1970, 1, 1, tzinfo=datetime.UTC)
_MICROSECOND = datetime.timedelta(microseconds=1)


def _micros(moment: float | datetime.datetime) -> int:
    """A time in whole microseconds, rounded as :func:`_iso` reports it: a client that
    passes a sandbox's reported start back gets that sandbox (``round(t * 1e6)`` of the
    float disagrees with the datetime's rounding for about one time in sixteen)."""
    if not isinstance(moment, datetime.datetime):
        moment = datetime.datetime.fromtimestamp(moment, datetime.UTC)
    return (moment - _EPOCH) // _MICROSECOND


def _listed(entry: ManagedSandbox, record: WireRecord | None) -> dict[str, Any]:
    resources = entry.resources
    template = record.template if record else entry.template
    return {
        "templateID": template,
        "alias": template,
        "sandboxID": entry.sandbox_id,
        "clientID": CLIENT_ID,
        "startedAt": _iso(entry.created_at),
        "endAt": _iso(entry.expires_at),
        "envdVersion": ENVD_VERSION,
        "cpuCount": int(resources.cpus or 1),
        "memoryMB": int(resources.memory_mb or 0),
        "diskSizeMB": int(resources.disk_mb or 0),
        "state": "running",
        "metadata": {k: v for k, v in entry.metadata.items() if k != DEFAULT_MARK},
    }


def _paused(record: Mapping[str, Any]) -> dict[str, Any]:
    """A paused sandbox as E2B lists it (from its owner's record)."""
    resources = record.get("resources") or {}
    moment = _iso(float(record.get("created_at") or record.get("paused_at") or 0))
    template = str((record.get("wire") or {}).get("template") or record.get("template"))
    return {
        "templateID": template,
        "alias": template,
        "sandboxID": record.get("id"),
        "clientID": CLIENT_ID,
        "startedAt": moment,
        "endAt": moment,
        "envdVersion": ENVD_VERSION,
        "cpuCount": int(resources.get("cpus") or 1),
        "memoryMB": int(resources.get("memory_mb") or 0),
        "diskSizeMB": int(resources.get("disk_mb") or 0),
        "state": "paused",
        "metadata": {k: v for k, v in (record.get("metadata") or {}).items() if k != DEFAULT_MARK},
    }


def _detail(entry: ManagedSandbox, record: WireRecord) -> dict[str, Any]:
    return {
        **_listed(entry, record),
        "envdAccessToken": record.token,
        "allowInternetAccess": bool(entry.sandbox.network.allow_out),
        "domain": None,
    }


def _created(entry: ManagedSandbox, record: WireRecord) -> dict[str, Any]:
    return {
        "templateID": record.template,
        "alias": record.template,
        "sandboxID": entry.sandbox_id,
        "clientID": CLIENT_ID,
        "envdVersion": ENVD_VERSION,
        "envdAccessToken": record.token,
        "trafficAccessToken": record.token,
        "domain": None,
    }


# --- the routes ---------------------------------------------------------------------------

Auth = Annotated[Principal, Depends(authenticate)]


def resolve_template(aliases: dict[str, str], name: str) -> str:
    """The sandlot template an E2B template name runs (404 in E2B's shape if none)."""
    base = name.split(":", 1)[0]  # E2B names may carry a :tag
    if base in aliases:
        return aliases[base]
    if base in aliases.values():
        return base
    known = ", ".join(sorted(aliases)) or "none"
    raise ApiError(
        404,
        "TemplateNotFound",
        f"template {name!r} not found: this sandlot server maps these E2B template names: "
        f"{known} (operators add more with sandlot serve --e2b-template NAME=TEMPLATE)",
    )


def _network(state: ServerState, principal: Principal, body: NewSandbox) -> dict[str, Any] | None:
    """E2B's internet switch on sandlot's egress: on (E2B's default) is whatever the
    tenant may reach (its allowlist, else the server's ceiling); off is no network."""
    if body.allow_internet_access is False:
        return None
    allowed = state.store.tenant_egress(principal.tenant)
    if allowed is None:
        allowed = list(state.settings.egress.allow_out)
    network = dict(body.network or {})
    if network.get("allowPublicTraffic") is False:
        del network["allowPublicTraffic"]  # nothing reaches a sandlot sandbox from outside
    unknown = sorted(set(network) - {"allowOut", "denyOut"})
    if unknown:
        raise ApiError(
            400,
            "InvalidArgumentError",
            f"network options not supported by sandlot: {', '.join(unknown)} "
            "(it takes allowOut and denyOut)",
        )
    if "allowOut" in network or "denyOut" in network:
        # allowOut left out: what the tenant may reach, less denyOut.
        allow_out = network.get("allowOut")
        wanted = {
            "allow_out": list(allowed if allow_out is None else allow_out),
            "deny_out": list(network.get("denyOut") or []),
        }
        return wanted if wanted["allow_out"] else None
    if not allowed:
        if body.allow_internet_access:
            raise ApiError(
                400,
                "PolicyError",
                f"allow_internet_access=True, but this server allows tenant "
                f"{principal.tenant!r} no network destinations (the operator grants them "
                "with sandlot serve --egress-allow or sandlot keys create --egress-allow)",
            )
        return None
    return {"allow_out": allowed}


def _not_implemented(what: str) -> ApiError:
    return ApiError(
        501,
        "NotImplemented",
        f"{what} is not implemented by sandlot yet; kill the sandbox and create a new one instead",
    )


def control_router(status_table: tuple[tuple[type[Exception], int], ...]) -> APIRouter:
    route_class = type("E2bControlRoute", (E2bRoute,), {"status_table": status_table})
    router = APIRouter(route_class=route_class, include_in_schema=False)

    def exc_status(exc: Exception) -> int:
        if isinstance(exc, ApiError):
            return exc.status
        return status_of(exc, status_table)

    def owned(request: Request, principal: Principal, sandbox_id: str) -> ManagedSandbox:
        try:
            return state_of(request).manager.get(principal, sandbox_id)
        except ApiError as exc:
            raise ApiError(404, exc.type, f"sandbox {sandbox_id!r} was not found") from None

    @router.post("/sandboxes", status_code=201)
    @router.post("/v2/sandboxes", status_code=201)
    async def create(request: Request, principal: Auth) -> JSONResponse:
        state = state_of(request)
        registry = registry_of(request)
        raw = await _json(request)
        body: NewSandbox = _body(NewSandbox, raw)
        if raw.get("mcp"):
            # The E2B SDK starts its MCP gateway itself after the create and reports a
            # failure as "Failed to start MCP gateway: ..."; code written for E2B matches
            # on that text. sandlot refuses before any sandbox exists, so none is left.
            raise ApiError(
                400,
                "InvalidArgumentError",
                "Failed to start MCP gateway: sandlot sandboxes run no MCP gateway "
                "(create the sandbox without mcp=)",
            )
        unsupported = [label for key, label in _UNSUPPORTED.items() if raw.get(key)]
        resume = raw.get("autoResume")
        if isinstance(resume, dict) and resume.get("enabled"):
            unsupported.append(
                "auto-resume on a request to the sandbox (nothing reaches a sandlot sandbox "
                "from outside; a paused sandbox resumes on connect)"
            )
        if body.auto_pause and not state.settings.checkpointable:
            unsupported.append("auto-pause on a server not started with --checkpointable")
        if body.auto_pause and raw.get("autoPauseMemory") is False:
            unsupported.append("filesystem-only auto-pause (sandlot pauses keep memory)")
        if unsupported:
            raise ApiError(
                400, "InvalidArgumentError", f"not supported by sandlot: {', '.join(unsupported)}"
            )
        snapshot = body.template_id if sandlot.is_snapshot_id(body.template_id) else None
        template = snapshot or resolve_template(
            dict(state.settings.e2b_templates), body.template_id
        )
        started = time.monotonic()
        entry = await state.blocking(
            state.manager.create,
            principal,
            template=template,
            timeout=float(body.timeout if body.timeout is not None else DEFAULT_TIMEOUT),
            envs=body.env_vars or {},
            metadata=body.metadata or {},
            resources=None,
            network=None if snapshot else _network(state, principal, body),
            snapshot=snapshot,
            auto_pause=bool(body.auto_pause),
        )
        state.metrics.sandboxes_created.inc()
        state.metrics.sandbox_start_seconds.observe(time.monotonic() - started)
        record = WireRecord(
            principal=principal,
            token=new_token(),
            template=body.template_id,
            allow_internet_access=bool(entry.sandbox.network.allow_out),
        )
        registry.add(entry.sandbox_id, record)
        entry.wire = {"token": record.token, "template": record.template}
        registry.prune({e.sandbox_id for e in state.manager.all()})
        return JSONResponse(_created(entry, record), status_code=201)

    @router.get("/sandboxes")
    @router.get("/v2/sandboxes")
    async def list_(
        request: Request,
        principal: Auth,
        metadata: str | None = None,
        state: str | None = None,
        limit: int = 100,
        nextToken: str | None = None,  # E2B's parameter name
        order: str | None = None,
        template: str | None = None,
        startedAfter: str | None = None,  # E2B's parameter name
    ) -> JSONResponse:
        if limit < 1 or limit > 1000:
            raise ApiError(400, "InvalidArgumentError", "limit must be between 1 and 1000")
        if order not in (None, "asc", "desc"):
            raise ApiError(400, "InvalidArgumentError", "order must be 'asc' or 'desc'")
        states = {s.strip() for s in (state or "running,paused").split(",") if s.strip()}
        unknown = states - {"running", "paused"}
        if unknown:
            raise ApiError(400, "InvalidArgumentError", f"unknown state(s) {sorted(unknown)}")
        wanted = _metadata_filter(metadata)
        after = _moment(startedAfter, "startedAfter")
        after_us = None if after is None else _micros(after)
        registry = registry_of(request)
        manager = state_of(request).manager
        # (start time, id, as listed): running sandboxes and, asked for, paused ones.
        items: list[tuple[float, str, dict[str, Any]]] = [
            (e.created_at, e.sandbox_id, _listed(e, registry.get(e.sandbox_id)))
            for e in manager.owned_by(principal)
            if "running" in states
            and all(e.metadata.get(k) == v for k, v in wanted.items())
            and (template is None or template in (e.template, _template_of(registry, e)))
        ]
        if "paused" in states:
            for r in manager.checkpoints_of(principal, "pause"):
                listed = _paused(r)
                labels = r.get("metadata") or {}
                if all(labels.get(k) == v for k, v in wanted.items()) and (
                    template is None or template in (r.get("template"), listed["templateID"])
                ):
                    items.append((float(r.get("created_at") or 0), str(r.get("id")), listed))
        # At the microsecond precision of the start time E2B's API reports.
        items = [i for i in items if after_us is None or _micros(i[0]) >= after_us]
        reverse = order != "asc"  # newest first unless asked otherwise
        items.sort(key=lambda i: (i[0], i[1]), reverse=reverse)
        if nextToken:
            cursor = _cursor(nextToken)
            # The items after the cursor in this order: a sandbox that ended since the
            # last page does not shift the next one.
            items = [
                i for i in items if ((i[0], i[1]) < cursor if reverse else (i[0], i[1]) > cursor)
            ]
        page, rest = items[:limit], items[limit:]
        headers = {}
        if rest:
            headers["X-Next-Token"] = _token((page[-1][0], page[-1][1]))
        return JSONResponse([i[2] for i in page], headers=headers)

    @router.get("/sandboxes/{sandbox_id}")
    async def get_info(request: Request, principal: Auth, sandbox_id: str) -> JSONResponse:
        paused = state_of(request).manager.paused(principal, sandbox_id)
        if paused is not None:
            return JSONResponse(_paused(paused))
        entry = owned(request, principal, sandbox_id)
        record = registry_of(request).ensure(entry, principal)
        return JSONResponse(_detail(entry, record))

    @router.delete("/sandboxes/{sandbox_id}", status_code=204)
    async def kill(request: Request, principal: Auth, sandbox_id: str) -> Response:
        state = state_of(request)
        if await state.blocking(state.manager.kill_paused, principal, sandbox_id):
            return Response(status_code=204)  # a paused one: its checkpoint is gone
        entry = owned(request, principal, sandbox_id)
        state.manager.kill(entry, "killed")  # its processes are reaped in the background
        return Response(status_code=204)

    @router.post("/sandboxes/{sandbox_id}/timeout", status_code=204)
    async def set_timeout(request: Request, principal: Auth, sandbox_id: str) -> Response:
        body: Timeout = _body(Timeout, await _json(request))
        entry = owned(request, principal, sandbox_id)
        state_of(request).manager.set_timeout(entry, float(body.timeout) or None)
        return Response(status_code=204)

    @router.post("/sandboxes/{sandbox_id}/refreshes", status_code=204)
    async def refresh(request: Request, principal: Auth, sandbox_id: str) -> Response:
        """Keep-alive: extends the sandbox by ``duration`` seconds (E2B's default 60)."""
        raw = await _json(request)
        duration = raw.get("duration", 60) if isinstance(raw, dict) else 60
        if (
            isinstance(duration, bool)
            or not isinstance(duration, int)
            or not 0 <= duration <= MAX_SECONDS
        ):
            raise ApiError(
                400,
                "InvalidArgumentError",
                f"duration must be whole seconds from 0 to {MAX_SECONDS}",
            )
        entry = owned(request, principal, sandbox_id)
        _extend(request, entry, duration)
        return Response(status_code=204)

    @router.post("/sandboxes/{sandbox_id}/connect")
    @router.post("/v2/sandboxes/{sandbox_id}/connect")
    @router.post("/sandboxes/{sandbox_id}/resume")
    async def connect(request: Request, principal: Auth, sandbox_id: str) -> JSONResponse:
        """A running sandbox: its token, and its life extended to ``timeout`` seconds
        from now if that is later than its end (200). A paused one: resumed, with the
        token it had (201)."""
        body: ConnectBody = _body(ConnectBody, await _json(request))
        state = state_of(request)
        registry = registry_of(request)
        paused = state.manager.paused(principal, sandbox_id)
        if paused is not None:
            timeout = float(body.timeout) if body.timeout else float(DEFAULT_TIMEOUT)
            entry = await state.blocking(state.manager.resume, principal, sandbox_id, timeout)
            wire = paused.get("wire") or {}
            record = WireRecord(
                principal=principal,
                token=str(wire.get("token") or new_token()),
                template=str(wire.get("template") or entry.template),
                allow_internet_access=False,
            )
            registry.add(entry.sandbox_id, record)
            return JSONResponse(_created(entry, record), status_code=201)
        entry = owned(request, principal, sandbox_id)
        if body.timeout:
            _extend(request, entry, body.timeout)
        record = registry.ensure(entry, principal)
        return JSONResponse(_created(entry, record), status_code=200)

    @router.get("/sandboxes/{sandbox_id}/metrics")
    async def metrics(
        request: Request,
        principal: Auth,
        sandbox_id: str,
        start: int | None = None,
        end: int | None = None,
    ) -> JSONResponse:
        entry = owned(request, principal, sandbox_id)
        return JSONResponse(await state_of(request).blocking(_metrics, entry, start, end))

    @router.post("/sandboxes/{sandbox_id}/pause", status_code=204)
    async def pause(request: Request, principal: Auth, sandbox_id: str) -> Response:
        body: PauseBody = _body(PauseBody, await _json(request))
        _memory_only(body.memory)
        state = state_of(request)
        if state.manager.paused(principal, sandbox_id) is not None:
            raise ApiError(409, "AlreadyPaused", f"sandbox {sandbox_id!r} is paused already")
        entry = owned(request, principal, sandbox_id)
        record = registry_of(request).ensure(entry, principal)
        entry.wire = {"token": record.token, "template": record.template}
        await state.blocking(state.manager.pause, entry)
        return Response(status_code=204)

    @router.post("/sandboxes/{sandbox_id}/snapshots", status_code=201)
    async def snapshot(request: Request, principal: Auth, sandbox_id: str) -> JSONResponse:
        body: SnapshotBody = _body(SnapshotBody, await _json(request))
        _memory_only(body.memory)
        state = state_of(request)
        entry = owned(request, principal, sandbox_id)
        info = await state.blocking(state.manager.create_snapshot, entry, body.name)
        return JSONResponse({"snapshotID": info.snapshot_id, "names": info.names}, 201)

    @router.get("/snapshots")
    async def snapshots(
        request: Request,
        principal: Auth,
        sandboxID: str | None = None,  # E2B's parameter names
        name: str | None = None,
        limit: int = 100,
        nextToken: str | None = None,
    ) -> JSONResponse:
        if limit < 1 or limit > 1000:
            raise ApiError(400, "InvalidArgumentError", "limit must be between 1 and 1000")
        found = [
            r
            for r in state_of(request).manager.checkpoints_of(principal, "snapshot")
            if (sandboxID is None or r.get("sandbox_id") == sandboxID)
            and (name is None or r.get("name") == name)
        ]
        found.sort(key=lambda r: (float(r.get("created") or 0), str(r.get("id"))))
        if nextToken:
            found = [r for r in found if str(r.get("id")) > nextToken]
        page, rest = found[:limit], found[limit:]
        headers = {"X-Next-Token": str(page[-1]["id"])} if rest else {}
        return JSONResponse(
            [{"snapshotID": r["id"], "names": [r["name"]] if r.get("name") else []} for r in page],
            headers=headers,
        )

    @router.delete("/templates/{template_id}", status_code=204)
    async def delete_snapshot(request: Request, principal: Auth, template_id: str) -> Response:
        """Only snapshots are templates a tenant can delete here."""
        state = state_of(request)
        if not await state.blocking(state.manager.delete_snapshot, principal, template_id):
            raise ApiError(404, "NotFound", f"snapshot {template_id!r} was not found")
        return Response(status_code=204)

    @router.post("/sandboxes/{sandbox_id}/fork", status_code=201)
    async def fork(request: Request, principal: Auth, sandbox_id: str) -> JSONResponse:
        body: ForkBody = _body(ForkBody, await _json(request))
        state = state_of(request)
        registry = registry_of(request)
        entry = owned(request, principal, sandbox_id)
        timeout = float(body.timeout if body.timeout is not None else DEFAULT_TIMEOUT)
        copies = await state.blocking(state.manager.fork, entry, body.count or 1, timeout)
        parent = registry.ensure(entry, principal)
        out: list[dict[str, Any]] = []
        for copy in copies:
            if isinstance(copy, Exception):
                code = exc_status(copy)
                out.append({"error": {"code": code, "message": f"{type(copy).__name__}: {copy}"}})
                continue
            record = WireRecord(
                principal=principal,
                token=new_token(),
                template=parent.template,
                allow_internet_access=False,
            )
            registry.add(copy.sandbox_id, record)
            out.append({"sandbox": _created(copy, record)})
        return JSONResponse(out, status_code=201)

    @router.put("/sandboxes/{sandbox_id}/network")
    async def network(principal: Auth, sandbox_id: str) -> None:
        raise _not_implemented("changing a running sandbox's network")

    _ = (create, list_, get_info, kill, set_timeout, refresh, connect, metrics)
    _ = (pause, snapshot, snapshots, delete_snapshot, fork, network)
    return router


def _template_of(registry: WireRegistry, entry: ManagedSandbox) -> str | None:
    record = registry.get(entry.sandbox_id)
    return record.template if record else None


def _extend(request: Request, entry: ManagedSandbox, seconds: int) -> None:
    """Make the sandbox live at least ``seconds`` more (never shortens it)."""
    if time.time() + seconds > entry.expires_at:
        state_of(request).manager.set_timeout(entry, float(seconds))


def _moment(raw: str | None, name: str) -> datetime.datetime | None:
    """An ISO 8601 time from a query (a naive one is UTC)."""
    if raw is None:
        return None
    try:
        moment = datetime.datetime.fromisoformat(raw.replace("Z", "+00:00"))
    except ValueError:
        raise ApiError(400, "InvalidArgumentError", f"{name} must be an ISO 8601 time") from None
    if moment.tzinfo is None:
        moment = moment.replace(tzinfo=datetime.UTC)
    return moment


def _metadata_filter(raw: str | None) -> dict[str, str]:
    """E2B's ``metadata`` query: ``k=v&k2=v2``, keys and values each percent-encoded."""
    if not raw:
        return {}
    try:
        pairs = urllib.parse.parse_qsl(raw, keep_blank_values=True, strict_parsing=True)
    except ValueError:
        raise ApiError(400, "InvalidArgumentError", "metadata must be k=v pairs") from None
    return {urllib.parse.unquote(k): urllib.parse.unquote(v) for k, v in pairs}


def _token(cursor: tuple[float, str]) -> str:
    return base64.urlsafe_b64encode(f"{cursor[0]!r}|{cursor[1]}".encode()).decode()


def _cursor(token: str) -> tuple[float, str]:
    try:
        started, _, sandbox_id = base64.urlsafe_b64decode(token.encode()).decode().partition("|")
        return float(started), sandbox_id
    except (ValueError, binascii.Error, UnicodeDecodeError):
        raise ApiError(400, "InvalidArgumentError", "invalid nextToken") from None


def _metrics(
    entry: ManagedSandbox, start: int | None = None, end: int | None = None
) -> list[dict[str, Any]]:
    """One sample from the sandbox's cgroup: memory is the peak since start, CPU the
    average since start; disk use is not measured (0). Empty where the backend cannot
    measure, or where the asked range (E2B's ``start``/``end``, Unix seconds) misses
    the sandbox's life so far; the sample is stamped at the range's end if that is
    earlier than now."""
    now = time.time()
    if start is not None and end is not None and start > end:
        raise ApiError(400, "InvalidArgumentError", "start must not be after end")
    if (end is not None and end < int(entry.created_at)) or (start is not None and start > now):
        return []
    handle = entry.sandbox.handle
    usage = handle.usage() if handle is not None else None
    if usage is None:
        return []
    stamp = now if end is None else max(min(now, float(end)), entry.created_at)
    cpus = float(entry.resources.cpus or 1)
    elapsed = max(now - entry.created_at, 1e-3)
    cpu_pct = 100.0 * (usage.cpu_seconds or 0.0) / (elapsed * cpus)
    return [
        {
            "timestamp": _iso(stamp),
            "timestampUnix": int(stamp),
            "cpuCount": int(cpus),
            "cpuUsedPct": round(min(cpu_pct, 100.0), 2),
            "memUsed": int(usage.memory_peak_bytes or 0),
            "memTotal": int(usage.memory_limit_bytes or (entry.resources.memory_mb or 0) << 20),
            "memCache": 0,
            "diskUsed": 0,
            "diskTotal": int(entry.resources.disk_mb or 0) << 20,
        }
    ]
