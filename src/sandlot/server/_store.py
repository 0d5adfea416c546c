"""The server's database: tenants, API keys (hashed), sandboxes it started, and the audit trail.

SQLAlchemy Core, so the same code runs on the embedded default (SQLite in WAL mode; by
default ``synchronous=NORMAL``: a row is in the write-ahead log when its write returns,
so it survives a crash or kill of the server, and a power loss or kernel crash may lose
the last moments' rows; ``audit_sync="full"`` fsyncs every write, which survives those
too at a few milliseconds per write) and on PostgreSQL (``postgresql+psycopg://...``; install a
driver). Every method is synchronous and thread-safe; the server calls them from
worker threads.

The audit trail is bounded: every string a sandbox chose (egress hosts, methods,
reasons, exception names) is stored escaped and capped (:func:`sandlot.safetext.escape`),
and a store given a retention (``audit_max_age``, ``audit_max_rows``) deletes older
rows: egress rows as they are written, every audit table in :meth:`Store.prune`.
"""

from __future__ import annotations

import functools
import hashlib
import hmac
import json
import secrets
import sqlite3
import threading
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import sqlalchemy as sa
from sqlalchemy.dialects import sqlite as sqlite_dialect
from sqlalchemy.engine import Engine

from sandlot import InvalidArgumentError
from sandlot.safetext import escape

KEY_PREFIX = "sl"
_metadata = sa.MetaData()

tenants = sa.Table(
    "tenants",
    _metadata,
    sa.Column("name", sa.String(128), primary_key=True),
    sa.Column("max_sandboxes", sa.Integer, nullable=True),
    sa.Column("creates_per_minute", sa.Integer, nullable=True),
    sa.Column("max_memory_mb", sa.Integer, nullable=True),
    sa.Column("created_at", sa.Float, nullable=False),
)

api_keys = sa.Table(
    "api_keys",
    _metadata,
    sa.Column("key_id", sa.String(32), primary_key=True),
    sa.Column("tenant", sa.String(128), nullable=False, index=True),
    sa.Column("secret_sha256", sa.String(64), nullable=False),
    sa.Column("created_at", sa.Float, nullable=False),
    sa.Column("revoked_at", sa.Float, nullable=True),
)

sandboxes = sa.Table(
    "sandboxes",
    _metadata,
    sa.Column("sandbox_id", sa.String(64), primary_key=True),
    sa.Column("tenant", sa.String(128), nullable=False, index=True),
    sa.Column("template", sa.String(128), nullable=False),
    sa.Column("created_at", sa.Float, nullable=False),
    sa.Column("ended_at", sa.Float, nullable=True),
    sa.Column("end_reason", sa.String(64), nullable=True),
    # Written by servers before recovery tokens (sandbox_recovery); kept so that older
    # databases open unchanged. No longer written or read.
    sa.Column("pid", sa.Integer, nullable=True),
    sa.Column("pid_start", sa.String(32), nullable=True),
)

sandbox_recovery = sa.Table(
    "sandbox_recovery",
    _metadata,
    sa.Column("sandbox_id", sa.String(64), primary_key=True),
    sa.Column("backend", sa.String(128), nullable=False),
    sa.Column("token", sa.Text, nullable=False),
)
"""What a restarted server needs to destroy a sandbox its crashed predecessor left: the
backend's registry name and the handle's recovery token (a JSON object only that
backend reads). A table of its own, so databases made before it need no migration."""

executions = sa.Table(
    "executions",
    _metadata,
    sa.Column("id", sa.Integer, primary_key=True, autoincrement=True),
    sa.Column("execution_id", sa.String(64), nullable=False, unique=True),
    sa.Column("tenant", sa.String(128), nullable=False, index=True),
    sa.Column("key_id", sa.String(32), nullable=False),
    sa.Column("sandbox_id", sa.String(64), nullable=False, index=True),
    sa.Column("context", sa.String(128), nullable=False),
    sa.Column("started_at", sa.Float, nullable=False, index=True),
    sa.Column("finished_at", sa.Float, nullable=True),
    sa.Column("duration", sa.Float, nullable=True),
    sa.Column("outcome", sa.String(16), nullable=False),
    sa.Column("status", sa.String(16), nullable=True),
    sa.Column("error_name", sa.String(256), nullable=True),
    sa.Column("code", sa.Text, nullable=True),
    sa.Column("code_sha256", sa.String(64), nullable=False),
    sa.Column("code_bytes", sa.Integer, nullable=False),
    sa.Column("stdout_bytes", sa.Integer, nullable=True),
    sa.Column("stderr_bytes", sa.Integer, nullable=True),
    sa.Column("result_count", sa.Integer, nullable=True),
    sa.Column("result_bytes", sa.Integer, nullable=True),
    sa.Column("truncated", sa.Boolean, nullable=True),
    sa.Column("precheck", sa.Text, nullable=True),
    sa.Column("usage", sa.Text, nullable=True),
)

tenant_egress = sa.Table(
    "tenant_egress",
    _metadata,
    sa.Column("tenant", sa.String(128), primary_key=True),
    sa.Column("allow_out", sa.Text, nullable=False),
)
"""A tenant's own egress allowlist (JSON list of allow_out entries), narrower than the
server's: its sandboxes' policies must lie within both. No row: the server's alone.
A table of its own, so databases made before it need no migration."""

tenant_ceilings = sa.Table(
    "tenant_ceilings",
    _metadata,
    sa.Column("tenant", sa.String(128), primary_key=True),
    sa.Column("ceilings", sa.Text, nullable=False),
)
"""A tenant's own ceilings (JSON object: a ``Resources`` field, ``sandbox_timeout`` or
``cell_timeout`` -> number), overriding the server's for that field. A table of its
own, so databases made before it need no migration."""

network_events = sa.Table(
    "network_events",
    _metadata,
    sa.Column("id", sa.Integer, primary_key=True, autoincrement=True),
    sa.Column("time", sa.Float, nullable=False, index=True),
    sa.Column("tenant", sa.String(128), nullable=True, index=True),
    sa.Column("sandbox_id", sa.String(64), nullable=False, index=True),
    sa.Column("method", sa.String(32), nullable=False),
    sa.Column("host", sa.String(255), nullable=False),
    sa.Column("port", sa.Integer, nullable=False),
    sa.Column("address", sa.String(64), nullable=True),
    sa.Column("verdict", sa.String(16), nullable=False),
    sa.Column("reason", sa.Text, nullable=False),
    sa.Column("bytes_in", sa.BigInteger, nullable=False),
    sa.Column("bytes_out", sa.BigInteger, nullable=False),
    sa.Column("count", sa.Integer, nullable=False, server_default="1"),
)
"""One row per connection a sandbox asked the egress proxy for (allowed, refused or
failed), written when it ends. ``tenant`` is the sandbox's owner at that time. A
summary row (``method`` SUMMARY) stands for ``count`` connections (the proxy's rate
limit on refusal records, or a full queue). ``count`` was added later: a database
made before it gets the column (default 1) when a store opens it."""

operations = sa.Table(
    "operations",
    _metadata,
    sa.Column("id", sa.Integer, primary_key=True, autoincrement=True),
    sa.Column("operation_id", sa.String(32), nullable=False, unique=True),
    sa.Column("tenant", sa.String(128), nullable=False, index=True),
    sa.Column("key_id", sa.String(32), nullable=False),
    sa.Column("sandbox_id", sa.String(64), nullable=False, index=True),
    sa.Column("kind", sa.String(16), nullable=False),
    sa.Column("target", sa.Text, nullable=True),
    sa.Column("target_bytes", sa.Integer, nullable=True),
    sa.Column("target_sha256", sa.String(64), nullable=True),
    sa.Column("destination", sa.Text, nullable=True),
    sa.Column("pid", sa.Integer, nullable=True),
    sa.Column("size", sa.BigInteger, nullable=True),
    sa.Column("started_at", sa.Float, nullable=False, index=True),
    sa.Column("finished_at", sa.Float, nullable=True),
    sa.Column("outcome", sa.String(16), nullable=False),
    sa.Column("exit_code", sa.Integer, nullable=True),
    sa.Column("error_name", sa.String(256), nullable=True),
)
"""One row per command, terminal, process signal or stdin write, and file change or
download a tenant asked for (not per cell: those are ``executions``). Written before
the operation runs (``outcome`` running), finished when it returns: ``ok`` or
``error`` (``exit_code`` for a foreground command); ``started`` for a background
process or terminal (its ``pid``), then ``ok`` with its exit code if the stream that
started it saw it end. ``target`` is the command line
or path, escaped and capped at :data:`OPERATION_TEXT_LIMIT` characters
(``target_bytes`` and ``target_sha256`` are of the whole). A table of its own, so
databases made before it need no migration."""

OPERATION_TEXT_LIMIT = 4096
"""Longest command line or path kept in an ``operations`` row."""

OPERATION_KINDS = (
    "command",
    "process",
    "pty",
    "kill",
    "stdin",
    "write",
    "remove",
    "rename",
    "mkdir",
    "download",
)

TEXT_LIMIT = 1024
"""Longest sandbox-chosen text kept in a column without a width of its own (reasons)."""

OUTCOMES = ("running", "ok", "error", "timeout", "oom", "killed")
"""``running`` until the cell ends; ``killed`` covers interrupts, disconnects, a lost
sandbox and a server that died mid-cell."""

_DUMMY_HASH = hashlib.sha256(b"sandlot: no such key").hexdigest()

# The statements of the per-request and per-cell queries, built once: building a
# SQLAlchemy statement costs more than running it on SQLite (the values are bound
# parameters, so the compiled form is cached and reused too).
_KEY_ROW = sa.select(api_keys.c.tenant, api_keys.c.secret_sha256).where(
    api_keys.c.key_id == sa.bindparam("key_id"), api_keys.c.revoked_at.is_(None)
)
_CEILINGS_ROW = sa.select(tenant_ceilings.c.ceilings).where(
    tenant_ceilings.c.tenant == sa.bindparam("tenant")
)
_QUOTAS_ROW = sa.select(
    tenants.c.max_sandboxes, tenants.c.creates_per_minute, tenants.c.max_memory_mb
).where(tenants.c.name == sa.bindparam("tenant"))
_EGRESS_ROW = sa.select(tenant_egress.c.allow_out).where(
    tenant_egress.c.tenant == sa.bindparam("tenant")
)
_SANDBOX_STARTED = sandboxes.insert()
_RECOVERY_STARTED = sandbox_recovery.insert()
_SANDBOX_ENDED = (
    sandboxes.update()
    .where(sandboxes.c.sandbox_id == sa.bindparam("_sandbox_id"), sandboxes.c.ended_at.is_(None))
    .values(ended_at=sa.bindparam("ended_at"), end_reason=sa.bindparam("end_reason"))
)
_RECOVERY_ENDED = sandbox_recovery.delete().where(
    sandbox_recovery.c.sandbox_id == sa.bindparam("_sandbox_id")
)
_SANDBOX_RESUMED = (
    sandboxes.update()
    .where(sandboxes.c.sandbox_id == sa.bindparam("_sandbox_id"))
    .values(ended_at=sa.null(), end_reason=sa.null())
)
_EXECUTION_STARTED = executions.insert()
_EXECUTION_COLUMNS = frozenset(column.name for column in executions.columns)
_OPERATION_STARTED = operations.insert()
_OPERATION_COLUMNS = frozenset(column.name for column in operations.columns)


@dataclass(frozen=True, slots=True)
class Principal:
    """Who a request is from: the tenant and which of its keys was used."""

    tenant: str
    key_id: str


@dataclass(frozen=True, slots=True)
class TenantQuotas:
    max_sandboxes: int | None
    creates_per_minute: int | None
    max_memory_mb: int | None


AuditSync = Literal["normal", "full"]
"""How SQLite commits (see the module docstring); PostgreSQL follows its own settings."""


def _sqlite_pragmas(sync: AuditSync) -> Callable[[Any, Any], None]:
    def apply(dbapi_connection: Any, _record: Any) -> None:
        cursor = dbapi_connection.cursor()
        # WAL: readers never block the writer, and with NORMAL a commit is one write to
        # the log (durable across a crash of the server, not of the machine).
        cursor.execute("PRAGMA journal_mode=WAL")
        cursor.execute(f"PRAGMA synchronous={'FULL' if sync == 'full' else 'NORMAL'}")
        cursor.execute("PRAGMA busy_timeout=10000")
        cursor.close()

    return apply


def _hash_secret(secret: str) -> str:
    # Keys are 256 random bits, so a fast hash is enough: there is nothing to brute-force.
    return hashlib.sha256(secret.encode("utf-8")).hexdigest()


_Statement = sa.Select[Any] | sa.Insert | sa.Update | sa.Delete
_Step = tuple[_Statement, Mapping[str, Any]]


class _Driver:
    """The per-request and per-cell statements on an SQLite file, through the driver.

    A key lookup on every request and a cell's two audit rows are the store's hot path.
    Through SQLAlchemy each pays a pool checkout and a statement-cache lookup that cost
    several times the query (on a 2-core host: 80 us against 10 us for a key lookup, 290
    us against 55 us for an insert and its commit). Here they run on one connection per
    thread, with the SQL compiled once from the same Core statements, so each query is
    still defined once. Commits keep the engine's pragmas (WAL, the ``synchronous``
    level), so a row is as durable as through the engine.
    """

    _DIALECT = sqlite_dialect.dialect(paramstyle="named")

    def __init__(self, path: str, configure: Callable[[Any, Any], None]) -> None:
        self._path = path
        self._configure = configure
        self._local = threading.local()
        self._opened: list[sqlite3.Connection] = []
        self._lock = threading.Lock()

    def _connection(self) -> sqlite3.Connection:
        conn: sqlite3.Connection | None = getattr(self._local, "conn", None)
        if conn is None:
            # Autocommit mode: each write below is its own explicit transaction.
            conn = sqlite3.connect(self._path, isolation_level=None, check_same_thread=False)
            self._configure(conn, None)
            with self._lock:
                self._opened.append(conn)
            self._local.conn = conn
        return conn

    @staticmethod
    @functools.lru_cache(maxsize=128)
    def _sql(statement: _Statement, columns: frozenset[str] | None) -> str:
        keys = None if columns is None else sorted(columns)
        return str(statement.compile(dialect=_Driver._DIALECT, column_keys=keys))

    def first(self, statement: _Statement, params: Mapping[str, Any]) -> Any:
        """The first row of a query, as a tuple, or None."""
        return self._connection().execute(self._sql(statement, None), params).fetchone()

    def write(self, *steps: _Step) -> None:
        """Statements in one transaction; an INSERT binds its parameters' keys."""
        conn = self._connection()
        conn.execute("BEGIN IMMEDIATE")
        try:
            for statement, params in steps:
                columns = frozenset(params) if isinstance(statement, sa.Insert) else None
                conn.execute(self._sql(statement, columns), params)
        except BaseException:
            conn.execute("ROLLBACK")
            raise
        conn.execute("COMMIT")

    def close(self) -> None:
        with self._lock:
            opened, self._opened = self._opened, []
        for conn in opened:
            conn.close()


class Store:
    """One database connection pool and the queries the server needs."""

    def __init__(
        self,
        url: str,
        *,
        audit_max_age: float | None = None,
        audit_max_rows: int | None = None,
        audit_sync: AuditSync = "normal",
    ) -> None:
        """``audit_max_age``: seconds the audit trail keeps a row (None: forever);
        ``audit_max_rows``: rows each audit table keeps at most (None: no cap). Both
        are enforced by :meth:`prune`, and the row cap of ``network_events`` also on
        every write, so a flood of records cannot outgrow it between prunes. Cells
        still running are never deleted."""
        if audit_max_age is not None and not audit_max_age > 0:
            raise InvalidArgumentError("audit_max_age must be a positive number of seconds")
        if audit_max_rows is not None and audit_max_rows < 1:
            raise InvalidArgumentError("audit_max_rows must be a positive number of rows")
        if audit_sync not in ("normal", "full"):
            raise InvalidArgumentError(f"audit_sync must be normal or full, not {audit_sync!r}")
        if url.startswith("sqlite:///"):
            Path(url.removeprefix("sqlite:///")).parent.mkdir(parents=True, exist_ok=True)
        self.url = url
        self.audit_max_age = audit_max_age
        self.audit_max_rows = audit_max_rows
        self.engine: Engine = sa.create_engine(url, future=True)
        self.embedded = self.engine.dialect.name == "sqlite"
        """An embedded database (SQLite): a key lookup is a few tens of microseconds
        on this host, cheaper than handing it to a thread. Over a network (PostgreSQL)
        every query belongs in a worker thread."""
        self._driver: _Driver | None = None
        if self.embedded:
            pragmas = _sqlite_pragmas(audit_sync)
            sa.event.listen(self.engine, "connect", pragmas)
            database = self.engine.url.database
            if database and database != ":memory:":
                # A file (an in-memory database is one per connection: engine only).
                self._driver = _Driver(database, pragmas)
        _metadata.create_all(self.engine)
        self._add_missing_columns()

    def _add_missing_columns(self) -> None:
        """Columns added to a table after databases were made with it (no migration
        tool: each is nullable or has a default, and is added in place)."""
        present = {
            column["name"] for column in sa.inspect(self.engine).get_columns("network_events")
        }
        if "count" in present:
            return
        try:
            with self.engine.begin() as conn:
                conn.execute(
                    sa.text(
                        'ALTER TABLE network_events ADD COLUMN "count" INTEGER NOT NULL DEFAULT 1'
                    )
                )
        except sa.exc.DBAPIError:
            # Another process (the server, `sandlot audit`) added it at the same time.
            present = {c["name"] for c in sa.inspect(self.engine).get_columns("network_events")}
            if "count" not in present:
                raise

    def close(self) -> None:
        if self._driver is not None:
            self._driver.close()
        self.engine.dispose()

    def _first(self, statement: _Statement, params: Mapping[str, Any]) -> Any:
        if self._driver is not None:
            return self._driver.first(statement, params)
        with self.engine.connect() as conn:
            return conn.execute(statement, params).first()

    def _write(self, *steps: _Step) -> None:
        if self._driver is not None:
            self._driver.write(*steps)
            return
        with self.engine.begin() as conn:
            for statement, params in steps:
                conn.execute(statement, params)

    # --- tenants and keys ------------------------------------------------------------
    def create_key(self, tenant: str, quotas: TenantQuotas | None = None) -> str:
        """Create (or update the quotas of) ``tenant`` and a new key for it; return the key.

        The key is shown once: only its SHA-256 is stored.
        """
        if not tenant or len(tenant) > 128 or not tenant.isprintable():
            raise InvalidArgumentError("tenant must be 1-128 printable characters")
        key_id = secrets.token_hex(8)
        secret = secrets.token_urlsafe(32)
        now = time.time()
        with self.engine.begin() as conn:
            exists = conn.execute(sa.select(tenants.c.name).where(tenants.c.name == tenant)).first()
            values = {} if quotas is None else _quota_values(quotas)
            if exists is None:
                conn.execute(tenants.insert().values(name=tenant, created_at=now, **values))
            elif values:
                conn.execute(tenants.update().where(tenants.c.name == tenant).values(**values))
            conn.execute(
                api_keys.insert().values(
                    key_id=key_id, tenant=tenant, secret_sha256=_hash_secret(secret), created_at=now
                )
            )
        return f"{KEY_PREFIX}_{key_id}_{secret}"

    def authenticate(self, key: str) -> Principal | None:
        """The principal of a valid, unrevoked key, else None. Compares in constant time."""
        prefix, _, rest = key.partition("_")
        key_id, _, secret = rest.partition("_")
        row = None
        if prefix == KEY_PREFIX and key_id and secret and len(key) < 200:
            row = self._first(_KEY_ROW, {"key_id": key_id})
        # Compare even when there is no row, so a miss costs the same as a wrong secret.
        expected = row[1] if row is not None else _DUMMY_HASH
        matches = hmac.compare_digest(_hash_secret(secret), expected)
        if row is None or not matches:
            return None
        return Principal(tenant=row[0], key_id=key_id)

    def revoke_key(self, key_id: str) -> bool:
        with self.engine.begin() as conn:
            result = conn.execute(
                api_keys.update()
                .where(api_keys.c.key_id == key_id, api_keys.c.revoked_at.is_(None))
                .values(revoked_at=time.time())
            )
        return bool(result.rowcount)

    def list_keys(self) -> list[dict[str, Any]]:
        with self.engine.connect() as conn:
            rows = conn.execute(
                sa.select(
                    api_keys.c.key_id,
                    api_keys.c.tenant,
                    api_keys.c.created_at,
                    api_keys.c.revoked_at,
                ).order_by(api_keys.c.created_at)
            )
            return [dict(row._mapping) for row in rows]

    def tenant_quotas(self, tenant: str) -> TenantQuotas:
        row = self._first(_QUOTAS_ROW, {"tenant": tenant})
        if row is None:
            return TenantQuotas(None, None, None)
        return TenantQuotas(row[0], row[1], row[2])

    # --- sandboxes ----------------------------------------------------------------------
    def sandbox_started(
        self,
        sandbox_id: str,
        tenant: str,
        template: str,
        *,
        backend: str | None = None,
        recovery: Mapping[str, Any] | None = None,
    ) -> None:
        """Record a new sandbox; with ``recovery`` (its handle's recovery token) and
        ``backend`` (the registry name that reads it), for crash recovery."""
        steps: list[_Step] = [
            (
                _SANDBOX_STARTED,
                {
                    "sandbox_id": sandbox_id,
                    "tenant": tenant,
                    "template": template,
                    "created_at": time.time(),
                },
            )
        ]
        if backend is not None and recovery is not None:
            token = json.dumps(dict(recovery))
            steps.append(
                (_RECOVERY_STARTED, {"sandbox_id": sandbox_id, "backend": backend, "token": token})
            )
        self._write(*steps)

    def sandbox_resumed(
        self,
        sandbox_id: str,
        *,
        backend: str | None = None,
        recovery: Mapping[str, Any] | None = None,
    ) -> None:
        """A paused sandbox runs again under its id: its row is open again (ended with
        ``paused`` when it was paused), with its new recovery token."""
        steps: list[_Step] = [
            (_SANDBOX_RESUMED, {"_sandbox_id": sandbox_id}),
            (_RECOVERY_ENDED, {"_sandbox_id": sandbox_id}),
        ]
        if backend is not None and recovery is not None:
            token = json.dumps(dict(recovery))
            steps.append(
                (_RECOVERY_STARTED, {"sandbox_id": sandbox_id, "backend": backend, "token": token})
            )
        self._write(*steps)

    def sandbox_ended(self, sandbox_id: str, reason: str) -> None:
        self._write(
            (
                _SANDBOX_ENDED,
                {"_sandbox_id": sandbox_id, "ended_at": time.time(), "end_reason": reason},
            ),
            (_RECOVERY_ENDED, {"_sandbox_id": sandbox_id}),
        )

    def unfinished_recovery_tokens(self) -> list[tuple[str, dict[str, Any]]]:
        """(backend, recovery token) of every sandbox still open (the previous server
        crashed); rows whose token is not a JSON object are skipped."""
        return self._recovery_tokens(self._open_recovery_rows())

    @staticmethod
    def _open_recovery_rows() -> sa.Select[tuple[Any, Any]]:
        """(backend, token) of the sandboxes still open (a subclass narrows it)."""
        return (
            sa.select(sandbox_recovery.c.backend, sandbox_recovery.c.token)
            .join(sandboxes, sandboxes.c.sandbox_id == sandbox_recovery.c.sandbox_id)
            .where(sandboxes.c.ended_at.is_(None))
        )

    def _recovery_tokens(
        self, query: sa.Select[tuple[Any, Any]]
    ) -> list[tuple[str, dict[str, Any]]]:
        found = []
        with self.engine.connect() as conn:
            for backend, text in conn.execute(query):
                try:
                    token = json.loads(text)
                except ValueError:
                    continue
                if isinstance(token, dict):
                    found.append((str(backend), token))
        return found

    def close_orphans(self) -> tuple[int, int]:
        """After a crash: end every sandbox and cell the previous server left open.

        Returns (sandboxes, executions) closed. Cells become ``killed``.
        """
        now = time.time()
        with self.engine.begin() as conn:
            boxes = conn.execute(
                sandboxes.update()
                .where(sandboxes.c.ended_at.is_(None))
                .values(ended_at=now, end_reason="server-crashed")
            ).rowcount
            # Those sandboxes are closed now: their tokens are not needed any more.
            ended = sa.select(sandboxes.c.sandbox_id).where(sandboxes.c.ended_at.is_not(None))
            conn.execute(sandbox_recovery.delete().where(sandbox_recovery.c.sandbox_id.in_(ended)))
            cells = conn.execute(
                executions.update()
                .where(executions.c.outcome == "running")
                .values(outcome="killed", status="died", finished_at=now)
            ).rowcount
            conn.execute(
                operations.update()
                .where(operations.c.outcome == "running")
                .values(outcome="killed", finished_at=now)
            )
        return int(boxes or 0), int(cells or 0)

    # --- audit --------------------------------------------------------------------------
    def execution_started(
        self,
        *,
        execution_id: str,
        principal: Principal,
        sandbox_id: str,
        context: str,
        code: str,
        keep_code: bool,
        precheck: Any = None,
    ) -> None:
        data = code.encode("utf-8", "replace")
        started: _Step = (
            _EXECUTION_STARTED,
            {
                "execution_id": execution_id,
                "tenant": principal.tenant,
                "key_id": principal.key_id,
                "sandbox_id": sandbox_id,
                "context": context,
                "started_at": time.time(),
                "outcome": "running",
                "code": code if keep_code else None,
                "code_sha256": hashlib.sha256(data).hexdigest(),
                "code_bytes": len(data),
                "precheck": _as_json(precheck),
            },
        )
        self._write(started)

    def execution_finished(self, execution_id: str, values: Mapping[str, Any]) -> None:
        row = dict(values)
        if row.get("error_name") is not None:
            # The sandbox names its exceptions: any text, any length.
            row["error_name"] = escape(row["error_name"], 256)
        for name in ("precheck", "usage"):
            if name in row:
                row[name] = _as_json(row[name])
        row.setdefault("finished_at", time.time())
        unknown = sorted(set(row) - _EXECUTION_COLUMNS)
        if unknown:
            raise InvalidArgumentError(f"executions has no column(s) {unknown}")
        self._write((_execution_finished(frozenset(row)), {**row, "_execution_id": execution_id}))

    def query_executions(
        self,
        *,
        tenant: str | None = None,
        sandbox_id: str | None = None,
        outcome: str | None = None,
        since: float | None = None,
        limit: int = 100,
    ) -> Iterator[dict[str, Any]]:
        rows = self._latest(
            executions,
            "started_at",
            since,
            limit,
            tenant=tenant,
            sandbox_id=sandbox_id,
            outcome=outcome,
        )
        for row in rows:
            for name in ("precheck", "usage"):
                if row[name] is not None:
                    row[name] = json.loads(row[name])
            yield row

    # --- operations audit ----------------------------------------------------------------
    def operation_started(
        self,
        *,
        principal: Principal,
        sandbox_id: str,
        kind: str,
        target: str | None,
        destination: str | None = None,
        pid: int | None = None,
        size: int | None = None,
    ) -> str:
        """Record an operation about to run (see ``operations``); returns its id for
        :meth:`operation_finished`."""
        if kind not in OPERATION_KINDS:
            raise InvalidArgumentError(f"unknown operation kind {kind!r}")
        operation_id = secrets.token_hex(16)
        row: dict[str, Any] = {
            "operation_id": operation_id,
            "tenant": principal.tenant,
            "key_id": principal.key_id,
            "sandbox_id": sandbox_id,
            "kind": kind,
            "started_at": time.time(),
            "outcome": "running",
        }
        if target is not None:
            data = target.encode("utf-8", "surrogateescape")
            row["target"] = escape(target, OPERATION_TEXT_LIMIT)
            row["target_bytes"] = len(data)
            row["target_sha256"] = hashlib.sha256(data).hexdigest()
        if destination is not None:
            row["destination"] = escape(destination, OPERATION_TEXT_LIMIT)
        if pid is not None:
            row["pid"] = _pid_column(pid)
        if size is not None:
            row["size"] = size
        self._write((_OPERATION_STARTED, row))
        return operation_id

    def operation_finished(self, operation_id: str, values: Mapping[str, Any]) -> None:
        """Set an operation's end (``outcome`` and any of ``exit_code``, ``pid``,
        ``size``, ``error_name``; ``finished_at`` defaults to now)."""
        row = dict(values)
        if row.get("error_name") is not None:
            row["error_name"] = escape(row["error_name"], 256)
        if "pid" in row:
            row["pid"] = _pid_column(row["pid"])
        row.setdefault("finished_at", time.time())
        unknown = sorted(set(row) - _OPERATION_COLUMNS)
        if unknown:
            raise InvalidArgumentError(f"operations has no column(s) {unknown}")
        self._write((_operation_finished(frozenset(row)), {**row, "_operation_id": operation_id}))

    def query_operations(
        self,
        *,
        tenant: str | None = None,
        sandbox_id: str | None = None,
        kind: str | None = None,
        since: float | None = None,
        limit: int = 100,
    ) -> list[dict[str, Any]]:
        """The most recent ``limit`` operations, oldest first."""
        return self._latest(
            operations, "started_at", since, limit, tenant=tenant, sandbox_id=sandbox_id, kind=kind
        )

    def _latest(
        self,
        table: sa.Table,
        time_column: str,
        since: float | None,
        limit: int,
        **equal: str | None,
    ) -> list[dict[str, Any]]:
        """The ``limit`` most recent rows of an audit table, oldest first: those whose
        ``time_column`` is at or after ``since`` and whose columns equal the given values
        (None: any)."""
        query = sa.select(table).order_by(table.c.id.desc()).limit(limit)
        for column, value in equal.items():
            if value is not None:
                query = query.where(table.c[column] == value)
        if since is not None:
            query = query.where(table.c[time_column] >= since)
        with self.engine.connect() as conn:
            rows = [dict(row._mapping) for row in conn.execute(query)]
        return rows[::-1]

    def set_tenant_egress(self, tenant: str, allow_out: list[str]) -> None:
        """Set what ``tenant``'s sandboxes may be allowed, within the server's ceiling
        (``[]``: no network for this tenant)."""
        with self.engine.begin() as conn:
            conn.execute(tenant_egress.delete().where(tenant_egress.c.tenant == tenant))
            conn.execute(
                tenant_egress.insert().values(tenant=tenant, allow_out=json.dumps(allow_out))
            )

    def tenant_egress(self, tenant: str) -> list[str] | None:
        """The tenant's own allowlist, or None when only the server's applies."""
        row = self._first(_EGRESS_ROW, {"tenant": tenant})
        value = None if row is None else row[0]
        return None if value is None else [str(entry) for entry in json.loads(value)]

    def set_tenant_ceilings(self, tenant: str, ceilings: Mapping[str, float]) -> None:
        """Set some of ``tenant``'s own ceilings (the others stay as they were)."""
        with self.engine.begin() as conn:
            old = conn.execute(
                sa.select(tenant_ceilings.c.ceilings).where(tenant_ceilings.c.tenant == tenant)
            ).scalar()
            merged = {**(json.loads(old) if old else {}), **ceilings}
            conn.execute(tenant_ceilings.delete().where(tenant_ceilings.c.tenant == tenant))
            conn.execute(
                tenant_ceilings.insert().values(tenant=tenant, ceilings=json.dumps(merged))
            )

    def tenant_ceilings(self, tenant: str) -> dict[str, float]:
        """The tenant's own ceilings ({} when only the server's apply)."""
        row = self._first(_CEILINGS_ROW, {"tenant": tenant})
        value = None if row is None else row[0]
        return {} if value is None else {str(k): v for k, v in json.loads(value).items()}

    # --- network audit ------------------------------------------------------------------
    def network_event(self, event: Mapping[str, Any]) -> None:
        """Record one finished egress connection (``NetworkEvent.to_dict()``)."""
        self.network_events([event])

    def network_events(self, events: Sequence[Mapping[str, Any]]) -> None:
        """Record finished egress connections (``NetworkEvent.to_dict()`` each) in one
        transaction; each row's tenant is taken from its sandbox's row. Text the sandbox
        chose is escaped and capped to its column; then ``audit_max_rows`` is applied."""
        if not events:
            return
        with self.engine.begin() as conn:
            owners: dict[str, str | None] = {}
            for sandbox_id in {str(event["sandbox"]) for event in events}:
                owners[sandbox_id] = conn.execute(
                    sa.select(sandboxes.c.tenant).where(sandboxes.c.sandbox_id == sandbox_id)
                ).scalar()
            rows = [
                {
                    "time": float(event["time"]),
                    "tenant": owners[str(event["sandbox"])],
                    "sandbox_id": str(event["sandbox"]),
                    "method": escape(event["method"], 32),
                    "host": escape(event["host"], 255),
                    "port": int(event["port"]),
                    "address": None if event["address"] is None else escape(event["address"], 64),
                    "verdict": escape(event["verdict"], 32)[:16],
                    "reason": escape(event["reason"], TEXT_LIMIT),
                    "bytes_in": int(event["bytes_in"]),
                    "bytes_out": int(event["bytes_out"]),
                    "count": int(event.get("count", 1)),
                }
                for event in events
            ]
            conn.execute(network_events.insert(), rows)
            if self.audit_max_rows is not None:
                _keep_newest(conn, network_events, self.audit_max_rows)

    def prune(self, now: float | None = None) -> dict[str, int]:
        """Apply the retention: delete audit rows older than ``audit_max_age`` and the
        oldest beyond ``audit_max_rows`` in each table (never a running cell). Returns
        the rows deleted per table."""
        now = time.time() if now is None else now
        deleted = {"executions": 0, "network_events": 0, "operations": 0}
        finished = executions.c.outcome != "running"
        settled = operations.c.outcome != "running"
        with self.engine.begin() as conn:
            if self.audit_max_age is not None:
                cutoff = now - self.audit_max_age
                deleted["network_events"] += _rowcount(
                    conn.execute(network_events.delete().where(network_events.c.time < cutoff))
                )
                deleted["executions"] += _rowcount(
                    conn.execute(
                        executions.delete().where(executions.c.started_at < cutoff, finished)
                    )
                )
                deleted["operations"] += _rowcount(
                    conn.execute(
                        operations.delete().where(operations.c.started_at < cutoff, settled)
                    )
                )
            if self.audit_max_rows is not None:
                deleted["network_events"] += _keep_newest(conn, network_events, self.audit_max_rows)
                deleted["executions"] += _keep_newest(
                    conn, executions, self.audit_max_rows, finished
                )
                deleted["operations"] += _keep_newest(
                    conn, operations, self.audit_max_rows, settled
                )
        return deleted

    def query_network(
        self,
        *,
        tenant: str | None = None,
        sandbox_id: str | None = None,
        verdict: str | None = None,
        since: float | None = None,
        limit: int = 100,
    ) -> list[dict[str, Any]]:
        """The most recent ``limit`` connection records, oldest first."""
        return self._latest(
            network_events,
            "time",
            since,
            limit,
            tenant=tenant,
            sandbox_id=sandbox_id,
            verdict=verdict,
        )


@functools.lru_cache(maxsize=64)
def _execution_finished(columns: frozenset[str]) -> sa.Update:
    """The UPDATE that finishes an execution row, setting ``columns`` (bound as
    parameters of the same names; the row is ``_execution_id``). One per set of
    columns, and the server uses a handful."""
    return (
        executions.update()
        .where(executions.c.execution_id == sa.bindparam("_execution_id"))
        .values({name: sa.bindparam(name) for name in sorted(columns)})
    )


def _pid_column(pid: int | None) -> int | None:
    """A pid as stored: one no process can have (the caller chose it: any integer) is
    kept as None rather than overflow the column (32-bit on PostgreSQL) and refuse the
    operation; the operation then fails as a pid that runs nothing does."""
    if pid is None or not 0 < pid < 2**31:
        return None
    return pid


@functools.lru_cache(maxsize=32)
def _operation_finished(columns: frozenset[str]) -> sa.Update:
    """The UPDATE that finishes an operation row (as :func:`_execution_finished`)."""
    return (
        operations.update()
        .where(operations.c.operation_id == sa.bindparam("_operation_id"))
        .values({name: sa.bindparam(name) for name in sorted(columns)})
    )


def _keep_newest(
    conn: sa.Connection, table: sa.Table, rows: int, *where: sa.ColumnElement[bool]
) -> int:
    """Delete the rows of ``table`` with an id more than ``rows`` below the newest.

    Ids only grow, so at most ``rows`` remain (fewer if ids have gaps), and the delete
    is a range on the primary key, cheap enough to run on every write."""
    newest = conn.execute(sa.select(sa.func.max(table.c.id))).scalar()
    if newest is None or newest <= rows:
        return 0
    return _rowcount(conn.execute(table.delete().where(table.c.id <= newest - rows, *where)))


def _rowcount(result: Any) -> int:
    return int(result.rowcount or 0)


def _quota_values(quotas: TenantQuotas) -> dict[str, int]:
    return {
        name: value
        for name, value in (
            ("max_sandboxes", quotas.max_sandboxes),
            ("creates_per_minute", quotas.creates_per_minute),
            ("max_memory_mb", quotas.max_memory_mb),
        )
        if value is not None
    }


def _as_json(value: Any) -> str | None:
    if value is None:
        return None
    return json.dumps(value, default=str, sort_keys=True)
