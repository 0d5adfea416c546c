"""The ``sandlot`` command line: ``run``, ``doctor``, ``template build|list``, ``chat``, ``mcp``,
and ``serve``, ``keys``, ``audit`` for the server.

The CLI only uses the public API (``sandlot``, ``sandlot.backends``,
``sandlot.templates``). Exit codes: 0 success (for ``run --json``: the sandbox
worked, whatever the code did), 1 the code failed (``run`` without ``--json``),
and each :class:`sandlot.SandlotError`'s ``exit_code`` for sandlot's own errors.
"""

from __future__ import annotations

import base64
import json
import sys
import time
from pathlib import Path
from typing import Any

import click

import sandlot
from sandlot import Execution, NetworkPolicy, Resources, Sandbox, SandlotError
from sandlot.cli._chat import chat_command
from sandlot.cli._doctor import doctor_report
from sandlot.cli._mcp import mcp_command

IMAGE_FORMATS = (("png", "png"), ("jpeg", "jpg"), ("svg", "svg"), ("pdf", "pdf"))


class BackendChoice(click.Choice[str]):
    """``--backend``: the names the backend registry declares (an installed plug-in
    included), read when the option is parsed or help is shown, not when the CLI loads."""

    def __init__(self, *, auto: bool = True) -> None:
        self._auto = auto
        super().__init__(())

    @property
    def choices(self) -> tuple[str, ...]:
        from sandlot.backends import backend_names

        return ("auto", *backend_names()) if self._auto else tuple(backend_names())

    @choices.setter
    def choices(self, _value: object) -> None:
        pass  # click.Choice.__init__ assigns the fixed list this type replaces


def main() -> None:
    """Console entry point."""
    try:
        cli.main(standalone_mode=False)
    except click.exceptions.Abort:
        click.echo("aborted", err=True)
        sys.exit(130)
    except click.ClickException as exc:
        exc.show()
        sys.exit(exc.exit_code)
    except SandlotError as exc:
        click.echo(f"sandlot: error: {exc}", err=True)
        sys.exit(exc.exit_code)


@click.group(context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(sandlot.__version__, prog_name="sandlot")
def cli() -> None:
    """Run untrusted Python in an isolated sandbox."""


cli.add_command(chat_command)
cli.add_command(mcp_command)


def _parse_file_spec(spec: str) -> tuple[Path, str]:
    local, sep, remote = spec.partition(":")
    path = Path(local)
    if not path.is_file():
        raise click.BadParameter(f"{local} is not a file", param_hint="--file")
    return path, remote if sep and remote else path.name


def _parse_env(values: tuple[str, ...]) -> dict[str, str]:
    envs: dict[str, str] = {}
    for item in values:
        key, sep, value = item.partition("=")
        if not sep or not key:
            raise click.BadParameter(f"{item!r} is not KEY=VALUE", param_hint="--env")
        envs[key] = value
    return envs


@cli.command()
@click.argument("file", required=False, type=click.Path(dir_okay=False, allow_dash=True))
@click.option("-c", "--code", help="Code to run instead of FILE.")
@click.option("--json", "as_json", is_flag=True, help="Print one JSON object with the outcome.")
@click.option(
    "--timeout", type=float, default=60.0, show_default=True, help="Seconds the code may run."
)
@click.option("--memory", "memory_mb", type=click.IntRange(min=64), help="Memory limit, MiB.")
@click.option(
    "--file",
    "files",
    multiple=True,
    metavar="LOCAL[:REMOTE]",
    help="Upload a file before running (REMOTE is relative to /home/user). Repeatable.",
)
@click.option(
    "--env", "env_items", multiple=True, metavar="KEY=VALUE", help="Environment variable."
)
@click.option(
    "--allow-out",
    "allow_out",
    multiple=True,
    metavar="HOST[:PORT]",
    help="Let the code connect to HOST (a name, *.domain, IP or CIDR; optional :PORT) "
    "through sandlot's egress proxy. Repeatable. Default: no network at all.",
)
@click.option(
    "--deny-out",
    "deny_out",
    multiple=True,
    metavar="HOST[:PORT]",
    help="Refuse HOST even when --allow-out matches it. Repeatable.",
)
@click.option(
    "--backend", type=BackendChoice(), default="auto", show_default=True, help="Isolation backend."
)
@click.option("--template", default="python-data", show_default=True)
@click.option(
    "--out",
    "out_dir",
    type=click.Path(file_okay=False, path_type=Path),
    default=Path("sandlot-output"),
    show_default=True,
    help="Where image results are saved (without --json).",
)
def run(
    file: str | None,
    code: str | None,
    as_json: bool,
    timeout: float,
    memory_mb: int | None,
    files: tuple[str, ...],
    env_items: tuple[str, ...],
    allow_out: tuple[str, ...],
    deny_out: tuple[str, ...],
    backend: str,
    template: str,
    out_dir: Path,
) -> None:
    """Run FILE (or -c CODE, or stdin with "-") in a fresh sandbox."""
    if (file is None) == (code is None):
        raise click.UsageError("give exactly one of FILE or -c CODE")
    if code is None:
        assert file is not None
        code = sys.stdin.read() if file == "-" else Path(file).read_text(encoding="utf-8")
    uploads = [_parse_file_spec(spec) for spec in files]
    envs = _parse_env(env_items)
    resources = Resources(memory_mb=memory_mb) if memory_mb else None
    network = NetworkPolicy(allow_out=allow_out, deny_out=deny_out)
    started = time.monotonic()
    stream = not as_json
    with Sandbox(
        template, backend=backend, resources=resources, envs=envs, timeout=None, network=network
    ) as sbx:
        for local, remote in uploads:
            with local.open("rb") as handle:
                sbx.files.write(remote, handle)
        execution = sbx.run_code(
            code,
            timeout=timeout,
            on_stdout=(lambda m: click.echo(m.line, nl=False)) if stream else None,
            on_stderr=(lambda m: click.echo(m.line, nl=False, err=True)) if stream else None,
        )
    duration_ms = (time.monotonic() - started) * 1000
    if as_json:
        click.echo(json.dumps(_json_outcome(execution, duration_ms)))
        return
    _print_outcome(execution, out_dir)
    if execution.error is not None:
        sys.exit(1)


def _json_outcome(execution: Execution, duration_ms: float) -> dict[str, Any]:
    error = execution.error
    return {
        "stdout": "".join(execution.logs.stdout),
        "stderr": "".join(execution.logs.stderr),
        "error": None
        if error is None
        else {"name": error.name, "value": error.value, "traceback": error.traceback},
        "results": [result.to_dict() for result in execution.results],
        "status": execution.status,
        "timed_out": execution.status == "timeout",
        "truncated": execution.truncated,
        "execution_count": execution.execution_count,
        "duration_ms": round(duration_ms, 3),
        "network": None
        if execution.network is None
        else [event.to_dict() for event in execution.network],
    }


def _print_outcome(execution: Execution, out_dir: Path) -> None:
    for index, result in enumerate(execution.results, start=1):
        saved = False
        for attr, suffix in IMAGE_FORMATS:
            value = getattr(result, attr)
            if value is None:
                continue
            out_dir.mkdir(parents=True, exist_ok=True)
            target = out_dir / f"result-{index}.{suffix}"
            data = value.encode() if attr == "svg" else base64.b64decode(value)
            target.write_bytes(data)
            click.echo(f"[saved {attr} result to {target}]", err=True)
            saved = True
            break
        if not saved and result.text is not None:
            click.echo(result.text)
    if execution.error is not None:
        error = execution.error
        click.echo(error.traceback or f"{error.name}: {error.value}", err=True)
        if error.traceback and error.value not in error.traceback:
            click.echo(f"{error.name}: {error.value}", err=True)
    if execution.truncated:
        click.echo("[sandlot: output was truncated]", err=True)
    for event in execution.network or ():
        if event.verdict != "allowed":
            click.echo(
                f"[sandlot: network {event.verdict}: {event.host}:{event.port}: {event.reason}]",
                err=True,
            )


@cli.command()
@click.option("--json", "as_json", is_flag=True, help="Print the report as JSON.")
def doctor(as_json: bool) -> None:
    """Check which isolation layers this host provides, and how to fix missing ones."""
    report = doctor_report()
    if as_json:
        click.echo(json.dumps(report, indent=2))
    else:
        for section in report["checks"]:
            mark = {"ok": "ok  ", "missing": "FAIL", "info": "info", "warn": "warn"}[
                section["status"]
            ]
            click.echo(f"[{mark}] {section['name']}: {section['detail']}")
            if section.get("fix"):
                click.echo(f"       fix: {section['fix']}")
        click.echo("")
        usable = report["backends_available"]
        if usable:
            click.echo(f"usable backends: {', '.join(usable)} (auto picks {report['auto']})")
        else:
            click.echo("no usable backend: sandlot will refuse to run code on this host")
    if not report["backends_available"]:
        sys.exit(1)


@cli.group()
def template() -> None:
    """Build and inspect templates (the Python environments sandboxes run)."""


@template.command("build")
@click.argument("name", default="python-data")
@click.option("--force", is_flag=True, help="Rebuild even if the template exists.")
@click.option(
    "--python",
    "python",
    type=click.Path(exists=True, dir_okay=False, path_type=Path),
    help="Base interpreter for the template (default: the system python3).",
)
@click.option(
    "--backend",
    type=click.Choice(["bwrap", "docker", "podman"]),
    default="bwrap",
    show_default=True,
    help="bwrap: a directory in the cache; docker/podman: an image in that engine.",
)
@click.option(
    "--base",
    metavar="IMAGE",
    help="Base image for --backend docker/podman "
    "(default: $SANDLOT_DOCKER_BASE or python:3.12-slim).",
)
def template_build(
    name: str, force: bool, python: Path | None, backend: str, base: str | None
) -> None:
    """Build template NAME into the cache directory, or as an image of a container engine."""
    from sandlot.templates import build_template, find_template

    started = time.monotonic()

    def progress(line: str) -> None:
        click.echo(f"[{time.monotonic() - started:6.1f}s] {line}", err=True)

    if backend != "bwrap":
        from sandlot.backends.docker import build_template_image

        image = build_template_image(backend, name, base=base, force=force, progress=progress)
        click.echo(f"template {name} ready as {backend} image {image}")
        return
    if not force and find_template(name) is not None:
        click.echo(f"template {name} is already built (use --force to rebuild)")
        return
    built = build_template(name, python=python, force=force, progress=progress)
    click.echo(f"template {built.name} ready at {built.path}")


@template.command("list")
def template_list() -> None:
    """List known templates and whether they are built."""
    from sandlot.templates import TEMPLATES, cache_dir, find_template

    click.echo(f"cache: {cache_dir()}")
    for name, spec in TEMPLATES.items():
        built = find_template(name)
        state = f"built ({built.python_version})" if built else "not built"
        click.echo(f"{name:14} {state:18} {spec.description}")


def _add_server_commands() -> None:
    from sandlot.cli._server import audit, keys, serve

    cli.add_command(serve)
    cli.add_command(keys)
    cli.add_command(audit)


_add_server_commands()
