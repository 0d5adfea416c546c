"""sandlot's exceptions: one tree, one root.

::

    SandlotError                    root: ``except sandlot.SandlotError`` catches all we raise
    ├── InvalidArgumentError        bad input to an API call (path, language, size)   [exit 2]
    ├── PolicyError                 an invalid or unsatisfiable policy/resources     [exit 2]
    ├── TemplateError               a template is missing, broken or failed to build [exit 3]
    ├── BackendError                the isolation layer failed                       [exit 4]
    │   ├── BackendUnavailable      prerequisites missing (bwrap, user namespaces);
    │   │                           the message says how to fix the host
    │   ├── IsolationUnavailable    a layer the policy requires cannot be applied:
    │   │                           sandlot refuses to run (fail closed)
    │   ├── SandboxStartError       the sandbox process did not come up
    │   └── CheckpointError         a sandbox could not be checkpointed or restored
    │                               (its backend or layout cannot be; CRIU's reason)
    ├── SandboxLost                 the sandbox died outside a cell; restarts on next use [exit 5]
    │   └── NodeLost                the cluster node holding it left (sandlot.ray): the
    │                               sandbox and its state are gone for good
    ├── SandboxClosed               the sandbox was used after ``kill()``              [exit 5]
    ├── ProtocolError               the runner sent something the protocol forbids     [exit 5]
    ├── FileOperationError          a files.* call failed inside the sandbox           [exit 1]
    │   ├── NotFoundError           no such file or directory
    │   └── PathNotAllowedError     outside the workspace (/home/user, /tmp), or reaching
    │                               out of it through a symlink; nothing was read or written
    ├── ContextNotFoundError        no such code context                               [exit 1]
    ├── CommandExitError            a background command's ``wait()`` saw a non-zero exit [exit 1]
    ├── ProcessNotFoundError        no running process with that pid in the sandbox    [exit 1]
    ├── ProcessLimitError           the sandbox runs its limit of background processes [exit 1]
    ├── WatchLimitError             the sandbox's cap on directory watches is reached  [exit 1]
    ├── ModelError                  a model provider's API failed (agent, ``sandlot chat``) [exit 6]
    ├── ServerError                 a sandlot server refused or failed a request      [exit 7]
    │   ├── AuthenticationError     missing, wrong or revoked API key (HTTP 401)
    │   └── QuotaExceeded           a tenant quota is full (HTTP 429); retry later
    └── ExecutionFailed             only from ``Execution.raise_for_error()``           [exit 1]
                                    (defined in ``sandlot._models`` beside ``Execution``,
                                    so this module imports nothing of sandlot's)

Errors in user code, timeouts, out-of-memory kills and truncated output are
*values* on :class:`sandlot.Execution`; ``run_code`` never raises them.
"""

from __future__ import annotations

from typing import ClassVar


class SandlotError(Exception):
    """Root of every exception sandlot raises."""

    exit_code: ClassVar[int] = 1
    """Process exit status the CLI uses for this error."""


class InvalidArgumentError(SandlotError, ValueError):
    exit_code = 2


class PolicyError(SandlotError, ValueError):
    exit_code = 2


class TemplateError(SandlotError):
    exit_code = 3


class BackendError(SandlotError):
    exit_code = 4


class BackendUnavailable(BackendError):
    """No backend can isolate code on this host; the message lists each reason and fix."""


class IsolationUnavailable(BackendError):
    """A layer the policy requires cannot be applied, so sandlot refuses to run."""


class SandboxStartError(BackendError):
    """The sandbox process exited or stayed silent while starting."""


class CheckpointError(BackendError):
    """A sandbox could not be checkpointed (paused, snapshotted, forked) or restored:
    its backend or namespace layout cannot be, the host lacks CRIU, or CRIU failed
    (the message carries its reason)."""


class SandboxLost(SandlotError):
    """The sandbox went away while no cell was running (e.g. killed from outside)."""

    exit_code = 5


class NodeLost(SandboxLost):
    """The Ray node holding the sandbox left the cluster (:mod:`sandlot.ray`), or its
    sandlot node actor died: the sandbox, its files and its state are gone for good and
    nothing restarts it. Other nodes' sandboxes are untouched. In a batch the same loss
    is data: ``Execution.status == "died"``, ``error.name == "SandboxLostError"``."""


class SandboxClosed(SandlotError):
    exit_code = 5


class ProtocolError(SandlotError):
    """The runner broke the wire protocol; the sandbox is killed and treated as hostile."""

    exit_code = 5


class FileOperationError(SandlotError):
    """A files.* call failed inside the sandbox (permission, not a directory, ...)."""


class NotFoundError(FileOperationError, FileNotFoundError):
    """The file, directory or path does not exist inside the sandbox."""


class PathNotAllowedError(FileOperationError, PermissionError):
    """A files.* path names something outside the sandbox workspace (``/home/user`` and
    ``/tmp``), escapes it with ``..``, resolves out of it through a symlink, or would
    write through a symlink. Checked on the host and again inside the sandbox."""


class ContextNotFoundError(SandlotError, KeyError):
    def __str__(self) -> str:
        return str(self.args[0]) if self.args else "context not found"


class CommandExitError(SandlotError):
    """A command waited on through its handle (``CommandHandle.wait()``) exited with a
    non-zero code. Carries the whole result, as ``CommandResult`` does; E2B's
    ``CommandExitException`` has the same fields."""

    def __init__(self, stdout: str, stderr: str, exit_code: int, error: str | None) -> None:
        self.stdout = stdout
        self.stderr = stderr
        # E2B's name for the command's status. It shadows the CLI's exit status for this
        # class on purpose: the CLI then exits with the command's own code.
        self.exit_code = exit_code  # type: ignore[misc]
        self.error = error
        super().__init__(str(self))

    def __str__(self) -> str:
        return f"Command exited with code {self.exit_code} and error:\n{self.stderr}"


class ProcessNotFoundError(SandlotError, LookupError):
    """No running background process or terminal has this pid in the sandbox (it
    exited, was killed, or never existed)."""


class ProcessLimitError(SandlotError):
    """The sandbox already runs as many background processes and terminals as its
    ``resources.background_processes`` allows; kill one first."""


class WatchLimitError(SandlotError):
    """The sandbox already has as many directory watches as it may (a cap per sandbox),
    or the host's inotify quota for it is used up; stop a watch first."""


class ModelError(SandlotError):
    """The model API failed: unreachable, refused the key, or answered out of protocol."""

    exit_code = 6


class ServerError(SandlotError):
    """The sandlot server (remote mode) could not be reached or refused the request."""

    exit_code = 7

    def __init__(self, message: str, status: int | None = None) -> None:
        super().__init__(message)
        self.status = status
        """The HTTP status, when the server answered."""


class AuthenticationError(ServerError):
    """The server did not accept the API key (missing, wrong or revoked)."""


class QuotaExceeded(ServerError):
    """A tenant quota (concurrent sandboxes, creation rate, memory) is used up."""
