"""sandlot demo: analyse a year of sales data inside a sandbox.

This is what an LLM agent's tool loop does with sandlot, minus the LLM: upload
files, run a few cells of untrusted pandas/matplotlib code, and collect what comes
back. It shows:

* files going in (``files.write``) and out (``files.read``);
* state kept between cells: ``df`` is loaded once and used by every later cell;
* streaming stdout while a cell runs (``on_stdout``);
* rich results: a DataFrame comes back as an HTML table plus structured data, and
  a matplotlib figure (with a CJK subtitle) comes back as a PNG, without ``savefig``;
* errors as data: a failing cell returns ``execution.error`` instead of raising.

Usage::

    python examples/sales_demo.py [--out DIR] [--data examples/data/sales.csv]

The data is the bundled sample (see ``examples/data/make_sales.py``); the Excel
copy next to the CSV is uploaded too and checked against it.
"""

from __future__ import annotations

import argparse
import base64
import sys
from pathlib import Path
from typing import TYPE_CHECKING

from sandlot import Sandbox

if TYPE_CHECKING:
    from sandlot import Execution

HERE = Path(__file__).resolve().parent

LOAD = """
import pandas as pd

df = pd.read_csv("sales.csv", parse_dates=["date"])
excel = pd.read_excel("sales.xlsx", sheet_name="sales")  # the same rows, via openpyxl
pd.testing.assert_frame_equal(df, excel, check_dtype=False)
df["month"] = df["date"].dt.strftime("%Y-%m")
print(f"Loaded {df.shape[0]:,} rows x {df.shape[1]} columns; the CSV and Excel copies agree.")
"""

TABLES = """
monthly = df.groupby("month")["revenue"].sum()
print("Monthly revenue:")
print(monthly.map("{:,.0f}".format).to_string())

by_region = df.pivot_table(index="region", columns="category", values="revenue", aggfunc="sum")
by_region["Total"] = by_region.sum(axis=1)
by_region.sort_values("Total", ascending=False).round(2)
"""

CHART = """
import matplotlib.pyplot as plt

per_region = df.pivot_table(index="month", columns="region", values="revenue", aggfunc="sum")
fig, ax = plt.subplots(figsize=(10, 5))
per_region.plot(ax=ax, marker="o")
ax.set_title("Monthly revenue by region, 2024 (月度收入)")
ax.set_xlabel("Month")
ax.set_ylabel("Revenue ($)")
ax.grid(alpha=0.3)
fig.tight_layout()
"""

SUMMARY = """
from datetime import datetime

total = df["revenue"].sum()
by_region = df.groupby("region")["revenue"].sum()
by_category = df.groupby("category")["revenue"].sum()
by_month = df.groupby("month")["revenue"].sum()
h1 = df.loc[df["date"].dt.month <= 6, "revenue"].sum()
h2 = df.loc[df["date"].dt.month > 6, "revenue"].sum()
best_month = datetime.strptime(by_month.idxmax(), "%Y-%m").strftime("%B %Y")

summary = "\\n".join([
    f"Orders:        {len(df):,}",
    f"Total revenue: ${total:,.2f}",
    f"Top region:    {by_region.idxmax()} (${by_region.max():,.2f})",
    f"Top category:  {by_category.idxmax()} (${by_category.max():,.2f})",
    f"Best month:    {best_month} (${by_month.max():,.2f})",
    f"H2 vs H1:      {(h2 - h1) / h1:+.1%} (${h1:,.2f} -> ${h2:,.2f})",
]) + "\\n"
with open("summary.txt", "w", encoding="utf-8") as f:
    f.write(summary)
print(summary, end="")
"""


def run_cell(sbx: Sandbox, title: str, code: str) -> Execution:
    """Run one cell, streaming its stdout; on any error, report it and exit 1."""
    print(f"\n--- {title} ---")
    execution = sbx.run_code(code, timeout=60, on_stdout=lambda m: print(m.line, end=""))
    if execution.error is not None:
        err = execution.error
        print(f"\nCell {title!r} failed: {err.name}: {err.value}", file=sys.stderr)
        print(err.traceback, file=sys.stderr)
        sys.exit(1)
    return execution


def main() -> None:
    parser = argparse.ArgumentParser(description="Analyse the sample sales data in a sandbox.")
    parser.add_argument("--out", type=Path, default=Path("out/demo"), help="output directory")
    parser.add_argument("--data", type=Path, default=HERE / "data" / "sales.csv", help="CSV")
    args = parser.parse_args()
    xlsx = args.data.with_suffix(".xlsx")
    if not xlsx.exists():
        parser.error(f"expected the Excel copy of {args.data} at {xlsx}")

    with Sandbox() as sbx:
        sbx.files.write("sales.csv", args.data.read_bytes())
        sbx.files.write("sales.xlsx", xlsx.read_bytes())

        run_cell(sbx, "1. load", LOAD)

        tables = run_cell(sbx, "2. tables", TABLES)
        table = next((r for r in tables.results if r.is_main_result), None)
        if table is None:
            sys.exit("The tables cell returned no main result.")
        print(f"\nRevenue by region and category (result formats: {table.formats()}):")
        print(table.text)

        chart = run_cell(sbx, "3. chart", CHART)
        png = next((r.png for r in chart.results if r.png), None)
        if png is None:
            sys.exit("The chart cell returned no PNG result.")

        run_cell(sbx, "4. summary", SUMMARY)
        summary = sbx.files.read("summary.txt")

    args.out.mkdir(parents=True, exist_ok=True)
    chart_path = args.out / "revenue_by_month.png"
    chart_path.write_bytes(base64.b64decode(png))
    summary_path = args.out / "summary.txt"
    summary_path.write_text(summary, encoding="utf-8")

    print("\nWrote:")
    print(f"  {chart_path}  (chart, {chart_path.stat().st_size:,} bytes)")
    print(f"  {summary_path}  (summary read back from the sandbox)")


if __name__ == "__main__":
    main()
