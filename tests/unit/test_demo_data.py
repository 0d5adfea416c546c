"""The bundled sample dataset (examples/data): shape, CSV/XLSX agreement, reproducibility."""

from __future__ import annotations

import csv
import datetime as dt
import importlib.util
import sys
from pathlib import Path
from types import ModuleType

import pytest

DATA = Path(__file__).resolve().parents[2] / "examples" / "data"
CSV = DATA / "sales.csv"
XLSX = DATA / "sales.xlsx"
COLUMNS = [
    "order_id",
    "date",
    "region",
    "product",
    "category",
    "units",
    "unit_price",
    "revenue",
    "customer_segment",
]


def _load_generator() -> ModuleType:
    spec = importlib.util.spec_from_file_location("make_sales", DATA / "make_sales.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up while it executes
    try:
        spec.loader.exec_module(module)
    finally:
        del sys.modules[spec.name]
    return module


def _csv_rows() -> list[dict[str, str]]:
    with CSV.open(newline="", encoding="utf-8") as f:
        return list(csv.DictReader(f))


def test_csv_columns_and_values() -> None:
    with CSV.open(newline="", encoding="utf-8") as f:
        assert next(csv.reader(f)) == COLUMNS
    rows = _csv_rows()
    assert 1000 <= len(rows) <= 1500
    assert len({r["order_id"] for r in rows}) == len(rows)
    assert {r["region"] for r in rows} == {"North", "South", "East", "West"}
    assert {r["customer_segment"] for r in rows} == {"Consumer", "Corporate", "Small Business"}
    for r in rows:
        date = dt.date.fromisoformat(r["date"])
        assert date.year == 2024 and r["date"] == date.isoformat()
        units = int(r["units"])
        assert units > 0
        assert r["unit_price"].count(".") == 1 and len(r["unit_price"].split(".")[1]) == 2
        assert r["revenue"] == f"{units * float(r['unit_price']):.2f}"
    assert {r["date"][:7] for r in rows} == {f"2024-{m:02d}" for m in range(1, 13)}


def test_xlsx_has_the_same_rows_as_csv() -> None:
    openpyxl = pytest.importorskip("openpyxl")
    assert XLSX.stat().st_size < 150_000
    wb = openpyxl.load_workbook(XLSX, read_only=True)
    try:
        assert wb.sheetnames == ["sales"]
        sheet_rows = list(wb["sales"].iter_rows(values_only=True))
    finally:
        wb.close()
    assert list(sheet_rows[0]) == COLUMNS

    def as_text(column: str, value: object) -> str:
        if isinstance(value, dt.datetime):
            return value.date().isoformat()
        if column in ("unit_price", "revenue"):
            assert isinstance(value, int | float)
            return f"{value:.2f}"
        return str(value)

    xlsx_rows = [
        {column: as_text(column, value) for column, value in zip(COLUMNS, row, strict=True)}
        for row in sheet_rows[1:]
    ]
    assert xlsx_rows == _csv_rows()


def test_pandas_reads_both_files_alike() -> None:
    """What the demo's first cell checks, with the host's pandas."""
    pd = pytest.importorskip("pandas")
    pytest.importorskip("openpyxl")
    df = pd.read_csv(CSV, parse_dates=["date"])
    excel = pd.read_excel(XLSX, sheet_name="sales")
    assert list(df.columns) == COLUMNS
    pd.testing.assert_frame_equal(df, excel, check_dtype=False)


def test_regenerating_is_byte_identical(tmp_path: Path) -> None:
    make_sales = _load_generator()
    rows = make_sales.generate_rows()
    make_sales.write_csv(rows, tmp_path / "sales.csv")
    assert (tmp_path / "sales.csv").read_bytes() == CSV.read_bytes()


def test_regenerating_the_xlsx_gives_the_same_sheet(tmp_path: Path) -> None:
    # Compared by cell values, not bytes: the bytes depend on openpyxl's and zlib's versions.
    openpyxl = pytest.importorskip("openpyxl")
    make_sales = _load_generator()
    make_sales.main(["--out", str(tmp_path)])
    assert (tmp_path / "sales.csv").read_bytes() == CSV.read_bytes()

    def values(path: Path) -> list[tuple[object, ...]]:
        wb = openpyxl.load_workbook(path, read_only=True)
        try:
            return list(wb["sales"].iter_rows(values_only=True))
        finally:
            wb.close()

    assert values(tmp_path / "sales.xlsx") == values(XLSX)
