"""Templates as images: a generated Dockerfile, built through the engine's API.

``sandlot template build --backend docker [--base IMAGE]`` builds
``sandlot/template-<name>:<recipe hash>`` from :func:`dockerfile`. The base defaults to an
official slim Python image (:data:`DEFAULT_BASE`) for hosts with a registry; offline
hosts pass a locally built one (CI: ``sandlot/base:bookworm``, made by
``scripts/setup-docker.sh`` from the Debian mirror). Packages the base already has
are used as they are; missing ones are installed from the package index during the
build (the build, unlike a sandbox, may use the network).
"""

from __future__ import annotations

import hashlib
import io
import json
import os
import tarfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

from sandlot._exceptions import TemplateError
from sandlot.backends.docker._engine import Engine
from sandlot.protocol.layout import HOME, SANDBOX_GID, SANDBOX_UID
from sandlot.templates import CJK_FALLBACK_FONTS, TEMPLATES, _matplotlibrc

DEFAULT_BASE = "python:3.12-slim"
"""Base image when none is given: an official slim Python image (needs a registry)."""
BASE_ENV = "SANDLOT_DOCKER_BASE"
"""Environment variable overriding :data:`DEFAULT_BASE`."""
IMAGE_FORMAT = "2"
"""Version of the image layout; an image with another version is rebuilt."""
LABEL_TEMPLATE = "org.sandlot.template"
LABEL_KEY = "org.sandlot.template-key"

Progress = Callable[[str], None]


def image_name(template: str) -> str:
    """``sandlot/template-<name>:<recipe>``: the tag names the recipe and build script,
    so checkouts of different sandlot versions sharing one engine never use each
    other's image."""
    recipe = hashlib.sha256(
        IMAGE_FORMAT.encode()
        + (Path(__file__).parent / "_image_build.py").read_bytes()
        + json.dumps(build_config(template), sort_keys=True).encode()
    ).hexdigest()[:12]
    return f"sandlot/template-{template}:{recipe}"


def default_base() -> str:
    return os.environ.get(BASE_ENV) or DEFAULT_BASE


def dockerfile(base: str, template: str) -> str:
    """The Dockerfile for ``template`` on ``base`` (pure; golden-tested)."""
    return (
        f"FROM {base}\n"
        f'LABEL {LABEL_TEMPLATE}="{template}" org.sandlot.image-format="{IMAGE_FORMAT}"\n'
        "COPY build.py config.json /sandlot-build/\n"
        'RUN python3 /sandlot-build/build.py "$(cat /sandlot-build/config.json)" '
        "&& rm -rf /sandlot-build\n"
        f"USER {SANDBOX_UID}:{SANDBOX_GID}\n"
        f"WORKDIR {HOME}\n"
    )


def build_config(template: str) -> dict[str, Any]:
    spec = TEMPLATES.get(template)
    if spec is None:
        raise TemplateError(f"unknown template {template!r}; known: {', '.join(TEMPLATES)}")
    return {
        "packages": list(spec.packages),
        "cjk_fonts": list(CJK_FALLBACK_FONTS),
        "matplotlibrc": _matplotlibrc([]),
    }


def _context(base: str, template: str) -> tuple[bytes, str]:
    """The build context as a tar archive, and a key naming its exact content."""
    files = {
        "Dockerfile": dockerfile(base, template).encode(),
        "build.py": (Path(__file__).parent / "_image_build.py").read_bytes(),
        "config.json": json.dumps(build_config(template), sort_keys=True).encode(),
    }
    key = hashlib.sha256()
    buffer = io.BytesIO()
    with tarfile.open(fileobj=buffer, mode="w") as archive:
        for name, data in sorted(files.items()):
            key.update(name.encode() + b"\0" + data + b"\0")
            info = tarfile.TarInfo(name)
            info.size = len(data)
            info.mode = 0o644
            archive.addfile(info, io.BytesIO(data))
    return buffer.getvalue(), key.hexdigest()[:16]


def image_current(engine: Engine, template: str) -> bool:
    """Whether the engine has the template's image in the current format."""
    labels = engine.image_labels(image_name(template))
    return labels is not None and labels.get("org.sandlot.image-format") == IMAGE_FORMAT


def build_image(
    engine: Engine,
    template: str,
    *,
    base: str | None = None,
    force: bool = False,
    progress: Progress | None = None,
) -> str:
    """Build (or reuse) the template's image; returns its name.

    Reused when an image built from the same context (base, recipe, build script)
    exists, unless ``force``. Raises :class:`TemplateError` with the build's last
    lines when the engine cannot build it (e.g. the base is not available offline).
    """
    import docker.errors

    base = base or default_base()
    context, key = _context(base, template)
    name = image_name(template)
    labels = engine.image_labels(name)
    if not force and labels is not None and labels.get(LABEL_KEY) == key:
        return name
    if progress is not None:
        progress(f"building {engine.kind.name} image {name} from {base} (once)")
    tail: list[str] = []
    try:
        stream = engine.api.build(
            fileobj=io.BytesIO(context),
            custom_context=True,
            tag=name,
            rm=True,
            forcerm=True,
            pull=False,
            # The build may reach the package index; the sandboxes never get a network.
            network_mode="host",
            labels={LABEL_KEY: key, LABEL_TEMPLATE: template},
            decode=True,
        )
        for chunk in stream:
            if "error" in chunk:
                tail.append(str(chunk["error"]))
                raise TemplateError(
                    f"building image {name} from {base} failed: {chunk['error']}\n"
                    + "\n".join(tail[-20:])
                    + f"\nFix: pass a base image this host has (--base, ${BASE_ENV})."
                )
            line = str(chunk.get("stream", "")).rstrip()
            if line:
                tail.append(line)
    except docker.errors.APIError as exc:
        raise TemplateError(
            f"building image {name} from {base} failed: {exc.explanation or exc}. "
            f"Fix: pass a base image this host has (--base, ${BASE_ENV})."
        ) from exc
    if not image_current(engine, template):
        raise TemplateError(f"the engine reported no error but has no image {name}")
    return name
