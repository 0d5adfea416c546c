"""sandlot: run untrusted, LLM-generated Python in a real OS sandbox, fast, with rich results.

::

    from sandlot import Sandbox

    with Sandbox() as sbx:
        sbx.run_code("import pandas as pd; df = pd.DataFrame({'x': [1, 2, 3]})")
        execution = sbx.run_code("df.x.sum()")
        print(execution.text)  # 6

The API mirrors ``e2b_code_interpreter``; see README.md.
"""

from sandlot._async import AsyncCommandHandle, AsyncSandbox
from sandlot._checkpoints import is_snapshot_id
from sandlot._exceptions import (
    AuthenticationError,
    BackendError,
    BackendUnavailable,
    CheckpointError,
    CommandExitError,
    ContextNotFoundError,
    FileOperationError,
    InvalidArgumentError,
    IsolationUnavailable,
    ModelError,
    NodeLost,
    NotFoundError,
    PathNotAllowedError,
    PolicyError,
    ProcessLimitError,
    ProcessNotFoundError,
    ProtocolError,
    QuotaExceeded,
    SandboxClosed,
    SandboxLost,
    SandboxStartError,
    SandlotError,
    ServerError,
    TemplateError,
    WatchLimitError,
)
from sandlot._fold import stream_only
from sandlot._models import (
    CommandResult,
    Context,
    EntryInfo,
    Execution,
    ExecutionError,
    ExecutionFailed,
    FileType,
    Logs,
    NetworkEvent,
    OutputMessage,
    ProcessInfo,
    PtySize,
    ResourceUsage,
    Result,
    SnapshotInfo,
    WriteInfo,
)
from sandlot._process import CommandHandle
from sandlot._sandbox import Sandbox
from sandlot._watch import FilesystemEvent, WatchHandle
from sandlot.policy import NetworkPolicy, Resources
from sandlot.pool import Pool, PoolStats
from sandlot.precheck import PrecheckReport

__version__ = "0.1.0"

__all__ = [
    "AsyncCommandHandle",
    "AsyncSandbox",
    "AuthenticationError",
    "BackendError",
    "BackendUnavailable",
    "CheckpointError",
    "CommandExitError",
    "CommandHandle",
    "CommandResult",
    "Context",
    "ContextNotFoundError",
    "EntryInfo",
    "Execution",
    "ExecutionError",
    "ExecutionFailed",
    "FileOperationError",
    "FileType",
    "FilesystemEvent",
    "InvalidArgumentError",
    "IsolationUnavailable",
    "Logs",
    "ModelError",
    "NetworkEvent",
    "NetworkPolicy",
    "NodeLost",
    "NotFoundError",
    "OutputMessage",
    "PathNotAllowedError",
    "PolicyError",
    "Pool",
    "PoolStats",
    "PrecheckReport",
    "ProcessInfo",
    "ProcessLimitError",
    "ProcessNotFoundError",
    "ProtocolError",
    "PtySize",
    "QuotaExceeded",
    "ResourceUsage",
    "Resources",
    "Result",
    "Sandbox",
    "SandboxClosed",
    "SandboxLost",
    "SandboxStartError",
    "SandlotError",
    "ServerError",
    "SnapshotInfo",
    "TemplateError",
    "WatchHandle",
    "WatchLimitError",
    "WriteInfo",
    "__version__",
    "is_snapshot_id",
    "stream_only",
]

for _name in __all__:
    _obj = globals()[_name]
    if isinstance(_obj, type):
        _obj.__module__ = "sandlot"
del _name, _obj
