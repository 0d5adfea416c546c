"""Chat with your data in the web app: the data-analysis agent (:mod:`sandlot.agent`)
driven from a browser, each cell shown for approval before it runs.

The agent is one more client of this server: its sandbox is made and used through
``/v1`` on loopback with the signed-in session's key (the SDK's remote mode), so the
tenant's quotas, ceilings and audit trail apply to its cells as to any other.

Configured from the environment when the server starts (off unless a provider is
named): ``SANDLOT_CHAT_PROVIDER`` (``openai``: OpenAI or any compatible server;
``anthropic``), ``SANDLOT_CHAT_MODEL``, ``SANDLOT_CHAT_BASE_URL``; the provider's own
key variable (``OPENAI_API_KEY``, ``ANTHROPIC_API_KEY``).
"""

from __future__ import annotations

import asyncio
import logging
import os
import re
import secrets
import tempfile
import threading
import time
from collections.abc import Callable, Mapping
from concurrent.futures import Future
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any, Literal

from fastapi import APIRouter, Query, Request
from fastapi.responses import StreamingResponse
from pydantic import BaseModel, ConfigDict, Field

from sandlot import InvalidArgumentError, SandlotError
from sandlot.server._cells import error_dict, exception_message, jsonable, ndjson, result_message
from sandlot.server._manager import ApiError
from sandlot.server._state import state_of
from sandlot.server._store import Principal
from sandlot.server._ui_session import SignedIn

if TYPE_CHECKING:
    from sandlot.agent import CellReview, DataAgent, Decision, Provider, Step

log = logging.getLogger("sandlot.server")

PROVIDERS = ("openai", "anthropic")
REVIEW_WAIT = 600.0
"""Seconds a cell waits for the user's decision before it is refused."""
MAX_CHATS_PER_TENANT = 8
MAX_QUESTION = 8000


@dataclass(frozen=True)
class ChatConfig:
    provider: Literal["openai", "anthropic"]
    model: str | None = None
    base_url: str | None = None

    @classmethod
    def from_env(cls, environ: Mapping[str, str] = os.environ) -> ChatConfig | None:
        """The chat's model provider, or None when ``SANDLOT_CHAT_PROVIDER`` is unset.
        A provider this server does not know is an error (fail closed, say how)."""
        name = environ.get("SANDLOT_CHAT_PROVIDER", "").strip().lower()
        if not name:
            return None
        if name not in PROVIDERS:
            raise InvalidArgumentError(
                f"SANDLOT_CHAT_PROVIDER={name!r}: use one of {', '.join(PROVIDERS)} "
                "(or unset it to turn the web app's chat off)"
            )
        return cls(
            provider="anthropic" if name == "anthropic" else "openai",
            model=environ.get("SANDLOT_CHAT_MODEL") or None,
            base_url=environ.get("SANDLOT_CHAT_BASE_URL") or None,
        )

    def make_provider(self) -> Provider:
        from sandlot.agent import AnthropicProvider, OpenAIProvider

        kwargs: dict[str, Any] = {"base_url": self.base_url}
        if self.provider == "anthropic":
            if self.model:
                return AnthropicProvider(self.model, **kwargs)
            return AnthropicProvider(**kwargs)
        if self.model:
            return OpenAIProvider(self.model, **kwargs)
        return OpenAIProvider(**kwargs)


@dataclass
class _Review:
    done: threading.Event = field(default_factory=threading.Event)
    decision: Decision | None = None


@dataclass
class Chat:
    chat_id: str
    tenant: str
    agent: DataAgent
    busy: threading.Lock = field(default_factory=threading.Lock)
    reviews: dict[str, _Review] = field(default_factory=dict)
    created: float = field(default_factory=time.time)

    def close(self) -> None:
        for review in list(self.reviews.values()):
            review.done.set()  # refused: nobody is left to decide
        self.agent.close()  # kills its sandbox


class Chats:
    def __init__(self, config: ChatConfig | None) -> None:
        self.config = config
        self._lock = threading.Lock()
        self._items: dict[str, Chat] = {}

    def add(self, chat: Chat) -> None:
        with self._lock:
            self._items[chat.chat_id] = chat

    def make_room(self, tenant: str) -> Chat | None:
        """At the tenant's limit, take out its oldest chat that is not answering (a page
        closed without ending its chat leaves one) and return it, to be closed; raise
        when every one is busy."""
        with self._lock:
            own = [chat for chat in self._items.values() if chat.tenant == tenant]
            if len(own) < MAX_CHATS_PER_TENANT:
                return None
            idle = [chat for chat in own if not chat.busy.locked()]
            if not idle:
                raise ApiError(
                    429, "QuotaExceeded", f"at most {MAX_CHATS_PER_TENANT} chats answering at once"
                )
            oldest = min(idle, key=lambda chat: chat.created)
            del self._items[oldest.chat_id]
            return oldest

    def get(self, principal: Principal, chat_id: str) -> Chat:
        with self._lock:
            chat = self._items.get(chat_id)
        if chat is None or chat.tenant != principal.tenant:
            raise ApiError(404, "NotFoundError", f"no chat {chat_id!r}")
        return chat

    def pop(self, principal: Principal, chat_id: str) -> Chat:
        chat = self.get(principal, chat_id)
        with self._lock:
            self._items.pop(chat_id, None)
        return chat


class Ask(BaseModel):
    model_config = ConfigDict(extra="forbid")
    question: str = Field(..., min_length=1, max_length=MAX_QUESTION)
    review: bool = True
    """Show each cell for a decision before it runs (False: run them all)."""


class Decide(BaseModel):
    model_config = ConfigDict(extra="forbid")
    review_id: str = Field(..., min_length=1, max_length=64)
    action: Literal["allow", "edit", "refuse"]
    code: str | None = Field(None, max_length=1_000_000)
    reason: str = Field("not approved", max_length=1000)


def _thread(fn: Callable[[], Any]) -> Future[Any]:
    """Run ``fn`` on a thread of its own: an agent blocks for as long as its model and
    its user take, and must not hold the server's worker threads (its own API calls
    need them)."""
    future: Future[Any] = Future()

    def run() -> None:
        if future.set_running_or_notify_cancel():
            try:
                future.set_result(fn())
            except BaseException as exc:
                future.set_exception(exc)

    threading.Thread(target=run, name="sandlot-ui-chat", daemon=True).start()
    return future


class _OwnThreads:
    """An ``Executor`` for :func:`ndjson` that gives every stream its own thread."""

    def submit(self, fn: Callable[..., Any], /, *args: Any, **kwargs: Any) -> Future[Any]:
        return _thread(lambda: fn(*args, **kwargs))


def _self_url(request: Request) -> str:
    """This server as a loopback client reaches it: the socket the request came in on."""
    server = request.scope.get("server")
    if not server or server[1] is None:  # e.g. served on a unix socket
        raise ApiError(
            503, "ChatUnavailable", "the chat needs the server on a TCP port it can call itself"
        )
    host, port = server[0], server[1]
    if host in ("0.0.0.0", "::"):
        host = "127.0.0.1" if host == "0.0.0.0" else "::1"
    return f"http://[{host}]:{port}" if ":" in host else f"http://{host}:{port}"


def _step_message(step: Step) -> dict[str, Any]:
    execution = step.execution
    message: dict[str, Any] = {
        "type": "step",
        "requested": step.requested,
        "code": step.code,
        "decision": step.decision.action,
        "reason": step.decision.reason,
    }
    if execution is not None:
        message.update(
            status=execution.status,
            duration=execution.duration,
            stdout="".join(execution.logs.stdout),
            stderr="".join(execution.logs.stderr),
            results=[result_message(result) for result in execution.results],
            error=error_dict(execution.error),
            precheck=jsonable(step.precheck),
        )
    return message


def chat_router(chats: Chats) -> APIRouter:
    """The chat's routes under ``/ui/api/chat``, behind the web app's session check."""
    router = APIRouter(prefix="/ui/api/chat", include_in_schema=False)

    def configured() -> ChatConfig:
        if chats.config is None:
            raise ApiError(
                503,
                "ChatUnavailable",
                "no model provider is configured: start the server with "
                "SANDLOT_CHAT_PROVIDER=openai|anthropic (and the provider's key)",
            )
        return chats.config

    @router.get("")
    async def chat_info(signed: SignedIn) -> dict[str, Any]:
        config = chats.config
        return {
            "available": config is not None,
            "provider": None if config is None else config.provider,
            "model": None if config is None else config.model,
        }

    @router.post("", status_code=201)
    async def start_chat(request: Request, signed: SignedIn) -> dict[str, Any]:
        config = configured()
        principal, session = signed
        evicted = chats.make_room(principal.tenant)
        if evicted is not None:
            await asyncio.wrap_future(_thread(evicted.close))
        url = _self_url(request)

        def start() -> Chat:
            from sandlot import Sandbox
            from sandlot.agent import DataAgent

            provider = config.make_provider()
            sandbox = Sandbox("python-data", api_url=url, api_key=session.key, timeout=None)
            try:
                agent = DataAgent(provider, sandbox)
            except BaseException:
                sandbox.kill()
                raise
            return Chat(secrets.token_urlsafe(16), principal.tenant, agent)

        chat: Chat = await asyncio.wrap_future(_thread(start))
        chats.add(chat)
        return {"chat_id": chat.chat_id, "sandbox_id": chat.agent.sandbox.sandbox_id}

    @router.delete("/{chat_id}", status_code=204)
    async def end_chat(chat_id: str, signed: SignedIn) -> None:
        chat = chats.pop(signed[0], chat_id)
        await asyncio.wrap_future(_thread(chat.close))

    @router.post("/{chat_id}/files")
    async def load_data(
        request: Request,
        chat_id: str,
        signed: SignedIn,
        name: Annotated[str, Query(min_length=1, max_length=255)],
    ) -> dict[str, Any]:
        """Load a CSV or Excel file (the body) as the next DataFrame (``df``, ``df2``...)."""
        chat = chats.get(signed[0], chat_id)
        # The agent loads from a host path whose name the model is told: a private
        # folder in the system's temporary directory (not the server's spool, which a
        # restart empties file by file), removed once the file is in the sandbox.
        safe = re.sub(r"[^A-Za-z0-9._-]", "_", Path(name).name).lstrip(".") or "data.csv"
        with tempfile.TemporaryDirectory(prefix="sandlot-ui-chat-") as folder:
            target = Path(folder) / safe
            limit = state_of(request).settings.max_upload_bytes
            size = 0
            with target.open("wb") as handle:
                async for chunk in request.stream():
                    size += len(chunk)
                    if size > limit:
                        raise ApiError(413, "InvalidArgumentError", f"larger than {limit} bytes")
                    handle.write(chunk)

            def load() -> dict[str, Any]:
                with chat.busy:
                    dataset = chat.agent.load(target)
                return {
                    "name": dataset.name,
                    "path": dataset.path,
                    "rows": dataset.rows,
                    "kept": dataset.kept,
                    "columns": [list(column) for column in dataset.columns],
                }

            result: dict[str, Any] = await asyncio.wrap_future(_thread(load))
        return result

    @router.post("/{chat_id}/decide", status_code=204)
    async def decide(chat_id: str, body: Decide, signed: SignedIn) -> None:
        from sandlot.agent import Decision

        chat = chats.get(signed[0], chat_id)
        review = chat.reviews.get(body.review_id)
        if review is None or review.done.is_set():
            raise ApiError(404, "NotFoundError", "no cell waiting for that decision")
        if body.action == "edit":
            if body.code is None:
                raise ApiError(400, "InvalidArgumentError", "edit needs the code to run")
            review.decision = Decision.edit(body.code)
        elif body.action == "refuse":
            review.decision = Decision.refuse(body.reason)
        else:
            review.decision = Decision.allow()
        review.done.set()

    @router.post("/{chat_id}/ask")
    async def ask(chat_id: str, body: Ask, signed: SignedIn) -> StreamingResponse:
        """Ask a question: the stream carries ``review`` (a cell waiting for a decision,
        with its pre-check report), ``step`` (what ran and its output), then ``answer``."""
        from sandlot.agent import Decision

        configured()
        chat = chats.get(signed[0], chat_id)
        if not chat.busy.acquire(blocking=False):
            raise ApiError(409, "InvalidArgumentError", "this chat is answering a question")
        left = threading.Event()

        def work(push: Any) -> None:
            def approve(review: CellReview) -> Decision:
                if not body.review:
                    return Decision.allow()
                review_id = secrets.token_urlsafe(12)
                pending = _Review()
                chat.reviews[review_id] = pending
                push(
                    {
                        "type": "review",
                        "review_id": review_id,
                        "step": review.step,
                        "code": review.code,
                        "precheck": jsonable(review.precheck),
                    }
                )
                try:
                    pending.done.wait(REVIEW_WAIT)
                finally:
                    chat.reviews.pop(review_id, None)
                if left.is_set() or pending.decision is None:
                    return Decision.refuse("the user did not approve this cell")
                return pending.decision

            chat.agent.approve = approve
            chat.agent.on_step = lambda step: push(_step_message(step))
            try:
                answer = chat.agent.ask(body.question)
                push({"type": "answer", "text": answer.text, "stopped": answer.stopped})
            except SandlotError as exc:  # the model's API failed (ModelError), or the sandbox
                push({"type": "answer", "exception": exception_message(exc)})
            except Exception:
                log.exception("the chat's agent failed")
                push(
                    {
                        "type": "answer",
                        "exception": {"type": "ServerError", "message": "internal error"},
                    }
                )
            finally:
                chat.busy.release()
                push(None)

        def abandon() -> None:
            left.set()
            for review in list(chat.reviews.values()):
                review.done.set()

        stream = ndjson(work, _OwnThreads(), abandon)  # type: ignore[arg-type]
        return StreamingResponse(stream, media_type="application/x-ndjson")

    return router
