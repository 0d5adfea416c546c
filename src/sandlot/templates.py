"""Templates: prebuilt, read-only Python environments that sandboxes run in.

A template is a directory on the host, ``<cache>/templates/<name>``::

    env/                        a relocatable venv (``uv venv --relocatable``)
    share/matplotlib/
        matplotlibrc            copied into each sandbox's home by the runner
        cache/fontlist-*.json   matplotlib's font cache, built once here
    template.json               the manifest; written last, so it marks completeness

The backend mounts the directory read-only at :data:`GUEST_ROOT`. Because the
guest path differs from the host path, the venv must be relocatable (script
shebangs may not hold the host path) and its bytecode must be compiled at build
time (a read-only tree cannot cache ``.pyc`` files, so every import would
compile from source). The venv's ``bin/python`` is a symlink to the base
interpreter, so the backend also binds :attr:`Template.base_prefix` at the same
path when it lies outside ``/usr``.

Builds use the ``uv`` binary shipped with the ``uv`` PyPI package and never the
host's own venv. A per-name ``flock`` serialises concurrent builds, and a build
goes into a staging directory that is renamed into place only when complete.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import re
import shutil
import subprocess
import sys
import time
from collections import deque
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from sandlot._exceptions import TemplateError
from sandlot.protocol.layout import GUEST_PYTHON, TEMPLATE_GUEST

__all__ = [
    "DEFAULT_TEMPLATE",
    "GUEST_PYTHON",
    "GUEST_ROOT",
    "TEMPLATES",
    "TEMPLATE_FORMAT",
    "Template",
    "TemplateSpec",
    "build_template",
    "cache_dir",
    "default_base_python",
    "ensure_template",
    "find_template",
]

GUEST_ROOT = TEMPLATE_GUEST
"""Where the template directory is mounted (read-only) inside the sandbox."""

TEMPLATE_FORMAT = 1
"""Version of the on-disk layout and manifest; a manifest with another version is not used."""

MANIFEST_NAME = "template.json"

Progress = Callable[[str], None]


@dataclass(frozen=True, slots=True)
class TemplateSpec:
    """What a template contains: the recipe :func:`build_template` follows."""

    name: str
    packages: tuple[str, ...]
    """pip requirement strings, installed with ``uv pip install``."""
    description: str
    seed: bool = True
    """Seed pip/setuptools into the venv (``uv venv --seed``), so ``pip list`` and
    friends work inside the sandbox. Seeding fetches from the package index like
    any other package; only offline tests turn it off."""


TEMPLATES: dict[str, TemplateSpec] = {
    spec.name: spec
    for spec in (
        TemplateSpec(
            name="python-data",
            packages=(
                "pandas",
                "numpy",
                # >= 3.6 falls back per glyph along font.sans-serif, which the CJK
                # entries of our matplotlibrc rely on.
                "matplotlib>=3.6",
                "seaborn",
                "scipy",
                "scikit-learn",
                "openpyxl",
                "ipython",
            ),
            description="Data analysis: pandas, numpy, matplotlib, seaborn, scipy, "
            "scikit-learn, openpyxl, IPython.",
        ),
    )
}
DEFAULT_TEMPLATE = "python-data"


@dataclass(frozen=True, slots=True)
class Template:
    """A fully built template on the host, as described by its manifest."""

    name: str
    path: Path
    """Host directory of the template, ``<cache>/templates/<name>``."""
    base_prefix: Path
    """``sys.base_prefix`` of the interpreter the venv links to (e.g. ``/usr``)."""
    python_version: str
    """Version of that interpreter, e.g. ``"3.11.2"``."""
    packages: dict[str, str] = field(hash=False)
    """Installed distribution name -> version."""

    @property
    def python(self) -> Path:
        """The template's interpreter on the host (for host-side checks, not the sandbox)."""
        return self.path / "env" / "bin" / "python"

    @property
    def matplotlibrc(self) -> Path:
        """The matplotlibrc the runner copies into each sandbox's home."""
        return self.path / "share" / "matplotlib" / "matplotlibrc"


# Fonts that cover CJK, in order of preference. Debian's fonts-wqy-microhei
# (installed by our setup script) provides the first.
CJK_FALLBACK_FONTS = (
    "WenQuanYi Micro Hei",
    "WenQuanYi Zen Hei",
    "Noto Sans CJK SC",
    "Noto Sans CJK JP",
    "Droid Sans Fallback",
)


def _matplotlibrc(cjk_fonts: Sequence[str]) -> str:
    """The matplotlib defaults a sandbox starts with.

    Headless (agg) and crisp saved figures. For CJK text: matplotlib >= 3.6
    falls back per glyph, but only along the entries of ``font.family``; a
    generic entry such as ``sans-serif`` resolves to a single font. So the CJK
    fonts found on the host are listed in ``font.family`` after the generic
    family (which keeps a user's own ``font.sans-serif`` edits working). Fonts
    that are absent are left out of ``font.family``: matplotlib would log
    "Font family ... not found" on every draw.
    """
    family = ", ".join(["sans-serif", *cjk_fonts])
    sans = ", ".join(["DejaVu Sans", *CJK_FALLBACK_FONTS, "sans-serif"])
    return (
        "# Written by sandlot when the template was built; font.family lists the CJK\n"
        "# fonts the host had then (rebuild the template after installing more).\n"
        "backend: agg\n"
        "figure.dpi: 100\n"
        "savefig.dpi: 144\n"
        "savefig.bbox: tight\n"
        f"font.family: {family}\n"
        f"font.sans-serif: {sans}\n"
        "# CJK fonts may lack U+2212 MINUS SIGN; use the ASCII hyphen.\n"
        "axes.unicode_minus: False\n"
    )


# Run with the template's python: builds matplotlib's font cache as a side
# effect of the import, then reports which CJK fallback fonts it found.
_FONT_CACHE_SCRIPT = """\
import json, sys
from matplotlib.font_manager import fontManager
present = {entry.name for entry in fontManager.ttflist}
print(json.dumps([name for name in json.loads(sys.argv[1]) if name in present]))
"""

# Names become path components, so keep them boring: no separators, no leading
# dot (that prefix is reserved for our lock and staging entries).
_NAME_RE = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]{0,63}")

# Host variables passed to uv. Everything else is dropped so that the build does
# not depend on (or leak) the caller's environment: VIRTUAL_ENV, PYTHONPATH,
# CONDA_PREFIX and friends would otherwise redirect or pollute the install.
_INHERITED_VARS = frozenset(
    {
        "PATH",
        "HOME",
        "USER",
        "LOGNAME",
        "TMPDIR",
        "LANG",
        "LC_ALL",
        "XDG_CACHE_HOME",  # uv's cache location
        "XDG_CONFIG_HOME",  # uv's user config (index settings)
        "SSL_CERT_FILE",
        "SSL_CERT_DIR",
        "REQUESTS_CA_BUNDLE",
        "CURL_CA_BUNDLE",
    }
)
_INHERITED_PREFIXES = ("UV_", "PIP_")
_PROXY_VARS = frozenset({"http_proxy", "https_proxy", "all_proxy", "no_proxy"})
# UV_* settings that would point uv at another interpreter or environment than
# the one we name on the command line.
_DROPPED_UV_VARS = frozenset(
    {
        "UV_PYTHON",
        "UV_SYSTEM_PYTHON",
        "UV_BREAK_SYSTEM_PACKAGES",
        "UV_PROJECT_ENVIRONMENT",
        "UV_PREFIX",
        "UV_TARGET",
    }
)

_PROBE_TIMEOUT = 30.0
_ERROR_TAIL_LINES = 30


def cache_dir() -> Path:
    """Return sandlot's cache directory (templates live in its ``templates/``).

    ``$SANDLOT_CACHE_DIR`` if set; for root ``/var/cache/sandlot`` (sandboxes then
    run as an unprivileged host uid, which must be able to read the templates, and
    root's home is usually closed to other users); else ``$XDG_CACHE_HOME/sandlot``,
    else ``~/.cache/sandlot``. The directory is not created.
    """
    explicit = os.environ.get("SANDLOT_CACHE_DIR")
    if explicit:
        # Absolute because the path ends up in bind mounts and manifests.
        return Path(explicit).expanduser().absolute()
    if os.geteuid() == 0:
        return Path("/var/cache/sandlot")
    xdg = os.environ.get("XDG_CACHE_HOME")
    # The XDG spec says relative values are invalid and must be ignored.
    if xdg and os.path.isabs(xdg):
        return Path(xdg) / "sandlot"
    return Path.home() / ".cache" / "sandlot"


def default_base_python() -> Path:
    """Return the interpreter templates are built on when none is given.

    ``/usr/bin/python3`` when it exists and is at least 3.10: it sits under
    ``/usr``, which every sandbox already sees, so nothing extra is bound.
    Otherwise the base installation of the running interpreter (its
    ``sys.base_prefix``, i.e. outside any venv), so a pyenv-only host still works.
    """
    system = Path("/usr/bin/python3")
    if system.exists():
        try:
            probe = subprocess.run(
                [str(system), "-I", "-c", "import sys; sys.exit(sys.version_info < (3, 10))"],
                env=_minimal_env(),
                stdin=subprocess.DEVNULL,
                capture_output=True,
                timeout=_PROBE_TIMEOUT,
                check=False,
            )
        except (OSError, subprocess.SubprocessError):
            pass
        else:
            if probe.returncode == 0:
                return system
    major, minor = sys.version_info[:2]
    return Path(sys.base_prefix) / "bin" / f"python{major}.{minor}"


def find_template(name: str) -> Template | None:
    """Return the built template called ``name``, or ``None`` if it is not fully built.

    A template counts as built only when its manifest exists, parses, has the
    current format version and its interpreter still resolves (an OS upgrade
    can remove the base interpreter the venv links to). A directory without a
    manifest is a leftover of an interrupted build.
    """
    _check_name(name)
    path = _templates_root() / name
    return _load(path, name)


def build_template(
    name: str,
    *,
    python: Path | None = None,
    force: bool = False,
    progress: Progress | None = None,
) -> Template:
    """Build the template ``name`` from :data:`TEMPLATES` and return it.

    Without ``force``, an already built template is returned as is (a no-op).
    With ``force`` it is rebuilt and swapped in when the new one is complete.
    ``python`` is the base interpreter (default :func:`default_base_python`).
    ``progress`` receives human-readable lines, including uv's output.

    Raises :class:`TemplateError` for an unknown name or a failed build; a failed
    build leaves no trace (and never replaces a working template).
    """
    report: Progress = progress if progress is not None else _discard
    spec = TEMPLATES.get(name)
    if spec is None:
        known = ", ".join(sorted(TEMPLATES)) or "(none)"
        raise TemplateError(f"unknown template {name!r}; known templates: {known}")
    _check_name(name)
    if not force and (existing := find_template(name)) is not None:
        return existing

    root = _templates_root()
    root.mkdir(parents=True, exist_ok=True)
    with _build_lock(root, name, report):
        # Another process may have finished this build while we waited.
        if not force and (existing := find_template(name)) is not None:
            return existing
        # Holding the lock means no one else is building this name, so any
        # staging or set-aside dir left here is debris from a killed build.
        for pattern in (f".{name}.build-*", f".{name}.old-*"):
            for stale in root.glob(pattern):
                shutil.rmtree(stale, ignore_errors=True)
        staging = root / f".{name}.build-{os.getpid()}"
        started = time.monotonic()
        try:
            _build_into(staging, spec, python or default_base_python(), report)
            target = root / name
            _swap_into_place(staging, target)
        finally:
            # After a successful rename the staging path no longer exists; after
            # any failure (including KeyboardInterrupt) this removes the debris.
            shutil.rmtree(staging, ignore_errors=True)

    template = find_template(name)
    if template is None:  # pragma: no cover - only if the tree is changed under us
        raise TemplateError(f"template {name} was built but its manifest cannot be read")
    elapsed = time.monotonic() - started
    size = _tree_size(template.path) / (1024 * 1024)
    report(f"template {name} ready at {template.path} ({size:.0f} MiB, {elapsed:.0f} s)")
    return template


def ensure_template(name: str, *, progress: Progress | None = None) -> Template:
    """Return the template ``name``, building it first if it is missing."""
    template = find_template(name)
    if template is not None:
        return template
    if progress is not None:
        progress(f"template {name} is missing; building it (this can take a few minutes)")
    return build_template(name, progress=progress)


# --- building ---------------------------------------------------------------


def _build_into(staging: Path, spec: TemplateSpec, python: Path, report: Progress) -> None:
    """Build ``spec`` into ``staging``; the manifest is written last."""
    uv = _uv_bin()
    uv_env = _uv_env()
    # A pid can be reused, so a same-named leftover is possible; start clean.
    shutil.rmtree(staging, ignore_errors=True)
    staging.mkdir(parents=True)

    base = _probe_python(python)
    report(f"creating environment with {python} ({base['version']})")
    env_dir = staging / "env"
    venv_cmd = [uv, "venv", "--relocatable", "--python", str(python)]
    if spec.seed:
        venv_cmd.append("--seed")
    _run_streaming(
        [*venv_cmd, str(env_dir)], env=uv_env, cwd=staging, report=report, what="creating the venv"
    )
    env_python = env_dir / "bin" / "python"

    if spec.packages:
        report(f"installing {len(spec.packages)} packages: {' '.join(spec.packages)}")
        _run_streaming(
            [
                uv,
                "pip",
                "install",
                "--python",
                str(env_python),
                # Required, not an optimisation: the template is read-only in the
                # sandbox, so without .pyc files every import compiles from source.
                "--compile-bytecode",
                *spec.packages,
            ],
            env=uv_env,
            cwd=staging,
            report=report,
            what="installing packages",
        )

    installed = _installed_packages(uv, env_python, uv_env, cwd=staging)
    _write_matplotlib_config(staging, env_python, installed, report)

    # Ask the venv itself: that is what the backend must make visible.
    venv_info = _probe_python(env_python)
    manifest: dict[str, Any] = {
        "sandlot_template_format": TEMPLATE_FORMAT,
        "name": spec.name,
        "spec_packages": list(spec.packages),
        "python_version": venv_info["version"],
        "base_prefix": venv_info["base_prefix"],
        "base_python": str(python),
        "packages": installed,
        "built_at": datetime.now(UTC).isoformat(timespec="seconds"),
    }
    # Last, because its presence is what marks the template complete.
    tmp = staging / (MANIFEST_NAME + ".tmp")
    tmp.write_text(json.dumps(manifest, indent=2, sort_keys=True) + "\n", encoding="utf-8")
    tmp.replace(staging / MANIFEST_NAME)


def _write_matplotlib_config(
    staging: Path, env_python: Path, installed: Mapping[str, str], report: Progress
) -> None:
    """Write the matplotlibrc and pre-build matplotlib's font cache, if matplotlib is in."""
    if "matplotlib" not in installed:
        return
    mpl_dir = staging / "share" / "matplotlib"
    rc = mpl_dir / "matplotlibrc"
    cache = mpl_dir / "cache"
    cache.mkdir(parents=True)
    rc.write_text(_matplotlibrc(()), encoding="utf-8")
    report("pre-building the matplotlib font cache")
    # Scanning the system fonts takes seconds; done once here, every sandbox
    # starts with a warm cache. The env is clean so the cache reflects only the
    # host's system fonts (HOME points nowhere: no ~/.fonts of the builder) and
    # our rc. Matplotlib stores its bundled fonts relative to its data dir, so
    # the cache stays valid at the guest path.
    out = _run_captured(
        [str(env_python), "-c", _FONT_CACHE_SCRIPT, json.dumps(CJK_FALLBACK_FONTS)],
        env={
            "PATH": "/usr/bin:/bin",
            "HOME": "/nonexistent",
            "MPLCONFIGDIR": str(cache),
            "MATPLOTLIBRC": str(rc),
            "LC_ALL": "C.UTF-8",
        },
        cwd=staging,
        what="pre-building the matplotlib font cache",
    )
    if not any(cache.glob("fontlist-*.json")):
        raise TemplateError(f"matplotlib did not write its font cache into {cache}")
    try:
        found = [str(name) for name in json.loads(out)]
    except (ValueError, TypeError) as exc:
        raise TemplateError(f"unexpected output while building the font cache: {out!r}") from exc
    if found:
        report(f"CJK text in plots will use: {', '.join(found)}")
    else:
        report(
            "no CJK font found on this host, so CJK text in plots will show as boxes "
            "(on Debian: apt-get install fonts-wqy-microhei, then rebuild the template)"
        )
    # The font cache does not depend on font.family, so it stays valid.
    rc.write_text(_matplotlibrc(found), encoding="utf-8")


def _installed_packages(
    uv: str, env_python: Path, env: Mapping[str, str], *, cwd: Path
) -> dict[str, str]:
    """Return distribution name -> version for everything in the venv."""
    result = _run_captured(
        [uv, "pip", "list", "--python", str(env_python), "--format", "json"],
        env=env,
        cwd=cwd,
        what="listing installed packages",
    )
    try:
        rows = json.loads(result)
        return {str(row["name"]): str(row["version"]) for row in rows}
    except (ValueError, TypeError, KeyError) as exc:
        raise TemplateError(f"cannot parse `uv pip list` output: {exc}") from exc


def _probe_python(python: Path) -> dict[str, str]:
    """Return ``version`` and ``base_prefix`` of an interpreter, or raise TemplateError."""
    code = (
        "import json, platform, sys; "
        "print(json.dumps({'version': platform.python_version(), "
        "'base_prefix': sys.base_prefix}))"
    )
    out = _run_captured(
        # -I: ignore PYTHON* variables and the user site, which could change the answer.
        [str(python), "-I", "-c", code],
        env=_minimal_env(),
        cwd=Path("/"),
        what=f"running {python}",
    )
    try:
        info = json.loads(out)
        return {"version": str(info["version"]), "base_prefix": str(info["base_prefix"])}
    except (ValueError, TypeError, KeyError) as exc:
        raise TemplateError(f"unexpected output from {python}: {out!r}") from exc


def _swap_into_place(staging: Path, target: Path) -> None:
    """Rename the finished ``staging`` dir to ``target``, replacing what is there.

    Whatever is at ``target`` is either an outdated template (force) or debris of
    an interrupted build (no manifest); the caller holds the build lock.
    """
    if not target.exists() and not target.is_symlink():
        staging.rename(target)
        return
    # rename() cannot replace a non-empty directory, so move the old one aside
    # first: that keeps the window without a template at two renames.
    old = target.with_name(f".{target.name}.old-{os.getpid()}")
    shutil.rmtree(old, ignore_errors=True)
    target.rename(old)
    try:
        staging.rename(target)
    except BaseException:
        old.rename(target)
        raise
    shutil.rmtree(old, ignore_errors=True)


@contextlib.contextmanager
def _build_lock(root: Path, name: str, report: Progress) -> Iterator[None]:
    """Hold an exclusive flock on ``<root>/.<name>.lock``.

    flock is released by the kernel when the process dies, so a killed build
    never leaves the template locked.
    """
    lock_path = root / f".{name}.lock"
    fd = os.open(lock_path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            report(f"waiting for another process that is building template {name}")
            fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)  # also releases the lock


# --- subprocesses -----------------------------------------------------------


def _uv_bin() -> str:
    try:
        from uv import find_uv_bin
    except ImportError as exc:
        raise TemplateError("the `uv` package is required to build templates") from exc
    try:
        return find_uv_bin()
    except FileNotFoundError as exc:
        raise TemplateError(f"cannot find the uv binary: {exc}") from exc


def _minimal_env() -> dict[str, str]:
    """An environment for probing interpreters: no PYTHON*, no venv, C.UTF-8."""
    return {"PATH": os.environ.get("PATH", "/usr/bin:/bin"), "LC_ALL": "C.UTF-8"}


def _uv_env() -> dict[str, str]:
    """The host environment reduced to what uv needs: paths, index settings, certs, proxies."""
    env: dict[str, str] = {}
    for key, value in os.environ.items():
        if key in _DROPPED_UV_VARS:
            continue
        if (
            key in _INHERITED_VARS
            or key.startswith(_INHERITED_PREFIXES)
            or key.lower() in _PROXY_VARS
        ):
            env[key] = value
    env.setdefault("PATH", "/usr/bin:/bin")
    # Plain lines for the progress callback: no colours, no progress bars.
    env["NO_COLOR"] = "1"
    env["UV_NO_PROGRESS"] = "1"
    return env


def _run_streaming(
    cmd: Sequence[str], *, env: Mapping[str, str], cwd: Path, report: Progress, what: str
) -> None:
    """Run ``cmd``, passing each output line to ``report``; raise TemplateError on failure.

    ``cwd`` matters for uv: it discovers project configuration (pyproject.toml,
    uv.toml) from the working directory, and the caller's project must not
    influence the template.
    """
    tail: deque[str] = deque(maxlen=_ERROR_TAIL_LINES)
    try:
        with subprocess.Popen(
            list(cmd),
            env=dict(env),
            cwd=cwd,
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            encoding="utf-8",
            errors="replace",
        ) as proc:
            assert proc.stdout is not None
            for raw in proc.stdout:
                line = raw.rstrip()
                if line:
                    tail.append(line)
                    report(line)
            returncode = proc.wait()
    except OSError as exc:
        raise TemplateError(f"{what} failed: cannot run {cmd[0]}: {exc}") from exc
    if returncode != 0:
        detail = "\n".join(tail) or "(no output)"
        raise TemplateError(f"{what} failed (exit status {returncode}):\n{detail}")


def _run_captured(cmd: Sequence[str], *, env: Mapping[str, str], cwd: Path, what: str) -> str:
    """Run ``cmd`` and return its stdout; raise TemplateError with its stderr on failure."""
    try:
        result = subprocess.run(
            list(cmd),
            env=dict(env),
            cwd=cwd,
            stdin=subprocess.DEVNULL,
            capture_output=True,
            text=True,
            encoding="utf-8",
            errors="replace",
            timeout=300,
            check=False,
        )
    except (OSError, subprocess.SubprocessError) as exc:
        raise TemplateError(f"{what} failed: {exc}") from exc
    if result.returncode != 0:
        lines = (result.stderr or result.stdout).strip().splitlines()
        detail = "\n".join(lines[-_ERROR_TAIL_LINES:]) or "(no output)"
        raise TemplateError(f"{what} failed (exit status {result.returncode}):\n{detail}")
    return result.stdout


# --- helpers ----------------------------------------------------------------


def _discard(_line: str) -> None:
    pass


def _templates_root() -> Path:
    return cache_dir() / "templates"


def _check_name(name: str) -> None:
    if not _NAME_RE.fullmatch(name):
        raise TemplateError(f"invalid template name {name!r}")


def _load(path: Path, name: str) -> Template | None:
    """Read and validate the manifest in ``path``; ``None`` if anything is off."""
    try:
        data = json.loads((path / MANIFEST_NAME).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    if not isinstance(data, dict) or data.get("sandlot_template_format") != TEMPLATE_FORMAT:
        return None
    packages = data.get("packages")
    python_version = data.get("python_version")
    base_prefix = data.get("base_prefix")
    if (
        data.get("name") != name
        or not isinstance(python_version, str)
        or not isinstance(base_prefix, str)
        or not isinstance(packages, dict)
        or not all(isinstance(k, str) and isinstance(v, str) for k, v in packages.items())
    ):
        return None
    # exists() follows the symlink to the base interpreter: a venv whose base
    # Python was uninstalled is as good as missing.
    if not (path / "env" / "bin" / "python").exists():
        return None
    return Template(
        name=name,
        path=path,
        base_prefix=Path(base_prefix),
        python_version=python_version,
        packages=dict(packages),
    )


def _tree_size(path: Path) -> int:
    """Bytes used by the files under ``path``, counting hard links once."""
    seen: set[tuple[int, int]] = set()
    total = 0
    for dirpath, _dirs, files in os.walk(path):
        for filename in files:
            try:
                st = os.lstat(os.path.join(dirpath, filename))
            except OSError:
                continue
            key = (st.st_dev, st.st_ino)
            if key not in seen:
                seen.add(key)
                total += st.st_size
    return total
