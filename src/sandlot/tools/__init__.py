"""Give a model the sandbox as a tool: definitions, a dispatcher, model-ready results.

::

    from openai import OpenAI
    from sandlot import Sandbox
    from sandlot.tools import openai_messages, openai_tool, run_tool_call

    client, messages = OpenAI(), [{"role": "user", "content": "Plot y = x^2"}]
    with Sandbox() as sbx:
        while True:
            reply = client.chat.completions.create(
                model="gpt-4o", messages=messages, tools=[openai_tool()]
            ).choices[0].message
            messages.append(reply.model_dump(exclude_none=True))
            if not reply.tool_calls:
                break
            results = [run_tool_call(sbx, call) for call in reply.tool_calls]
            messages += openai_messages(results)      # tool messages, then the charts

Anthropic is the same with :func:`anthropic_tool` and :func:`anthropic_message`;
:func:`arun_tool_call` is the same for an :class:`sandlot.AsyncSandbox`;
agent frameworks (LangChain, LlamaIndex, the OpenAI Agents SDK) take
:func:`tool_function`, a plain ``execute_python(code) -> str`` bound to a sandbox.
:func:`model_content` alone turns any :class:`sandlot.Execution` into what a model
should read (text within a budget, charts as images, DataFrames as compact tables,
files created). Nothing here imports an SDK; the dicts match the SDKs' types.
"""

from sandlot.tools._calls import (
    CODE_DESCRIPTION,
    TOOL_DESCRIPTION,
    TOOL_NAME,
    ToolCall,
    ToolResult,
    anthropic_message,
    anthropic_tool,
    arun_tool_call,
    execute_for_model,
    openai_messages,
    openai_tool,
    parse_tool_call,
    refused,
    run_tool_call,
    tool_function,
    workspace_listing,
)
from sandlot.tools._content import (
    ContentOptions,
    FileChange,
    Image,
    ModelContent,
    anthropic_tool_result,
    clip_text,
    file_changes,
    model_content,
    openai_tool_messages,
    table_text,
    text_content,
)

__all__ = [
    "CODE_DESCRIPTION",
    "TOOL_DESCRIPTION",
    "TOOL_NAME",
    "ContentOptions",
    "FileChange",
    "Image",
    "ModelContent",
    "ToolCall",
    "ToolResult",
    "anthropic_message",
    "anthropic_tool",
    "anthropic_tool_result",
    "arun_tool_call",
    "clip_text",
    "execute_for_model",
    "file_changes",
    "model_content",
    "openai_messages",
    "openai_tool",
    "openai_tool_messages",
    "parse_tool_call",
    "refused",
    "run_tool_call",
    "table_text",
    "text_content",
    "tool_function",
    "workspace_listing",
]
