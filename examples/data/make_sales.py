"""Generate the bundled sample dataset: one year (2024) of a small coffee retailer's sales.

Writes ``sales.csv`` and ``sales.xlsx`` (sheet ``sales``) with the same rows:

    order_id, date, region, product, category, units, unit_price, revenue, customer_segment

The data is made up but has structure worth analysing: a seasonal curve (quiet
January, busy November/December), steady growth through the year, regions of
different sizes with their own seasonal lean, seasonal products (cold brew in
summer, gift boxes before Christmas), bulk orders from business customers and a
Black Friday discount.

Generation is deterministic (a seeded ``random.Random``, stdlib only), so running
this again reproduces the committed files byte for byte. Only writing the
``.xlsx`` needs openpyxl::

    python examples/data/make_sales.py            # writes next to this script
    python examples/data/make_sales.py --out DIR
"""

from __future__ import annotations

import argparse
import csv
import datetime as dt
import io
import random
import re
import zipfile
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

SEED = 2024
N_ORDERS = 1200
YEAR = 2024

# Relative order volume by month: slow start, spring/summer plateau, holiday peak.
MONTH_WEIGHT = [0.70, 0.68, 0.85, 0.90, 0.98, 1.02, 0.98, 0.92, 1.02, 1.08, 1.30, 1.55]
# Weekends are busier for a retailer.
# How summery each month is: -1 in January, +1 in July (a table, not math.cos, so the
# weights are bit-identical on every platform).
SUMMER = [-1.0, -0.87, -0.5, 0.0, 0.5, 0.87, 1.0, 0.87, 0.5, 0.0, -0.5, -0.87]
WEEKDAY_WEIGHT = [0.9, 0.9, 0.95, 1.0, 1.15, 1.35, 1.1]
YEARLY_GROWTH = 0.20  # December runs ~20% above January before seasonality.

# Region -> (share of orders, seasonal lean). A positive lean means the region
# sells relatively more in summer, a negative one relatively more in winter.
REGIONS: dict[str, tuple[float, float]] = {
    "North": (0.34, -0.25),
    "East": (0.28, 0.0),
    "South": (0.22, 0.30),
    "West": (0.16, 0.10),
}

SEGMENTS: dict[str, float] = {"Consumer": 0.58, "Small Business": 0.27, "Corporate": 0.15}


@dataclass(frozen=True)
class Product:
    name: str
    category: str
    price_cents: int
    weight: float
    max_units: int
    """Most units a consumer buys at once; business customers buy more."""
    peak_months: tuple[int, ...] = ()


CATALOG = [
    Product("House Blend 1kg", "Coffee", 2400, 1.6, 4),
    Product("Single Origin 250g", "Coffee", 1250, 1.3, 6),
    Product("Decaf 500g", "Coffee", 1400, 0.6, 3),
    Product("Cold Brew Pack", "Coffee", 1800, 0.5, 6, peak_months=(6, 7, 8)),
    Product("Pour-Over Kit", "Equipment", 3900, 0.5, 2),
    Product("Burr Grinder", "Equipment", 12900, 0.35, 1),
    Product("Espresso Machine", "Equipment", 44900, 0.15, 1),
    Product("Travel Mug", "Accessories", 1950, 0.7, 3),
    Product("Paper Filters x100", "Accessories", 550, 0.8, 5),
    Product("Gift Box", "Accessories", 4500, 0.25, 3, peak_months=(11, 12)),
]


@dataclass(frozen=True)
class Sale:
    order_id: str
    date: dt.date
    region: str
    product: str
    category: str
    units: int
    unit_price_cents: int
    customer_segment: str

    @property
    def revenue_cents(self) -> int:
        return self.units * self.unit_price_cents


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


def _pick(rng: random.Random, options: Sequence[str], weights: Sequence[float]) -> str:
    return rng.choices(options, weights=weights)[0]


def _product_weight(product: Product, month: int, segment: str) -> float:
    weight = product.weight
    if product.peak_months:  # seasonal products sell mostly in season
        weight *= 4.0 if month in product.peak_months else 0.3
    if segment != "Consumer" and product.category == "Equipment":
        weight *= 1.8  # businesses kit out their offices
    return weight


def generate_rows(seed: int = SEED, n: int = N_ORDERS) -> list[Sale]:
    rng = random.Random(seed)
    start = dt.date(YEAR, 1, 1)
    days = [start + dt.timedelta(days=i) for i in range((dt.date(YEAR + 1, 1, 1) - start).days)]
    day_weights = [
        MONTH_WEIGHT[d.month - 1]
        * WEEKDAY_WEIGHT[d.weekday()]
        * (1 + YEARLY_GROWTH * i / (len(days) - 1))
        for i, d in enumerate(days)
    ]
    dates = sorted(rng.choices(days, weights=day_weights, k=n))

    rows: list[Sale] = []
    for i, date in enumerate(dates, start=1):
        summer = SUMMER[date.month - 1]
        region = _pick(
            rng, list(REGIONS), [share * (1 + lean * summer) for share, lean in REGIONS.values()]
        )
        segment = _pick(rng, list(SEGMENTS), list(SEGMENTS.values()))
        product_weights = [_product_weight(p, date.month, segment) for p in CATALOG]
        product = CATALOG[rng.choices(range(len(CATALOG)), weights=product_weights)[0]]

        units = rng.randint(1, product.max_units)
        if product.category == "Equipment":
            units += rng.randint(0, 1) if segment != "Consumer" else 0
        elif segment == "Small Business":
            units *= rng.randint(1, 3)
        elif segment == "Corporate":
            units *= rng.randint(2, 5)

        price = product.price_cents
        if date.month == 11 and 25 <= date.day <= 30:  # Black Friday week: 15% off
            price = round(price * 0.85)
        elif segment == "Corporate" and units >= 10:  # volume discount
            price = round(price * 0.9)

        rows.append(
            Sale(
                order_id=f"SO-{YEAR}-{i:05d}",
                date=date,
                region=region,
                product=product.name,
                category=product.category,
                units=units,
                unit_price_cents=price,
                customer_segment=segment,
            )
        )
    return rows


def _money(cents: int) -> str:
    return f"{cents // 100}.{cents % 100:02d}"


def write_csv(rows: Sequence[Sale], path: Path) -> None:
    with path.open("w", newline="", encoding="utf-8") as f:
        writer = csv.writer(f, lineterminator="\n")
        writer.writerow(COLUMNS)
        for r in rows:
            writer.writerow(
                [
                    r.order_id,
                    r.date.isoformat(),
                    r.region,
                    r.product,
                    r.category,
                    r.units,
                    _money(r.unit_price_cents),
                    _money(r.revenue_cents),
                    r.customer_segment,
                ]
            )


def write_xlsx(rows: Sequence[Sale], path: Path) -> None:
    from openpyxl import Workbook
    from openpyxl.styles import Font

    wb = Workbook()
    ws = wb.active
    assert ws is not None
    ws.title = "sales"
    ws.append(COLUMNS)
    for cell in ws[1]:
        cell.font = Font(bold=True)
    for r in rows:
        ws.append(
            [
                r.order_id,
                r.date,
                r.region,
                r.product,
                r.category,
                r.units,
                r.unit_price_cents / 100,
                r.revenue_cents / 100,
                r.customer_segment,
            ]
        )
    for row in ws.iter_rows(min_row=2):
        row[1].number_format = "yyyy-mm-dd"
        row[6].number_format = row[7].number_format = "#,##0.00"
    ws.freeze_panes = "A2"
    for letter, width in zip("ABCDEFGHI", [14, 12, 8, 20, 12, 7, 11, 11, 16], strict=True):
        ws.column_dimensions[letter].width = width

    fixed = dt.datetime(YEAR, 12, 31)
    wb.properties.creator = "sandlot examples/data/make_sales.py"
    wb.properties.created = fixed
    buf = io.BytesIO()
    wb.save(buf)
    path.write_bytes(_reproducible_zip(buf.getvalue(), fixed))


def _reproducible_zip(data: bytes, when: dt.datetime) -> bytes:
    """Pin the timestamps openpyxl takes from the clock, so the bytes are reproducible."""
    out = io.BytesIO()
    stamp = when.strftime("%Y-%m-%dT%H:%M:%SZ").encode()
    with zipfile.ZipFile(io.BytesIO(data)) as src, zipfile.ZipFile(out, "w") as dst:
        for info in src.infolist():
            content = src.read(info.filename)
            if info.filename == "docProps/core.xml":
                content = re.sub(
                    rb"(<dcterms:modified[^>]*>)[^<]*(</dcterms:modified>)",
                    rb"\g<1>" + stamp + rb"\g<2>",
                    content,
                )
            pinned = zipfile.ZipInfo(info.filename, date_time=when.timetuple()[:6])
            pinned.compress_type = zipfile.ZIP_DEFLATED
            dst.writestr(pinned, content)
    return out.getvalue()


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--out", type=Path, default=Path(__file__).resolve().parent, help="output directory"
    )
    args = parser.parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)

    rows = generate_rows()
    write_csv(rows, args.out / "sales.csv")
    write_xlsx(rows, args.out / "sales.xlsx")
    for name in ("sales.csv", "sales.xlsx"):
        path = args.out / name
        print(f"wrote {path} ({path.stat().st_size:,} bytes, {len(rows):,} rows)")


if __name__ == "__main__":
    main()
