"""Test-only backends whose sandboxes were checkpointed and restored: the escape suite
runs against them (``SANDLOT_BACKENDS=restored,forked``; tests/conftest.py).

Both wrap the bubblewrap backend, and hand out what a user of pause, resume, snapshots
and fork gets (docs/persistence.md):

* ``restored``: a checkpointable sandbox is started, given some state (a variable, a
  file in the home directory, a background child process),
  checkpointed, and restored; the restored copy is the sandbox (what ``pause()`` then
  ``connect()`` gives).
* ``forked``: one of two copies restored from one checkpoint (what ``fork()`` gives);
  its twin is killed once both run (each copy got host ids of its own).

Every sandbox start (the SDK restarts a dead sandbox through ``start()`` as well) goes
through CRIU that way. Each checkpoint lives in a directory of its own under
``/var/tmp`` (mode 0711: a restore needs every ancestor reachable), removed once the
copies are restored. A restored sandbox is checked to have its state back before it is
handed out, so a restore that silently lost the sandbox's memory cannot pass as one.
"""

from __future__ import annotations

import contextlib
import dataclasses
import shutil
import tempfile
from pathlib import Path
from typing import Any

from sandlot import CheckpointError
from sandlot.backends import SandboxHandle
from sandlot.backends.bwrap import BwrapBackend
from sandlot.policy import SandboxSpec

STORE_PARENT = "/var/tmp"
CELL_TIMEOUT = 60.0

PLANT = """
import subprocess
_sandlot_restored = 41
with open("/home/user/.sandlot-restored", "w") as _f:
    _f.write("kept")
_sandlot_child = subprocess.Popen(["sleep", "infinity"])
_sandlot_restored + 1
"""
"""Cell code that leaves state in the sandbox (a variable, a file in the home directory,
a child process); its result is 42."""
CHECK = (
    """(_sandlot_restored, open("/home/user/.sandlot-restored").read(), _sandlot_child.poll())"""
)
RESTORED = "(41, 'kept', None)"
"""What :data:`CHECK` gives in a sandbox restored with that state."""


def run_cell(handle: SandboxHandle, code: str) -> str | None:
    """Run ``code`` in the default context; the text of its result (error if it raised)."""
    stream = handle.request(
        {"type": "execute", "code": code, "context": "default", "envs": {}, "timeout": 30}
    )
    text: str | None = None
    try:
        while True:
            event = stream.next(CELL_TIMEOUT)
            if event is None:
                raise CheckpointError("a cell in the sandbox to be checkpointed did not finish")
            kind = event["type"]
            if kind == "error":
                raise CheckpointError(f"a cell in the sandbox failed: {event}")
            if kind == "result" and event.get("is_main_result"):
                text = event["data"].get("text/plain")
            if kind in ("exit", "reply"):
                return text
    finally:
        stream.close()


class RestoredBackend(BwrapBackend):
    """``restored``: every sandbox is a copy restored from a checkpoint of one that ran."""

    name = "restored"

    def start(self, spec: SandboxSpec) -> SandboxHandle:
        spec = dataclasses.replace(spec, checkpointable=True)
        handle = super().start(spec)
        try:
            if run_cell(handle, PLANT) != "42":
                raise CheckpointError("the state to checkpoint was not planted")
            handle = self._carry_on(handle, spec)
            got = run_cell(handle, CHECK)
            if got != RESTORED:
                raise CheckpointError(f"restored without its state: {got} != {RESTORED}")
        except BaseException:
            handle.kill()
            raise
        return handle

    def _carry_on(self, handle: SandboxHandle, spec: SandboxSpec) -> SandboxHandle:
        """Checkpoint ``handle`` (which ends it); the copy restored from it."""
        return self._copies(handle, spec, 1)[0]

    def _copies(self, handle: SandboxHandle, spec: SandboxSpec, count: int) -> list[Any]:
        store = Path(tempfile.mkdtemp(prefix="sandlot-escape-ckpt-", dir=STORE_PARENT))
        try:
            store.chmod(0o711)
            images = store / "images"
            images.mkdir(mode=0o700)
            handle.checkpoint(str(images))
            copies: list[SandboxHandle] = []
            try:
                for _ in range(count):
                    copies.append(self.restore(str(images), spec))
            except BaseException:
                for copy in copies:
                    with contextlib.suppress(Exception):
                        copy.kill()
                raise
            return copies
        finally:
            shutil.rmtree(store, ignore_errors=True)


class ForkedBackend(RestoredBackend):
    """``forked``: every sandbox is one of two copies restored from one checkpoint."""

    name = "forked"

    def _carry_on(self, handle: SandboxHandle, spec: SandboxSpec) -> SandboxHandle:
        kept, twin = self._copies(handle, spec, 2)
        twin.kill()
        return kept


BACKENDS: dict[str, type[RestoredBackend]] = {"restored": RestoredBackend, "forked": ForkedBackend}
