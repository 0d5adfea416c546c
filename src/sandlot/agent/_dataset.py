"""Put a CSV or Excel file into the sandbox as a DataFrame, with a row cap.

The file is uploaded as it is and parsed *inside* the sandbox: pandas and openpyxl
reading a file somebody sent you is untrusted work too, and the template has them.
The host only checks the name and size. A file with more rows than the cap is
sampled uniformly (a reservoir over CSV chunks, so memory stays bounded; Excel is
read whole) and the model is told so, with the full row count, so it does not
present sample figures as totals.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from sandlot._exceptions import InvalidArgumentError, SandlotError
from sandlot.tools import ContentOptions, table_text

if TYPE_CHECKING:
    from sandlot._sandbox import Sandbox

DEFAULT_MAX_ROWS = 50_000
"""Rows a DataFrame keeps before the agent samples (a model does not need more to
find patterns, and cells stay fast)."""
SUFFIXES = {".csv": "csv", ".tsv": "tsv", ".txt": "csv", ".xlsx": "excel", ".xlsm": "excel"}
DATA_DIR = "data"
"""Where uploads go, relative to the workspace."""
LOAD_TIMEOUT = 300.0

_IDENTIFIER = re.compile(r"[A-Za-z_][A-Za-z0-9_]*\Z")

# Runs in the sandbox. Sampling keeps a uniform random subset without holding the whole
# file: every row gets a random key, and each chunk keeps the `cap` smallest keys so far.
_LOAD_CELL = """
def _sandlot_load(path, kind, cap, sheet):
    import json
    import numpy as np
    import pandas as pd

    rng = np.random.default_rng(0)
    if kind == "excel":
        frame = pd.read_excel(path, sheet_name=sheet if sheet is not None else 0)
        total = len(frame)
        if total > cap:
            frame = frame.sample(n=cap, random_state=0).sort_index()
    else:
        kept, total = None, 0
        sep = "\\t" if kind == "tsv" else ","
        for chunk in pd.read_csv(path, sep=sep, chunksize=max(cap, 10000)):
            total += len(chunk)
            chunk = chunk.assign(_sandlot_key=rng.random(len(chunk)))
            kept = chunk if kept is None else pd.concat([kept, chunk])
            if len(kept) > cap:
                kept = kept.nsmallest(cap, "_sandlot_key")
        frame = (
            pd.DataFrame() if kept is None else kept.drop(columns="_sandlot_key").sort_index()
        )
    info = {
        "rows": int(total),
        "kept": int(len(frame)),
        "columns": [str(c) for c in frame.columns],
        "dtypes": [str(t) for t in frame.dtypes],
    }
    print(json.dumps(info))
    return frame
"""


@dataclass(frozen=True, slots=True)
class Dataset:
    """A file loaded into the sandbox, and what the model is told about it."""

    name: str
    """The DataFrame's variable name in the sandbox (``df`` for the first)."""
    path: str
    """Where the raw file is, relative to the workspace."""
    rows: int
    """Rows in the file."""
    kept: int
    """Rows in the DataFrame (``< rows`` when sampled)."""
    columns: tuple[tuple[str, str], ...]
    """``(column, dtype)`` pairs."""
    preview: str
    """The first rows as a compact table."""

    @property
    def sampled(self) -> bool:
        return self.kept < self.rows

    def describe(self) -> str:
        """The dataset as the system prompt states it."""
        columns = ", ".join(f"{name} ({dtype})" for name, dtype in self.columns)
        lines = [
            f"- `{self.name}`: a pandas DataFrame loaded from `{self.path}` "
            f"({self.kept:,} rows x {len(self.columns)} columns).",
            f"  Columns: {columns}",
        ]
        if self.sampled:
            lines.append(
                f"  NOTE: the file has {self.rows:,} rows; `{self.name}` is a uniform random "
                f"sample of {self.kept:,} of them. Say so when you report figures, and scale "
                "totals or counts if you estimate them for the whole file."
            )
        lines.append("  First rows:")
        lines.extend("    " + line for line in self.preview.splitlines())
        return "\n".join(lines)


def load_dataset(
    sandbox: Sandbox,
    source: str | Path,
    *,
    name: str = "df",
    max_rows: int = DEFAULT_MAX_ROWS,
    sheet: str | int | None = None,
) -> Dataset:
    """Upload ``source`` into ``sandbox`` and load it there as DataFrame ``name``.

    Raises :class:`sandlot.InvalidArgumentError` for an unknown file type or bad
    arguments, and :class:`sandlot.ExecutionFailed` if pandas cannot read it.
    """
    path = Path(source)
    kind = SUFFIXES.get(path.suffix.lower())
    if kind is None:
        raise InvalidArgumentError(
            f"{path.name}: not a CSV or Excel file (expected one of {', '.join(SUFFIXES)})"
        )
    if not _IDENTIFIER.match(name):
        raise InvalidArgumentError(f"{name!r} is not a Python identifier")
    if max_rows < 1:
        raise InvalidArgumentError("max_rows must be >= 1")
    if not path.is_file():
        raise InvalidArgumentError(f"{path} is not a file")
    remote = f"{DATA_DIR}/{path.name}"
    with path.open("rb") as handle:
        sandbox.files.write(remote, handle)
    code = (
        f"{_LOAD_CELL}\n{name} = _sandlot_load({remote!r}, {kind!r}, {max_rows!r}, {sheet!r})\n"
        f"del _sandlot_load\n{name}.head(5)\n"
    )
    execution = sandbox.run_code(code, timeout=LOAD_TIMEOUT)
    execution.raise_for_error()
    info = _info(execution.logs.stdout)
    preview = ""
    for result in execution.results:
        if result.is_main_result:
            table = table_text(result.data, ContentOptions(table_rows=5)) if result.data else None
            preview = table or result.text or ""
    return Dataset(
        name=name,
        path=remote,
        rows=int(info["rows"]),
        kept=int(info["kept"]),
        columns=tuple(zip(info["columns"], info["dtypes"], strict=True)),
        preview=preview,
    )


def _info(stdout: list[str]) -> dict[str, Any]:
    # The loading cell prints one JSON line; anything else on stdout (pandas warnings
    # about mixed types, say) is ignored.
    for line in "".join(stdout).splitlines():
        if line.startswith("{"):
            try:
                info = json.loads(line)
            except json.JSONDecodeError:
                continue
            if isinstance(info, dict) and {"rows", "kept", "columns", "dtypes"} <= set(info):
                return info
    raise SandlotError("the dataset loader printed no summary (was the template changed?)")
