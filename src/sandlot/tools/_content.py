"""An :class:`~sandlot.Execution` as content a model can read: text, images, a file list.

A model pays for every token it reads and loses the thread in walls of output, so
:func:`model_content` condenses an execution to

* one text, in a fixed order: the tail of stdout and stderr, the main result and
  displayed values (a DataFrame as a compact table, not its 20-column repr), a line
  per image, the files the cell created or changed, and the error with the tail of
  its traceback; cut to ``ContentOptions.max_chars`` with a marker saying what was cut;
* the images (PNG/JPEG charts) as base64, up to ``ContentOptions.max_images``.

The provider shapes are plain dicts that match the official SDKs' request types:
Anthropic's ``ToolResultBlockParam`` (text and image blocks inside the tool result)
and OpenAI's chat-completions messages. OpenAI's ``tool`` messages carry text only,
so images follow the tool messages in one ``user`` message of ``image_url`` parts.

Everything here is pure: no sandbox, no SDK import.
"""

from __future__ import annotations

import base64
import binascii
import math
import re
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

from sandlot import EntryInfo, Execution, FileType, InvalidArgumentError, Result
from sandlot.protocol.layout import HOME

MIN_BUDGET = 200
"""The smallest text budget that still leaves room for the section headers and a marker."""

_ANSI = re.compile(r"\x1b\[[0-9;?]*[A-Za-z]")
_PLOT_NOISE = re.compile(
    r"\A(?:Text\(.*\)|\[?<matplotlib\.[\w.]+ (?:at|object at) 0x[0-9a-f]+>.*|<Axes: .*>"
    r"|\[<matplotlib\..*>\]|<matplotlib\..*>)\Z",
    re.DOTALL,
)


@dataclass(frozen=True, slots=True, kw_only=True)
class ContentOptions:
    """How much of an execution a model gets to read."""

    max_chars: int = 8_000
    """Budget for the whole text (roughly 2,000 tokens). Sections share it; a cut
    section keeps its most useful end (the tail of output and tracebacks, the head
    of results) and says how much was cut."""
    max_images: int = 4
    """Images attached (0: none, e.g. for a model without vision). Others are listed."""
    max_image_bytes: int = 3_750_000
    """Largest image attached (decoded). Anthropic refuses base64 images over 5 MB."""
    table_rows: int = 15
    """Rows of a DataFrame shown in its compact table."""
    table_columns: int = 12
    """Columns of a DataFrame shown in its compact table."""
    cell_chars: int = 30
    """Longest table cell; longer values are cut with an ellipsis."""
    max_files: int = 30
    """Created or changed files listed by name."""

    def __post_init__(self) -> None:
        if self.max_chars < MIN_BUDGET:
            raise InvalidArgumentError(f"max_chars must be at least {MIN_BUDGET}")
        for name in ("max_images", "max_image_bytes", "max_files"):
            if getattr(self, name) < 0:
                raise InvalidArgumentError(f"{name} must be >= 0")
        for name in ("table_rows", "table_columns", "cell_chars"):
            if getattr(self, name) < 1:
                raise InvalidArgumentError(f"{name} must be >= 1")


@dataclass(frozen=True, slots=True)
class Image:
    """An image for the model: base64 data and its media type."""

    media_type: Literal["image/png", "image/jpeg"]
    data: str
    """Base64, as in :attr:`sandlot.Result.png`."""

    @property
    def data_url(self) -> str:
        return f"data:{self.media_type};base64,{self.data}"


@dataclass(frozen=True, slots=True)
class FileChange:
    """A file a cell created or changed in the workspace."""

    path: str
    """Relative to the workspace (``/home/user``) when inside it."""
    size: int
    created: bool
    """True if the file is new; False if it existed and changed (size or mtime)."""


@dataclass(frozen=True, slots=True)
class ModelContent:
    """What the model reads back from one tool call, independent of the provider."""

    text: str
    images: tuple[Image, ...] = ()
    is_error: bool = False
    """True when the cell failed (exception, limit) or the call was refused."""
    truncated: bool = False
    """True when the text was cut to the budget, or output was cut in the sandbox."""
    files: tuple[FileChange, ...] = field(default=())

    def anthropic_blocks(self) -> list[dict[str, Any]]:
        """Anthropic content blocks: one text block, then one image block per image."""
        blocks: list[dict[str, Any]] = [{"type": "text", "text": self.text}]
        for image in self.images:
            blocks.append(
                {
                    "type": "image",
                    "source": {
                        "type": "base64",
                        "media_type": image.media_type,
                        "data": image.data,
                    },
                }
            )
        return blocks

    def openai_parts(self) -> list[dict[str, Any]]:
        """OpenAI chat content parts: a text part, then an ``image_url`` part per image."""
        parts: list[dict[str, Any]] = [{"type": "text", "text": self.text}]
        for image in self.images:
            parts.append({"type": "image_url", "image_url": {"url": image.data_url}})
        return parts


def text_content(text: str, *, is_error: bool = False) -> ModelContent:
    """Content that is only a message (a refusal, a malformed call)."""
    return ModelContent(text=text, is_error=is_error)


def anthropic_tool_result(tool_use_id: str, content: ModelContent) -> dict[str, Any]:
    """A ``tool_result`` block (``anthropic.types.ToolResultBlockParam``) for a user turn."""
    return {
        "type": "tool_result",
        "tool_use_id": tool_use_id,
        "content": content.anthropic_blocks(),
        "is_error": content.is_error,
    }


def openai_tool_messages(results: Iterable[tuple[str, ModelContent]]) -> list[dict[str, Any]]:
    """Chat-completions messages answering the tool calls of one assistant turn.

    One ``tool`` message per ``(tool_call_id, content)``, in order, then, if any call
    produced images, one ``user`` message with them: OpenAI accepts only text in
    ``tool`` messages, and every tool message must directly follow the assistant
    turn, so the images cannot sit between them.
    """
    messages: list[dict[str, Any]] = []
    image_parts: list[dict[str, Any]] = []
    for tool_call_id, content in results:
        messages.append({"role": "tool", "tool_call_id": tool_call_id, "content": content.text})
        if content.images:
            count = len(content.images)
            image_parts.append(
                {
                    "type": "text",
                    "text": f"Image{'s' if count > 1 else ''} from tool call {tool_call_id}:",
                }
            )
            image_parts.extend(content.openai_parts()[1:])
    if image_parts:
        messages.append({"role": "user", "content": image_parts})
    return messages


# --- files ------------------------------------------------------------------------------


WORKSPACE = HOME
"""Paths are shown relative to the sandbox's working directory."""


def file_changes(before: Sequence[EntryInfo], after: Sequence[EntryInfo]) -> tuple[FileChange, ...]:
    """Files in ``after`` that are not in ``before``, or whose size or mtime changed.

    Paths are made relative to the workspace (``/home/user``). Hidden files and
    anything under a hidden directory (``.cache``, ``.config``: matplotlib and pip
    write there) are left out: they are noise to a model.
    """
    old = {entry.path: entry for entry in before if entry.type is FileType.FILE}
    changes: list[FileChange] = []
    for entry in after:
        path = _relative(entry.path)
        if entry.type is not FileType.FILE or any(p.startswith(".") for p in path.split("/")):
            continue
        previous = old.get(entry.path)
        if previous is None:
            changes.append(FileChange(path, entry.size, created=True))
        elif (previous.size, previous.modified_time) != (entry.size, entry.modified_time):
            changes.append(FileChange(path, entry.size, created=False))
    return tuple(sorted(changes, key=lambda change: change.path))


def _relative(path: str) -> str:
    if path.startswith(WORKSPACE + "/"):
        return path[len(WORKSPACE) + 1 :]
    return path


# --- execution -> content ---------------------------------------------------------------


def model_content(
    execution: Execution,
    *,
    files: Sequence[FileChange] = (),
    options: ContentOptions | None = None,
) -> ModelContent:
    """Condense ``execution`` (plus the files its cell touched) for a model."""
    options = options or ContentOptions()
    images, image_notes = _images(execution.results, options)
    results_text = _results_text(execution.results, image_notes, options)
    error = execution.error
    error_text = ""
    if error is not None:
        traceback = _ANSI.sub("", error.traceback).rstrip()
        headline = f"{error.name}: {error.value}"
        error_text = headline if not traceback else f"{traceback}\n{headline}"
        if traceback.endswith(headline):
            error_text = traceback
    sections = [
        # (title, body, which end to keep when cut, priority when sharing slack)
        _Section("stdout", _ANSI.sub("", "".join(execution.logs.stdout)), "tail", 3),
        _Section("stderr", _ANSI.sub("", "".join(execution.logs.stderr)), "tail", 4),
        _Section("result", results_text, "head", 1),
        _Section("files", _files_text(files, options), "head", 2),
        _Section("error", error_text, "tail", 0),
    ]
    text, cut = _fit([s for s in sections if s.body.strip()], options.max_chars)
    if not text:
        text = "(the cell ran and produced no output)"
    if execution.truncated:
        text = clip_text(
            "[output was cut in the sandbox: over the output limit]\n" + text,
            options.max_chars,
            "head",
        )
    return ModelContent(
        text=text,
        images=tuple(images),
        is_error=error is not None,
        truncated=cut or execution.truncated,
        files=tuple(files),
    )


@dataclass(slots=True)
class _Section:
    title: str
    body: str
    keep: Literal["head", "tail"]
    priority: int


def _fit(sections: list[_Section], budget: int) -> tuple[str, bool]:
    """Join sections under ``[title]`` headers within ``budget`` characters.

    Every section first gets an equal share (or less, if it is shorter); what short
    sections leave goes to the long ones in priority order (error, result, files,
    stdout, stderr). So a long stdout cannot push the traceback out, and a short
    error leaves its share to the output.
    """
    if not sections:
        return "", False
    headers = [f"[{section.title}]\n" for section in sections]
    separators = len(sections) - 1  # one "\n" between sections
    room = max(0, budget - sum(len(h) for h in headers) - separators)
    share = room // len(sections)
    grants = {id(s): min(len(s.body.rstrip()), share) for s in sections}
    spare = room - sum(grants.values())
    for section in sorted(sections, key=lambda s: s.priority):
        want = len(section.body.rstrip()) - grants[id(section)]
        extra = min(max(want, 0), spare)
        grants[id(section)] += extra
        spare -= extra
    parts: list[str] = []
    cut = False
    for header, section in zip(headers, sections, strict=True):
        body = section.body.rstrip()
        clipped = clip_text(body, grants[id(section)], section.keep)
        cut = cut or clipped != body
        parts.append(header + clipped)
    return "\n".join(parts), cut


def clip_text(text: str, limit: int, keep: Literal["head", "tail"] = "head") -> str:
    """``text`` in at most ``limit`` characters, with a marker saying how much was cut."""
    if len(text) <= limit:
        return text
    # The marker's own length depends on the number it reports; reserve for the widest.
    marker_room = len(f"[... {len(text):,} characters cut]") + 1
    kept = max(0, limit - marker_room)
    removed = len(text) - kept
    if keep == "head":
        return f"{text[:kept]}\n[... {removed:,} characters cut]"[:limit]
    return f"[... {removed:,} characters cut]\n{text[len(text) - kept :]}"[-limit:]


def _images(
    results: Sequence[Result], options: ContentOptions
) -> tuple[list[Image], dict[int, str]]:
    """The images to attach, and a one-line note for every image result."""
    images: list[Image] = []
    notes: dict[int, str] = {}
    for index, result in enumerate(results):
        media: Literal["image/png", "image/jpeg"]
        if result.png is not None:
            media, data = "image/png", result.png
        elif result.jpeg is not None:
            media, data = "image/jpeg", result.jpeg
        else:
            if result.svg is not None:
                notes[index] = "an SVG image (not attached: models read PNG or JPEG)"
            continue
        label = _chart_label(result.chart)
        size = _decoded_size(data)
        if size is None:
            notes[index] = f"{label} (not attached: the image data is not valid base64)"
        elif options.max_images == 0:
            notes[index] = f"{label} (not attached: images are off)"
        elif len(images) >= options.max_images:
            notes[index] = f"{label} (not attached: over the limit of {options.max_images})"
        elif size > options.max_image_bytes:
            notes[index] = f"{label} (not attached: {size:,} bytes is too large)"
        else:
            images.append(Image(media, data))
            notes[index] = f"{label}, attached as image {len(images)}"
    return images, notes


def _chart_label(chart: Mapping[str, Any] | None) -> str:
    if not chart:
        return "an image"
    kind = str(chart.get("type") or "chart").replace("_", " ")
    title = chart.get("title")
    return f"a {kind} chart titled {title!r}" if title else f"a {kind} chart"


def _decoded_size(data: str) -> int | None:
    try:
        return len(base64.b64decode(data, validate=True))
    except (binascii.Error, ValueError):
        return None


def _results_text(
    results: Sequence[Result], image_notes: Mapping[int, str], options: ContentOptions
) -> str:
    lines: list[str] = []
    has_image = bool(image_notes)
    for index, result in enumerate(results):
        if index in image_notes:
            lines.append(f"({image_notes[index]})")
            continue
        if has_image and result.data is None and _PLOT_NOISE.match(result.text or ""):
            # A cell that ends in ax.set_title(...) returns a Text artist; next to the
            # chart itself its repr tells the model nothing.
            continue
        body = table_text(result.data, options) if result.data else None
        if body is None:
            body = result.text if result.text is not None else _describe_formats(result)
        if not body:
            continue
        lines.append(body if result.is_main_result or len(results) == 1 else f"display: {body}")
    return "\n".join(lines)


def _describe_formats(result: Result) -> str:
    formats = result.formats()
    return f"(a result in {', '.join(formats)})" if formats else ""


def _files_text(files: Sequence[FileChange], options: ContentOptions) -> str:
    if not files:
        return ""
    shown = [
        f"{'created' if change.created else 'changed'}: {change.path} ({_size(change.size)})"
        for change in files[: options.max_files]
    ]
    if len(files) > options.max_files:
        shown.append(f"... and {len(files) - options.max_files} more")
    return "\n".join(shown)


def _size(size: int) -> str:
    if size < 1024:
        return f"{size:,} bytes"
    if size < 1024 * 1024:
        return f"{size / 1024:,.1f} KB"
    return f"{size / (1024 * 1024):,.1f} MB"


# --- DataFrames -------------------------------------------------------------------------


def table_text(data: Mapping[str, Any], options: ContentOptions) -> str | None:
    """A DataFrame's structured ``data`` as a compact pipe table, or None if it is not one."""
    if data.get("type") != "dataframe":
        return None
    columns = data.get("columns")
    rows = data.get("data")
    index = data.get("index")
    if not isinstance(columns, list) or not isinstance(rows, list):
        return None
    shape = data.get("shape") or [len(rows), len(columns)]
    total_rows, total_cols = int(shape[0]), int(shape[1])
    show_index = isinstance(index, list) and index != list(range(len(index)))
    ncols = min(len(columns), options.table_columns)
    header = [_cell(c, options) for c in columns[:ncols]]
    if show_index:
        header.insert(0, "")
    if len(columns) > ncols:
        header.append("…")
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    for position, row in enumerate(rows[: options.table_rows]):
        if not isinstance(row, list):
            return None
        cells = [_cell(value, options) for value in row[:ncols]]
        if show_index and isinstance(index, list):
            cells.insert(0, _cell(index[position], options))
        if len(columns) > ncols:
            cells.append("…")
        lines.append("| " + " | ".join(cells) + " |")
    shown_rows = min(len(rows), options.table_rows)
    if shown_rows < total_rows or ncols < total_cols:
        lines.append(
            f"(DataFrame {total_rows:,} rows x {total_cols:,} columns; "
            f"showing {shown_rows:,} rows and {ncols:,} columns)"
        )
    return "\n".join(lines)


def _cell(value: Any, options: ContentOptions) -> str:
    if isinstance(value, list):  # a MultiIndex level tuple
        text = " / ".join(_cell(v, options) for v in value)
    elif isinstance(value, bool) or value is None:
        text = str(value)
    elif isinstance(value, float):
        text = _number(value)
    else:
        text = str(value)
    text = text.replace("|", "\\|").replace("\n", " ")
    if len(text) > options.cell_chars:
        text = text[: options.cell_chars - 1] + "…"
    return text


def _number(value: float) -> str:
    if math.isnan(value) or math.isinf(value):
        return str(value)
    if value != 0 and (abs(value) >= 1e15 or abs(value) < 1e-4):
        return f"{value:.4g}"
    return f"{value:.4f}".rstrip("0").rstrip(".")
