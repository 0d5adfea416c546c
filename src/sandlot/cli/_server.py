"""``sandlot serve``, ``sandlot keys`` and ``sandlot audit`` (need the ``server`` extra)."""

from __future__ import annotations

import datetime
import json
import logging
from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar

import click

from sandlot.safetext import escape

F = TypeVar("F", bound=Callable[..., Any])


def _storage_options(function: F) -> F:
    function = click.option(
        "--database",
        envvar="SANDLOT_DATABASE_URL",
        help="SQLAlchemy URL of the key store and audit trail "
        "(default: SQLite in the state directory; postgresql+psycopg://... also works).",
    )(function)
    return click.option(
        "--state-dir",
        envvar="SANDLOT_SERVER_DIR",
        type=click.Path(file_okay=False, path_type=Path),
        help="Server state (database, upload spool). Default ~/.local/state/sandlot/server.",
    )(function)


def _settings(state_dir: Path | None, database: str | None, **changes: Any) -> Any:
    try:
        from sandlot.server import ServerSettings, default_state_dir
    except ImportError as exc:  # pragma: no cover - depends on the install
        raise click.ClickException(
            f"the server needs the 'server' extra: pip install 'sandlot[server]' ({exc})"
        ) from exc
    return ServerSettings(
        state_dir=state_dir or default_state_dir(), database_url=database or None, **changes
    )


def _ceilings(values: tuple[str, ...], *, timeouts: bool) -> dict[str, Any]:
    """``NAME=VALUE`` options as a dict; NAME a ``Resources`` field (or, for a tenant,
    ``sandbox_timeout`` / ``cell_timeout``), VALUE a positive number."""
    from sandlot import Resources
    from sandlot.server import TIMEOUT_CEILINGS

    names = [*Resources.__dataclass_fields__, *(TIMEOUT_CEILINGS if timeouts else ())]
    parsed: dict[str, Any] = {}
    for item in values:
        name, sep, text = item.partition("=")
        name = name.strip().replace("-", "_")
        if not sep or name not in names:
            raise click.BadParameter(
                f"{item!r}: expected NAME=VALUE with NAME one of {', '.join(names)}",
                param_hint="--ceiling",
            )
        try:
            number: float = float(text) if name in ("cpus", *TIMEOUT_CEILINGS) else int(text)
        except ValueError:
            number = 0
        if not number > 0:
            raise click.BadParameter(
                f"{item!r}: VALUE must be a positive number", param_hint="--ceiling"
            )
        parsed[name] = number
    if timeouts:
        try:  # the resource ceilings must make a valid Resources
            Resources(**{k: v for k, v in parsed.items() if k not in TIMEOUT_CEILINGS})
        except Exception as exc:
            raise click.BadParameter(str(exc), param_hint="--ceiling") from exc
    return parsed


_CEILING_HELP = (
    "The most a tenant's sandbox may have of one resource, as NAME=VALUE (a "
    "sandlot.Resources field: memory_mb, cpus, pids, disk_mb, tmp_mb, output_bytes, "
    "max_results, result_bytes, upload_bytes, ...). A request that leaves a resource out "
    "gets its ceiling; one above it, or null, is refused. Repeatable. Default: "
    "sandlot's defaults."
)


@click.command()
@click.option("--host", default="127.0.0.1", show_default=True, help="Address to bind.")
@click.option("--port", default=8000, show_default=True, type=click.IntRange(0, 65535))
@_storage_options
@click.option(
    "--hash-code",
    is_flag=True,
    help="Keep only the SHA-256 of each cell's code in the audit trail, not the code.",
)
@click.option("--idle-ttl", type=click.FloatRange(min=1), default=600, show_default=True)
@click.option("--max-sandboxes", type=click.IntRange(min=1), help="Default per-tenant quota.")
@click.option("--creates-per-minute", type=click.IntRange(min=1), help="Default per-tenant quota.")
@click.option("--max-memory-mb", type=click.IntRange(min=1), help="Default per-tenant quota.")
@click.option(
    "--shutdown-grace",
    type=click.FloatRange(min=0),
    default=10,
    show_default=True,
    help="Seconds running cells may finish after SIGTERM before they are interrupted.",
)
@click.option(
    "--unsafe-best-effort-limits",
    is_flag=True,
    help="Start sandboxes even where whole-sandbox cgroup limits cannot be applied.",
)
@click.option(
    "--checkpointable",
    is_flag=True,
    help="Start every sandbox without a network policy so that it can be paused, "
    "snapshotted and forked (E2B's pause, connect, create_snapshot, fork): a bubblewrap "
    "cold start; needs root and CRIU 4.x (docs/persistence.md).",
)
@click.option(
    "--backend",
    default="auto",
    show_default=True,
    help="Isolation backend of every sandbox: auto (the strongest available) or a declared "
    "backend's name (sandlot doctor lists them).",
)
@click.option(
    "--pool-size",
    type=click.IntRange(min=0),
    default=2,
    show_default=True,
    help="Ready sandboxes (data stack imported) kept per warmed template, with the default "
    "resources; a create that asks for them takes one at once. 0: no warm pool.",
)
@click.option(
    "--pool-template",
    "pool_templates",
    multiple=True,
    metavar="NAME",
    help="Template to keep warm from start-up. Repeatable. Default: python-data.",
)
@click.option(
    "--egress-allow",
    "egress_allow",
    multiple=True,
    metavar="HOST",
    help="Destinations tenants may allow their sandboxes (an allow_out entry: pypi.org, "
    "*.example.com, 10.0.0.0/8, each with an optional :port). Repeatable. Default: none, "
    "so tenants cannot enable network access.",
)
@click.option(
    "--egress-deny",
    "egress_deny",
    multiple=True,
    metavar="HOST",
    help="Destinations no sandbox may reach, whatever its tenant allows. Repeatable.",
)
@click.option(
    "--egress-max-bytes-in", type=click.IntRange(min=1), help="Largest max_bytes_in a tenant gets."
)
@click.option("--egress-max-bytes-out", type=click.IntRange(min=1), help="Largest max_bytes_out.")
@click.option(
    "--egress-max-connections", type=click.IntRange(min=1), help="Largest max_connections."
)
@click.option(
    "--egress-hosts",
    type=click.Path(dir_okay=False, exists=True, path_type=Path),
    help="Resolve names for the egress proxy from this hosts-format file only "
    "('ADDRESS NAME...' lines); other names do not resolve. Default: the host's resolver.",
)
@click.option(
    "--audit-max-age",
    type=click.FloatRange(min=0),
    default=0,
    show_default=True,
    metavar="DAYS",
    help="Delete audit rows (cells, egress records) older than this; 0 (the default) keeps "
    "them until the row cap.",
)
@click.option(
    "--audit-max-rows",
    type=click.IntRange(min=0),
    default=1_000_000,
    show_default=True,
    help="Rows each audit table keeps at most, oldest deleted first; 0: no cap.",
)
@click.option(
    "--audit-sync",
    type=click.Choice(["normal", "full"]),
    default="normal",
    show_default=True,
    help="SQLite audit commits: normal survives a crash of the server; full also a power "
    "loss or kernel crash, at an fsync per row (milliseconds per cell).",
)
@click.option("--ceiling", "ceilings", multiple=True, metavar="NAME=VALUE", help=_CEILING_HELP)
@click.option(
    "--max-sandbox-timeout",
    type=click.FloatRange(min=0, min_open=True),
    default=24 * 3600.0,
    show_default=True,
    help="Longest a sandbox may be asked to live, seconds (and the lifetime of timeout: null).",
)
@click.option(
    "--max-cell-timeout",
    type=click.FloatRange(min=0, min_open=True),
    default=24 * 3600.0,
    show_default=True,
    help="Longest a cell or command may be asked to run, seconds.",
)
@click.option(
    "--client-stall-timeout",
    type=click.FloatRange(min=0, min_open=True),
    default=60.0,
    show_default=True,
    help="Seconds a client may leave a cell's stream unread, with 8 MiB waiting for it, "
    "before the cell is cut.",
)
@click.option(
    "--e2b-template",
    "e2b_templates",
    multiple=True,
    metavar="NAME=TEMPLATE",
    help="Map an E2B template name to a sandlot template for E2B's SDKs (added to, or "
    "replacing, the defaults base and code-interpreter-v1 -> python-data). Repeatable.",
)
@click.option(
    "--ray",
    "ray_address",
    metavar="ADDRESS",
    default=None,
    help="Serve in front of the Ray cluster at ADDRESS (e.g. auto, or HOST:6379): a sandlot "
    "server on every Ray node, this process places and routes (needs the ray extra and a "
    "shared --database). See docs/ray.md.",
)
@click.option(
    "--node-slots",
    type=click.IntRange(min=1),
    default=None,
    help="With --ray: sandboxes each node holds at once (default: its CPU count).",
)
@click.option(
    "--ray-node-ip",
    default=None,
    metavar="IP",
    help="With --ray: this machine's address in the Ray cluster (default: Ray's guess).",
)
def serve(
    host: str,
    port: int,
    state_dir: Path | None,
    database: str | None,
    hash_code: bool,
    idle_ttl: float,
    max_sandboxes: int | None,
    creates_per_minute: int | None,
    max_memory_mb: int | None,
    shutdown_grace: float,
    unsafe_best_effort_limits: bool,
    checkpointable: bool,
    backend: str,
    pool_size: int,
    pool_templates: tuple[str, ...],
    egress_allow: tuple[str, ...],
    egress_deny: tuple[str, ...],
    egress_max_bytes_in: int | None,
    egress_max_bytes_out: int | None,
    egress_max_connections: int | None,
    egress_hosts: Path | None,
    audit_max_age: float,
    audit_max_rows: int,
    audit_sync: str,
    ceilings: tuple[str, ...],
    max_sandbox_timeout: float,
    max_cell_timeout: float,
    client_stall_timeout: float,
    e2b_templates: tuple[str, ...],
    ray_address: str | None,
    node_slots: int | None,
    ray_node_ip: str | None,
) -> None:
    """Serve the sandbox API over HTTP (127.0.0.1 unless --host says otherwise)."""
    from sandlot import NetworkPolicy, PolicyError, Resources
    from sandlot.backends import backend_names
    from sandlot.server import E2B_TEMPLATES, Quotas
    from sandlot.server import serve as run_server

    if backend != "auto" and backend not in backend_names():
        known = ", ".join(["auto", *backend_names()])
        raise click.BadParameter(
            f"unknown backend {backend!r}; known: {known}", param_hint="--backend"
        )
    try:
        resource_ceilings = Resources(**_ceilings(ceilings, timeouts=False))
    except PolicyError as exc:
        raise click.BadParameter(str(exc), param_hint="--ceiling") from exc

    caps = {
        "max_bytes_in": egress_max_bytes_in,
        "max_bytes_out": egress_max_bytes_out,
        "max_connections": egress_max_connections,
    }
    try:
        ceiling = NetworkPolicy(
            allow_out=egress_allow,
            deny_out=egress_deny,
            **{name: value for name, value in caps.items() if value is not None},
        )
    except PolicyError as exc:
        raise click.BadParameter(str(exc), param_hint="--egress-allow/--egress-deny") from exc

    aliases = dict(E2B_TEMPLATES)
    for item in e2b_templates:
        name, sep, template = item.partition("=")
        if not sep or not name.strip() or not template.strip():
            raise click.BadParameter(
                f"{item!r}: expected NAME=TEMPLATE", param_hint="--e2b-template"
            )
        aliases[name.strip()] = template.strip()

    defaults = Quotas()
    quotas = Quotas(
        max_sandboxes=max_sandboxes or defaults.max_sandboxes,
        creates_per_minute=creates_per_minute or defaults.creates_per_minute,
        max_memory_mb=max_memory_mb or defaults.max_memory_mb,
    )
    settings = _settings(
        state_dir,
        database,
        keep_code=not hash_code,
        idle_ttl=idle_ttl,
        quotas=quotas,
        shutdown_grace=shutdown_grace,
        unsafe_best_effort_limits=unsafe_best_effort_limits,
        checkpointable=checkpointable,
        backend=backend,
        pool_size=pool_size,
        pool_templates=pool_templates or ("python-data",),
        egress=ceiling,
        egress_hosts=None if egress_hosts is None else _read_hosts(egress_hosts),
        audit_max_age=audit_max_age * 86400 if audit_max_age else None,
        audit_max_rows=audit_max_rows or None,
        audit_sync=audit_sync,
        ceilings=resource_ceilings,
        max_sandbox_timeout=max_sandbox_timeout,
        max_cell_timeout=max_cell_timeout,
        client_stall_timeout=client_stall_timeout,
        e2b_templates=aliases,
    )
    logging.basicConfig(level=logging.INFO)
    for handler in logging.getLogger().handlers:
        handler.setFormatter(_JsonLines())
    if ray_address is not None:
        _serve_ray(settings, ray_address, host, port, node_slots, ray_node_ip)
        return
    click.echo(f"sandlot server on http://{host}:{port} (state: {settings.state_dir})", err=True)
    run_server(settings, host=host, port=port)


def _serve_ray(
    settings: Any, address: str, host: str, port: int, slots: int | None, node_ip: str | None
) -> None:
    """``sandlot serve --ray``: the front door (sandlot.ray, the ray extra)."""
    from sandlot import InvalidArgumentError

    try:
        from sandlot.ray import serve_cluster
    except ImportError as exc:
        raise click.ClickException(
            f"--ray needs the ray extra: pip install 'sandlot[ray]' ({exc})"
        ) from exc
    click.echo(f"sandlot front door on http://{host}:{port} (Ray: {address})", err=True)
    try:
        serve_cluster(settings, address, host=host, port=port, slots=slots, node_ip=node_ip)
    except InvalidArgumentError as exc:
        raise click.ClickException(str(exc)) from exc


def _read_hosts(path: Path) -> dict[str, list[str]]:
    """A hosts-format file (``ADDRESS NAME [NAME...]``, ``#`` comments) as name -> addresses."""
    import ipaddress

    table: dict[str, list[str]] = {}
    for number, line in enumerate(path.read_text().splitlines(), 1):
        fields = line.split("#", 1)[0].split()
        if not fields:
            continue
        try:
            address = str(ipaddress.ip_address(fields[0]))
        except ValueError:
            raise click.BadParameter(
                f"{path}:{number}: {fields[0]!r} is not an IP address", param_hint="--egress-hosts"
            ) from None
        for name in fields[1:]:
            table.setdefault(name.lower().rstrip("."), []).append(address)
    return table


class _JsonLines(logging.Formatter):
    """One JSON object per log record, traceback included: whatever a message quotes
    (sandbox-chosen text too) cannot start another line."""

    def format(self, record: logging.LogRecord) -> str:
        entry = {
            "time": self.formatTime(record),
            "level": record.levelname,
            "logger": record.name,
            "message": record.getMessage(),
        }
        if record.exc_info:
            entry["exception"] = self.formatException(record.exc_info)
        if record.stack_info:
            entry["stack"] = self.formatStack(record.stack_info)
        return json.dumps(entry)


@click.group()
def keys() -> None:
    """Create, list and revoke API keys (each belongs to one tenant)."""


@keys.command("create")
@click.option("--tenant", required=True, help="Tenant the key belongs to (created if new).")
@click.option("--max-sandboxes", type=click.IntRange(min=1), help="Tenant quota.")
@click.option("--creates-per-minute", type=click.IntRange(min=1), help="Tenant quota.")
@click.option("--max-memory-mb", type=click.IntRange(min=1), help="Tenant quota.")
@click.option(
    "--egress-allow",
    "egress_allow",
    multiple=True,
    metavar="HOST",
    help="What this tenant's sandboxes may be allowed (allow_out entries), within the "
    "server's --egress-allow. Repeatable; replaces the tenant's list.",
)
@click.option("--no-egress", is_flag=True, help="This tenant may not enable network access at all.")
@click.option(
    "--ceiling",
    "ceiling",
    multiple=True,
    metavar="NAME=VALUE",
    help="This tenant's own ceiling for one resource (as serve's --ceiling), or "
    "sandbox_timeout / cell_timeout in seconds; overrides the server's. Repeatable; "
    "other ceilings stay as they were.",
)
@_storage_options
def keys_create(
    tenant: str,
    max_sandboxes: int | None,
    creates_per_minute: int | None,
    max_memory_mb: int | None,
    egress_allow: tuple[str, ...],
    no_egress: bool,
    ceiling: tuple[str, ...],
    state_dir: Path | None,
    database: str | None,
) -> None:
    """Create a key for TENANT; the key is printed alone on the last line (shown once)."""
    from sandlot import NetworkPolicy, PolicyError
    from sandlot.server import Store, TenantQuotas

    if egress_allow and no_egress:
        raise click.UsageError("give --egress-allow or --no-egress, not both")
    try:
        NetworkPolicy(allow_out=egress_allow)
    except PolicyError as exc:
        raise click.BadParameter(str(exc), param_hint="--egress-allow") from exc
    ceilings = _ceilings(ceiling, timeouts=True)
    settings = _settings(state_dir, database)
    store = Store(settings.resolved_database_url)
    try:
        key = store.create_key(
            tenant, TenantQuotas(max_sandboxes, creates_per_minute, max_memory_mb)
        )
        if egress_allow or no_egress:
            store.set_tenant_egress(tenant, list(egress_allow))
        if ceilings:
            store.set_tenant_ceilings(tenant, ceilings)
    finally:
        store.close()
    click.echo(f"created a key for tenant {tenant!r}; it is shown only once:", err=True)
    click.echo(key)


@keys.command("list")
@_storage_options
def keys_list(state_dir: Path | None, database: str | None) -> None:
    """List keys (ids and tenants; the secrets are not stored)."""
    from sandlot.server import Store

    store = Store(_settings(state_dir, database).resolved_database_url)
    try:
        for row in store.list_keys():
            state = "revoked" if row["revoked_at"] else "active"
            click.echo(f"{row['key_id']}  {state:8} {_when(row['created_at'])}  {row['tenant']}")
    finally:
        store.close()


@keys.command("revoke")
@click.argument("key_id")
@_storage_options
def keys_revoke(key_id: str, state_dir: Path | None, database: str | None) -> None:
    """Revoke a key by its id (the part after ``sl_``)."""
    from sandlot.server import Store

    store = Store(_settings(state_dir, database).resolved_database_url)
    try:
        if not store.revoke_key(key_id):
            raise click.ClickException(f"no active key {key_id!r}")
    finally:
        store.close()
    click.echo(f"revoked {key_id}")


@click.command()
@click.option("--tenant", help="Only this tenant's cells.")
@click.option("--sandbox", "sandbox_id", help="Only cells of this sandbox.")
@click.option(
    "--outcome", type=click.Choice(["running", "ok", "error", "timeout", "oom", "killed"])
)
@click.option("--since", type=float, help="Only cells started in the last SINCE seconds.")
@click.option("--limit", type=click.IntRange(min=1), default=50, show_default=True)
@click.option("--json", "as_json", is_flag=True, help="One JSON object per line.")
@click.option(
    "--network",
    is_flag=True,
    help="Show the sandboxes' network connections (egress records) instead of cells.",
)
@click.option(
    "--verdict",
    type=click.Choice(["allowed", "refused", "failed"]),
    help="With --network: only connections with this verdict.",
)
@click.option(
    "--operations",
    is_flag=True,
    help="Show the commands, terminals, process signals and stdin writes, file changes "
    "and downloads tenants asked for instead of cells.",
)
@click.option(
    "--kind",
    # sandlot.server._store.OPERATION_KINDS (not imported: the CLI loads the server lazily).
    type=click.Choice(
        [
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
        ]
    ),
    help="With --operations: only operations of this kind.",
)
@_storage_options
def audit(
    tenant: str | None,
    sandbox_id: str | None,
    outcome: str | None,
    since: float | None,
    limit: int,
    as_json: bool,
    network: bool,
    verdict: str | None,
    operations: bool,
    kind: str | None,
    state_dir: Path | None,
    database: str | None,
) -> None:
    """Show the audit trail: who ran what code when, where, and how it ended (or, with
    --network, every connection a sandbox asked for; with --operations, every command,
    terminal and file change)."""
    import time

    from sandlot.server import Store

    store = Store(_settings(state_dir, database).resolved_database_url)
    if operations:
        try:
            for row in store.query_operations(
                tenant=tenant,
                sandbox_id=sandbox_id,
                kind=kind,
                since=time.time() - since if since is not None else None,
                limit=limit,
            ):
                if as_json:
                    click.echo(json.dumps(row, sort_keys=True))
                    continue
                click.echo(_operation_line(row))
        finally:
            store.close()
        return
    if network:
        try:
            for row in store.query_network(
                tenant=tenant,
                sandbox_id=sandbox_id,
                verdict=verdict,
                since=time.time() - since if since is not None else None,
                limit=limit,
            ):
                if as_json:
                    click.echo(json.dumps(row, sort_keys=True))  # JSON escapes controls
                    continue
                # Hosts, methods and reasons are the sandbox's words: one escaped line each
                # (rows written before they were escaped on the way in, too).
                shown = {name: escape(value or "-") for name, value in row.items()}
                count = f" x{row['count']}" if row.get("count", 1) != 1 else ""
                click.echo(
                    f"{_when(row['time'])}  {shown['tenant']:12} {shown['sandbox_id']}  "
                    f"{shown['verdict']:8} {shown['method']:7} {shown['host']}:{row['port']} "
                    f"in={row['bytes_in']} out={row['bytes_out']}{count}  {shown['reason']}"
                )
        finally:
            store.close()
        return
    try:
        rows = store.query_executions(
            tenant=tenant,
            sandbox_id=sandbox_id,
            outcome=outcome,
            since=time.time() - since if since is not None else None,
            limit=limit,
        )
        for row in rows:
            if as_json:
                click.echo(json.dumps(row, sort_keys=True))
                continue
            duration = f"{row['duration']:.3f}s" if row["duration"] is not None else "-"
            click.echo(
                f"{_when(row['started_at'])}  {escape(row['tenant']):12} "
                f"{escape(row['sandbox_id'])}  {escape(row['outcome']):8} {duration:>9}  "
                f"{row['code_bytes']}B sha256:{row['code_sha256'][:12]}"
            )
    finally:
        store.close()


def _operation_line(row: dict[str, Any]) -> str:
    """One line of ``sandlot audit --operations``: every field a tenant chose escaped."""
    detail = escape(row["target"] or "")
    if row["destination"] is not None:
        detail += f" -> {escape(row['destination'])}"
    if row["pid"] is not None:
        detail = f"pid={row['pid']} {detail}".rstrip()
    if row["size"] is not None:
        detail += f" {row['size']}B"
    ended = escape(row["outcome"])
    if row["exit_code"] is not None:
        ended += f" exit={row['exit_code']}"
    if row["error_name"]:
        ended += f" ({escape(row['error_name'])})"
    return (
        f"{_when(row['started_at'])}  {escape(row['tenant']):12} {escape(row['key_id'])} "
        f"{escape(row['sandbox_id'])}  {escape(row['kind']):8} {ended:16} {detail}"
    )


def _when(timestamp: float) -> str:
    moment = datetime.datetime.fromtimestamp(timestamp, tz=datetime.UTC)
    return moment.strftime("%Y-%m-%dT%H:%M:%SZ")
