"""The ``execute_python`` tool: its definitions, tool-call parsing, and the dispatcher.

The tool has the name, description and single ``code`` parameter that E2B's
examples give it, so prompts and agents written for E2B work unchanged. The
definitions are plain dicts in each provider's request shape (checked against
``openai.types.chat.ChatCompletionToolParam`` and ``anthropic.types.ToolParam`` in
the tests); nothing here imports an SDK, so ``sandlot.tools`` works without the
``llm`` extra.
"""

from __future__ import annotations

import copy
import json
import re
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Literal

from sandlot import EntryInfo, Execution, InvalidArgumentError, SandlotError
from sandlot.tools._content import (
    ContentOptions,
    FileChange,
    ModelContent,
    anthropic_tool_result,
    file_changes,
    model_content,
    openai_tool_messages,
    text_content,
)

if TYPE_CHECKING:
    from sandlot import AsyncSandbox, Sandbox

TOOL_NAME = "execute_python"
TOOL_DESCRIPTION = "Execute python code in a Jupyter notebook cell and return result"
CODE_DESCRIPTION = "The python code to execute in a single cell"

_PARAMETERS: dict[str, Any] = {
    "type": "object",
    "properties": {"code": {"type": "string", "description": CODE_DESCRIPTION}},
    "required": ["code"],
}

Provider = Literal["openai", "anthropic"]

WORKSPACE_DEPTH = 3
"""How deep the workspace listing goes when looking for files a cell created."""


def openai_tool(description: str = TOOL_DESCRIPTION) -> dict[str, Any]:
    """The tool for chat completions' ``tools=[...]`` (``ChatCompletionToolParam``)."""
    return {
        "type": "function",
        "function": {
            "name": TOOL_NAME,
            "description": description,
            "parameters": copy.deepcopy(_PARAMETERS),
        },
    }


def anthropic_tool(description: str = TOOL_DESCRIPTION) -> dict[str, Any]:
    """The tool for messages' ``tools=[...]`` (``anthropic.types.ToolParam``)."""
    return {
        "name": TOOL_NAME,
        "description": description,
        "input_schema": copy.deepcopy(_PARAMETERS),
    }


@dataclass(frozen=True, slots=True)
class ToolCall:
    """A provider's tool call, normalised.

    ``problem`` is set when the call cannot run as given (another tool's name,
    arguments that are not JSON, no ``code`` string); the dispatcher then answers
    the model with that text instead of running anything, so the model can retry.
    """

    id: str
    name: str
    arguments: Mapping[str, Any]
    provider: Provider
    problem: str | None = None

    @property
    def code(self) -> str:
        """The ``code`` argument ("" when there is none)."""
        code = self.arguments.get("code")
        return code if isinstance(code, str) else ""


def _field(obj: object, name: str) -> Any:
    """``obj.name`` or ``obj[name]``: SDK objects and their dict forms look alike."""
    if isinstance(obj, Mapping):
        return obj.get(name)
    return getattr(obj, name, None)


def parse_tool_call(call: object) -> ToolCall:
    """Normalise a tool call from either SDK, or the same call as a dict.

    Accepts an ``openai`` ``ChatCompletionMessageFunctionToolCall`` (``.id``,
    ``.function.name``, ``.function.arguments`` as a JSON string) and an
    ``anthropic`` ``ToolUseBlock`` (``type == "tool_use"``, ``.id``, ``.name``,
    ``.input``). Raises :class:`sandlot.InvalidArgumentError` for anything else.
    """
    call_id = _field(call, "id")
    provider: Provider
    if _field(call, "type") == "tool_use":
        name, raw, provider = _field(call, "name"), _field(call, "input"), "anthropic"
    elif _field(call, "function") is not None:
        function = _field(call, "function")
        name, raw, provider = _field(function, "name"), _field(function, "arguments"), "openai"
    else:
        raise InvalidArgumentError(
            f"not an OpenAI or Anthropic tool call: {type(call).__name__} has neither "
            "type='tool_use' nor a function"
        )
    if not isinstance(call_id, str) or not isinstance(name, str):
        raise InvalidArgumentError("a tool call needs a string id and name")
    arguments, problem = _arguments(raw)
    if problem is None and name != TOOL_NAME:
        problem = f"unknown tool {name!r}; the only tool is {TOOL_NAME!r}"
    if problem is None and not isinstance(arguments.get("code"), str):
        problem = f"{TOOL_NAME} needs a string argument 'code' with the Python to run"
    if problem is None:
        arguments["code"] = _unfenced(arguments["code"])
    return ToolCall(call_id, name, arguments, provider, problem)


_FENCE = re.compile(r"\A\s*```[\w+-]*[ \t]*\n(?P<body>.*?)\n?```\s*\Z", re.DOTALL)


def _unfenced(code: str) -> str:
    """``code`` without a Markdown fence around it. Smaller local models often send
    ```` ```python ... ``` ```` as the code; as Python that is a SyntaxError, so
    unwrapping it can only turn a certain failure into the intended cell."""
    match = _FENCE.match(code)
    return match.group("body") if match else code


def _arguments(raw: object) -> tuple[dict[str, Any], str | None]:
    # OpenAI sends a JSON string; some OpenAI-compatible servers send an object.
    if isinstance(raw, str):
        try:
            raw = json.loads(raw) if raw.strip() else {}
        except json.JSONDecodeError as exc:
            return {}, f'the tool arguments are not valid JSON ({exc}); send {{"code": "..."}}'
    if not isinstance(raw, Mapping):
        return {}, 'the tool arguments must be a JSON object like {"code": "..."}'
    return dict(raw), None


@dataclass(frozen=True, slots=True)
class ToolResult:
    """The answer to one tool call: what ran, and the content for the model."""

    call: ToolCall
    content: ModelContent
    execution: Execution | None = None
    """None when nothing ran (a malformed or refused call)."""
    code: str | None = None
    """The code that ran; differs from ``call.code`` when an approval hook edited it."""

    def to_anthropic(self) -> dict[str, Any]:
        """A ``tool_result`` block, for a ``{"role": "user", "content": [...]}`` turn."""
        return anthropic_tool_result(self.call.id, self.content)

    def to_openai(self) -> list[dict[str, Any]]:
        """The chat-completions messages for this call (see :func:`openai_messages`)."""
        return openai_tool_messages([(self.call.id, self.content)])

    def to_provider(self) -> list[dict[str, Any]]:
        """Messages in the shape of the provider the call came from.

        Anthropic: one ``user`` message holding the ``tool_result`` block; OpenAI:
        the ``tool`` message (and a ``user`` message with images, if any).
        """
        if self.call.provider == "anthropic":
            return [{"role": "user", "content": [self.to_anthropic()]}]
        return self.to_openai()


def openai_messages(results: Sequence[ToolResult]) -> list[dict[str, Any]]:
    """Messages answering all tool calls of one OpenAI assistant turn, images last."""
    return openai_tool_messages([(result.call.id, result.content) for result in results])


def anthropic_message(results: Sequence[ToolResult]) -> dict[str, Any]:
    """The ``user`` message answering all tool calls of one Anthropic assistant turn."""
    return {"role": "user", "content": [result.to_anthropic() for result in results]}


def refused(call: ToolCall, reason: str) -> ToolResult:
    """The result for a call the application refused to run."""
    return ToolResult(
        call, text_content(f"The application refused to run this code: {reason}", is_error=True)
    )


def workspace_listing(sandbox: Sandbox) -> list[EntryInfo]:
    """The workspace's files, for :func:`file_changes` (one cheap request).

    A failure to list (the sandbox was just restarted, say) yields an empty list:
    the file report is a courtesy and must not turn a good run into an error.
    """
    try:
        return sandbox.files.list(".", depth=WORKSPACE_DEPTH)
    except SandlotError:
        return []


def run_tool_call(
    sandbox: Sandbox,
    call: object,
    *,
    code: str | None = None,
    timeout: float | None = None,
    options: ContentOptions | None = None,
    track_files: bool = True,
) -> ToolResult:
    """Run an ``execute_python`` call in ``sandbox`` and return the model's answer.

    ``call`` is an SDK tool call, its dict form, or a :class:`ToolCall`. ``code``
    overrides the call's code (an approval hook's edit). A malformed call runs
    nothing and answers the model with what was wrong. Failures of the code are in
    the content (``is_error``), never raised; only sandlot's own errors (a sandbox
    that was killed, say) raise, as :class:`sandlot.SandlotError`.

    With ``track_files`` the workspace is listed before and after the cell (two
    small requests), and the content names the files the cell created or changed.
    """
    parsed = call if isinstance(call, ToolCall) else parse_tool_call(call)
    if parsed.problem is not None and code is None:
        return ToolResult(parsed, text_content(parsed.problem, is_error=True))
    source = parsed.code if code is None else code
    execution, content = execute_for_model(
        sandbox, source, timeout=timeout, options=options, track_files=track_files
    )
    return ToolResult(parsed, content, execution, source)


async def arun_tool_call(
    sandbox: AsyncSandbox,
    call: object,
    *,
    code: str | None = None,
    timeout: float | None = None,
    options: ContentOptions | None = None,
    track_files: bool = True,
) -> ToolResult:
    """:func:`run_tool_call` for an :class:`sandlot.AsyncSandbox`."""
    parsed = call if isinstance(call, ToolCall) else parse_tool_call(call)
    if parsed.problem is not None and code is None:
        return ToolResult(parsed, text_content(parsed.problem, is_error=True))
    source = parsed.code if code is None else code

    async def listing() -> list[EntryInfo]:
        try:
            return await sandbox.files.list(".", depth=WORKSPACE_DEPTH)
        except SandlotError:  # as in workspace_listing: the report is a courtesy
            return []

    before = await listing() if track_files else []
    execution = await sandbox.run_code(source, timeout=timeout)
    changes = file_changes(before, await listing()) if track_files else ()
    content = model_content(execution, files=changes, options=options)
    return ToolResult(parsed, content, execution, source)


def tool_function(
    sandbox: Sandbox,
    *,
    timeout: float | None = None,
    options: ContentOptions | None = None,
) -> Callable[[str], str]:
    """``execute_python(code) -> str`` bound to ``sandbox``, for agent frameworks.

    A plain, fully annotated function with the tool's name and a docstring that
    describes it and its ``code`` argument, which is what LangChain's ``@tool`` /
    ``StructuredTool.from_function``, LlamaIndex's ``FunctionTool.from_defaults`` and
    the OpenAI Agents SDK's ``function_tool`` read to build a schema. It returns the
    model-ready text (charts are listed in it; frameworks pass only text).
    """

    def execute_python(code: str) -> str:
        _, content = execute_for_model(sandbox, code, timeout=timeout, options=options)
        return content.text

    execute_python.__doc__ = f"{TOOL_DESCRIPTION}.\n\nArgs:\n    code: {CODE_DESCRIPTION}\n"
    return execute_python


def execute_for_model(
    sandbox: Sandbox,
    code: str,
    *,
    timeout: float | None = None,
    options: ContentOptions | None = None,
    track_files: bool = True,
) -> tuple[Execution, ModelContent]:
    """Run ``code`` and condense the outcome for a model (the core of the dispatcher,
    for callers that are not answering a provider's tool call, like the MCP server)."""
    before = workspace_listing(sandbox) if track_files else []
    execution = sandbox.run_code(code, timeout=timeout)
    changes: tuple[FileChange, ...] = ()
    if track_files:
        changes = file_changes(before, workspace_listing(sandbox))
    return execution, model_content(execution, files=changes, options=options)
