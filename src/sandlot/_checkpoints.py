"""Where paused sandboxes and snapshots live on this machine: the checkpoint store.

One directory per checkpoint under :func:`default_root` (``$SANDLOT_CHECKPOINT_DIR``,
else ``/var/lib/sandlot/checkpoints``)::

    <root>/<id>/            mode 0711: reachable, not listable
        info.json           what the SDK needs to bring it back (kind, sandbox id,
                            template, limits, envs, metadata, name, owner, created)
        images/             mode 0700: the backend's checkpoint (CRIU images)

``kind`` is ``pause`` (the id is the paused sandbox's own id: one per sandbox, gone
once it is resumed) or ``snapshot`` (``snap-<hex>``: kept until deleted, any number of
sandboxes start from it). Directories and ``info.json`` are written by this process
(root) only; a checkpoint's images are trusted on restore, so nothing of a
sandbox's may ever write here.
"""

from __future__ import annotations

import contextlib
import json
import os
import secrets
import shutil
import time
from collections.abc import Iterator, Mapping
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from sandlot._exceptions import CheckpointError, InvalidArgumentError
from sandlot.policy import Resources

ROOT_ENV = "SANDLOT_CHECKPOINT_DIR"
DEFAULT_ROOT = "/var/lib/sandlot/checkpoints"
SNAPSHOT_PREFIX = "snap-"
_ID_CHARS = set("abcdefghijklmnopqrstuvwxyz0123456789-")


def default_root() -> Path:
    return Path(os.environ.get(ROOT_ENV) or DEFAULT_ROOT)


def is_snapshot_id(value: str) -> bool:
    return value.startswith(SNAPSHOT_PREFIX) and _valid_id(value)


def _valid_id(value: str) -> bool:
    return 0 < len(value) <= 64 and set(value) <= _ID_CHARS and not value.startswith("-")


@dataclass(frozen=True, slots=True)
class CheckpointRecord:
    """``info.json``: a checkpoint as the SDK sees it."""

    id: str
    kind: str
    """``pause`` or ``snapshot``."""
    sandbox_id: str
    """The sandbox it was taken from."""
    template: str
    resources: Resources
    envs: Mapping[str, str] = field(default_factory=dict)
    metadata: Mapping[str, str] = field(default_factory=dict)
    unsafe_best_effort_limits: bool = False
    name: str = ""
    owner: str = ""
    """Who may use it (a server's tenant; empty locally)."""
    created: float = 0.0
    size: int = 0
    """Bytes on disk (images included)."""

    def to_json(self) -> dict[str, Any]:
        data = asdict(self)
        data["resources"] = asdict(self.resources)
        data["envs"] = dict(self.envs)
        data["metadata"] = dict(self.metadata)
        return data

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> CheckpointRecord:
        values = dict(data)
        values["resources"] = Resources.coerce(values.get("resources"))
        known = set(cls.__dataclass_fields__)
        return cls(**{k: v for k, v in values.items() if k in known})


class CheckpointStore:
    """The checkpoints under one root directory (created on first use, root's only)."""

    def __init__(self, root: Path | str | None = None) -> None:
        self.root = Path(root) if root is not None else default_root()

    def _ready(self) -> None:
        # Every directory from / down to the store must be reachable (o+x) by a
        # restored sandbox's own host ids: CRIU's restored processes open their images
        # as them. Reachable, not listable: checkpoint ids are not handed out.
        created = []
        for part in [*reversed(self.root.parents), self.root]:
            if not part.exists():
                part.mkdir(mode=0o711)
                created.append(part)
        for part in created:
            part.chmod(0o711)

    def path(self, checkpoint_id: str) -> Path:
        if not _valid_id(checkpoint_id):
            raise InvalidArgumentError(f"not a checkpoint id: {checkpoint_id!r}")
        return self.root / checkpoint_id

    def create(self, info: CheckpointRecord) -> Path:
        """A new, empty checkpoint directory for ``info``; returns its ``images`` dir
        (the backend writes there). :meth:`commit` it once the images are written."""
        self._ready()
        home = self.path(info.id)
        try:
            home.mkdir(mode=0o711)
        except FileExistsError:
            raise CheckpointError(f"checkpoint {info.id} exists already") from None
        home.chmod(0o711)
        images = home / "images"
        images.mkdir(mode=0o700)
        return images

    def commit(self, info: CheckpointRecord) -> CheckpointRecord:
        """Record ``info`` (with the size on disk) once its images are complete."""
        home = self.path(info.id)
        size = sum(p.stat().st_size for p in home.rglob("*") if p.is_file())
        done = CheckpointRecord.from_json({**info.to_json(), "size": size, "created": time.time()})
        tmp = home / "info.json.tmp"
        tmp.write_text(json.dumps(done.to_json()))
        os.replace(tmp, home / "info.json")
        return done

    def get(self, checkpoint_id: str) -> CheckpointRecord | None:
        """The checkpoint, or None if there is none (or it is incomplete)."""
        try:
            text = (self.path(checkpoint_id) / "info.json").read_text()
        except (OSError, InvalidArgumentError):
            return None
        try:
            return CheckpointRecord.from_json(json.loads(text))
        except (ValueError, TypeError):
            return None

    def images(self, checkpoint_id: str) -> Path:
        return self.path(checkpoint_id) / "images"

    def list(self, kind: str | None = None) -> Iterator[CheckpointRecord]:
        if not self.root.is_dir():
            return
        for entry in sorted(self.root.iterdir()):
            info = self.get(entry.name)
            if info is not None and (kind is None or info.kind == kind):
                yield info

    def delete(self, checkpoint_id: str) -> bool:
        """Remove the checkpoint; False if there was none."""
        home = self.path(checkpoint_id)
        if not home.exists():
            return False
        # info.json first: a half-removed checkpoint is never listed or restored.
        with contextlib.suppress(FileNotFoundError):
            (home / "info.json").unlink()
        shutil.rmtree(home, ignore_errors=True)
        return True


def new_snapshot_id() -> str:
    return SNAPSHOT_PREFIX + secrets.token_hex(12)
