"""data_analysis: the everyday work of a code-interpreter agent, with answers known before the task runs.

Every data set is generated here from a seed, and every expected answer is computed here from the same rows
(exact fractions where the sandbox prints rounded floats), so a task checks the exact text pandas, numpy, the
csv module or awk prints inside the sandbox. A wrong answer means a missing or broken library, a file that
arrived altered, an encoding mangled on the way or state lost between cells; not a typo in the corpus.
"""

from __future__ import annotations

import csv
import io
import itertools
import json
import math
import random
import re
import statistics
from collections import Counter, defaultdict
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from datetime import date, timedelta
from fractions import Fraction

from .._checks import Check, CodeError, CodeText, ExitCode, Ok, RichResult, Stdout
from .._task import Blob, Code, Exec, Setup, Severity, Step, Task

__all__ = ["tasks"]

CATEGORY = "data_analysis"
REGIONS = ("North", "South", "East", "West")
PRODUCTS = ("apple", "banana", "cherry", "date", "elderberry")


def tasks() -> Iterable[Task]:
    yield from _csv_stats()
    yield from _groupby()
    yield from _joins()
    yield from _pivots()
    yield from _dates()
    yield from _missing()
    yield from _encodings()
    yield from _json()
    yield from _numpy()
    yield from _stdlib_and_shell()
    yield from _code_cells()
    yield from _charts()


def _task(family: str, variant: str, title: str, steps: Iterable[Step], *, setup: Setup | None = None,
          severity: Severity = "high", budget: float = 120) -> Task:
    # pandas and matplotlib take about a CPU-second to import: the budget leaves room for a crowded machine.
    return Task(id=f"{family}/{variant}", family=family, category=CATEGORY, title=title, steps=tuple(steps),
                setup=setup or Setup(), severity=severity, budget=budget)


def _fmt(value: Fraction | float, places: int) -> str:
    """`value` printed with `places` decimals, refusing values so close to a rounding tie that the sandbox's
    floating point could print the other neighbour (then the data set must change, not the check)."""
    scaled = Fraction(value) * 10**places
    frac = scaled - math.floor(scaled)
    if abs(frac - Fraction(1, 2)) < Fraction(1, 10**6):
        raise ValueError(f"{float(value)!r} is too close to a rounding tie at {places} places")
    return f"{float(value):.{places}f}"


def _py(script: str, checks: tuple[Check, ...], timeout: float = 90) -> Exec:
    """Run a Python script given as argv (no shell quoting to get wrong)."""
    return Exec(("python3", "-c", script), (Ok(), ExitCode(0), *checks), timeout=timeout)


def _out(text: str, mode: str = "wrong_result") -> Stdout:
    """Stdout is exactly `text`. An anchored pattern, not `equals`: a wrong answer is `mode`, not the byte-level
    mode (binary_corruption) that `equals` names for any difference, and the detail shows what was printed."""
    return Stdout(matches=r"\A" + re.escape(text) + r"\Z", mode=mode)


# -- the data ---------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Sale:
    order_id: int
    day: date
    region: str
    product: str
    units: int
    cents: int  # unit price
    customer: int

    @property
    def revenue(self) -> int:
        return self.units * self.cents


def sales(seed: int, n: int = 240) -> list[Sale]:
    rng = random.Random(seed)  # noqa: S311 - reproducible test data
    start = date(2023, 1, 1)
    return [Sale(i + 1, start + timedelta(days=rng.randrange(365)), rng.choice(REGIONS), rng.choice(PRODUCTS),
                 rng.randint(1, 50), rng.randint(100, 9999), rng.randint(1, 40)) for i in range(n)]


def money(cents: int) -> str:
    return f"{cents // 100}.{cents % 100:02d}"


def sales_csv(rows: list[Sale], *, sep: str = ",", decimal: str = ".") -> str:
    lines = [sep.join(("order_id", "date", "region", "product", "units", "price", "customer_id"))]
    for r in rows:
        price = money(r.cents).replace(".", decimal)
        lines.append(sep.join((str(r.order_id), r.day.isoformat(), r.region, r.product, str(r.units), price,
                               str(r.customer))))
    return "\n".join(lines) + "\n"


def _sales_setup(rows: list[Sale], path: str = "/workspace/sales.csv") -> Setup:
    return Setup(files=((path, Blob.literal(sales_csv(rows))),))


LOAD = "import pandas as pd\ndf = pd.read_csv('/workspace/sales.csv', parse_dates=['date'])\n"


def _median(values: list[int]) -> Fraction:
    return Fraction(statistics.median_low(values) + statistics.median_high(values), 2)


def _stdev(values: list[int]) -> float:
    mean = Fraction(sum(values), len(values))
    var = sum((Fraction(v) - mean) ** 2 for v in values) / (len(values) - 1)
    return math.sqrt(var)


# -- families ---------------------------------------------------------------------------------------------------


def _csv_stats() -> Iterator[Task]:
    family = "data_analysis.csv_stats"
    rows = sales(1)
    setup = _sales_setup(rows)
    units = [r.units for r in rows]
    n = len(rows)
    revenue = sum(r.revenue for r in rows)
    by_rev = max(rows, key=lambda r: (r.revenue, -r.order_id))
    # (variant, what, code printing the answer, expected stdout)
    cases: list[tuple[str, str, str, str]] = [
        ("row-count", "count the rows", "print(len(df))", f"{n}\n"),
        ("sum-units", "total units sold", "print(df['units'].sum())", f"{sum(units)}\n"),
        ("sum-revenue", "total revenue (units x price)", "print(f\"{(df.units * df.price).sum():.2f}\")",
         f"{money(revenue)}\n"),
        ("mean-price", "mean unit price", "print(f\"{df.price.mean():.4f}\")",
         _fmt(Fraction(sum(r.cents for r in rows), 100 * n), 4) + "\n"),
        ("median-units", "median units", "print(f\"{df.units.median():.1f}\")", _fmt(_median(units), 1) + "\n"),
        ("std-units", "sample standard deviation of units", "print(f\"{df.units.std():.4f}\")",
         _fmt(_stdev(units), 4) + "\n"),
        ("min-max-price", "cheapest and dearest price", "print(f\"{df.price.min():.2f} {df.price.max():.2f}\")",
         f"{money(min(r.cents for r in rows))} {money(max(r.cents for r in rows))}\n"),
        ("nunique-customers", "distinct customers", "print(df.customer_id.nunique())",
         f"{len({r.customer for r in rows})}\n"),
        ("idxmax-revenue", "the order with the highest revenue",
         "df['rev'] = df.units * df.price\nprint(df.sort_values(['rev', 'order_id'], ascending=[False, True])"
         ".iloc[0].order_id)", f"{by_rev.order_id}\n"),
        ("value-counts-region", "orders per region, most first",
         "vc = df.region.value_counts()\nfor k in sorted(vc.index, key=lambda k: (-vc[k], k)): print(k, vc[k])",
         "".join(f"{k} {v}\n" for k, v in sorted(Counter(r.region for r in rows).items(),
                                                 key=lambda kv: (-kv[1], kv[0])))),
        ("min-max-date", "first and last order date",
         "print(df.date.min().date(), df.date.max().date())",
         f"{min(r.day for r in rows)} {max(r.day for r in rows)}\n"),
        ("filter-count", "orders of 40 units or more", "print((df.units >= 40).sum())",
         f"{sum(u >= 40 for u in units)}\n"),
        ("cumsum-last", "running total of units, last value", "print(df.units.cumsum().iloc[-1])",
         f"{sum(units)}\n"),
        ("weighted-mean-price", "unit price weighted by units",
         "print(f\"{(df.units * df.price).sum() / df.units.sum():.4f}\")",
         _fmt(Fraction(revenue, 100 * sum(units)), 4) + "\n"),
        ("quantile-units", "units at the lower quartile (nearest rank, 'lower')",
         "print(df.units.quantile(0.25, interpolation='lower'))",
         f"{sorted(units)[math.floor(0.25 * (n - 1))]}\n"),
    ]
    for variant, what, code, expected in cases:
        yield _task(family, variant, f"pandas on a 240-row sales CSV: {what}",
                    [_py(LOAD + code, (_out(expected),))], setup=setup)


def _grouped(rows: list[Sale], key: Callable[[Sale], str], value: Callable[[Sale], int]) -> dict[str, list[int]]:
    groups: dict[str, list[int]] = defaultdict(list)
    for r in rows:
        groups[key(r)].append(value(r))
    return dict(sorted(groups.items()))


def _groupby() -> Iterator[Task]:
    family = "data_analysis.groupby"
    rows = sales(2, 300)
    setup = _sales_setup(rows)
    by_region_units = _grouped(rows, lambda r: r.region, lambda r: r.units)
    by_product_price = _grouped(rows, lambda r: r.product, lambda r: r.cents)
    by_product_rev = _grouped(rows, lambda r: r.product, lambda r: r.revenue)
    pair_counts = Counter((r.region, r.product) for r in rows)
    month_units = _grouped(rows, lambda r: r.day.strftime("%Y-%m"), lambda r: r.units)
    top3 = sorted(by_product_rev.items(), key=lambda kv: (-sum(kv[1]), kv[0]))[:3]
    share = {k: Fraction(sum(v), sum(r.units for r in rows)) for k, v in by_region_units.items()}
    cust_orders = Counter(r.customer for r in rows)
    busy = sorted(c for c, k in cust_orders.items() if k >= 10)
    cases: list[tuple[str, str, str, str]] = [
        ("sum-by-region", "units per region",
         "for k, v in df.groupby('region')['units'].sum().items(): print(k, v)",
         "".join(f"{k} {sum(v)}\n" for k, v in by_region_units.items())),
        ("mean-by-product", "mean price per product",
         "for k, v in df.groupby('product')['price'].mean().items(): print(k, f'{v:.4f}')",
         "".join(f"{k} {_fmt(Fraction(sum(v), 100 * len(v)), 4)}\n" for k, v in by_product_price.items())),
        ("count-by-two-keys", "orders per region and product",
         "for (a, b), v in df.groupby(['region', 'product']).size().items(): print(a, b, v)",
         "".join(f"{a} {b} {v}\n" for (a, b), v in sorted(pair_counts.items()))),
        ("max-by-region", "largest order per region",
         "for k, v in df.groupby('region')['units'].max().items(): print(k, v)",
         "".join(f"{k} {max(v)}\n" for k, v in by_region_units.items())),
        ("agg-several", "min, max and count of units per region",
         "g = df.groupby('region')['units'].agg(['min', 'max', 'count'])\n"
         "for k, r in g.iterrows(): print(k, r['min'], r['max'], r['count'])",
         "".join(f"{k} {min(v)} {max(v)} {len(v)}\n" for k, v in by_region_units.items())),
        ("top3-products-revenue", "the three products with the most revenue",
         "df['rev'] = df.units * df.price\ns = df.groupby('product')['rev'].sum().round(2)\n"
         "for k, v in sorted(s.items(), key=lambda kv: (-kv[1], kv[0]))[:3]: print(k, f'{v:.2f}')",
         "".join(f"{k} {money(sum(v))}\n" for k, v in top3)),
        ("share-by-region", "each region's share of units, in percent",
         "s = df.groupby('region')['units'].sum()\nfor k, v in (100 * s / s.sum()).items(): print(k, f'{v:.3f}')",
         "".join(f"{k} {_fmt(100 * v, 3)}\n" for k, v in share.items())),
        ("filter-groups", "customers with at least 10 orders",
         "s = df.groupby('customer_id').filter(lambda g: len(g) >= 10)\nprint(*sorted(s.customer_id.unique()))",
         " ".join(map(str, busy)) + "\n"),
        ("monthly-sum", "units per month",
         "m = df.groupby(df.date.dt.strftime('%Y-%m'))['units'].sum()\nfor k, v in m.items(): print(k, v)",
         "".join(f"{k} {sum(v)}\n" for k, v in month_units.items())),
        ("resample-monthly", "units per month with resample",
         "m = df.set_index('date').sort_index()['units'].resample('M').sum()\n"
         "for k, v in m.items(): print(k.strftime('%Y-%m'), v)",
         "".join(f"{k} {sum(v)}\n" for k, v in month_units.items())),
        ("transform-rank", "each region's biggest order id (ties: lowest id)",
         "d = df.sort_values(['region', 'units', 'order_id'], ascending=[True, False, True])\n"
         "for k, v in d.groupby('region').head(1).set_index('region')['order_id'].sort_index().items(): print(k, v)",
         "".join(f"{k} {min((r for r in rows if r.region == k), key=lambda r: (-r.units, r.order_id)).order_id}\n"
                 for k in sorted(REGIONS))),
        ("nunique-by-region", "distinct customers per region",
         "for k, v in df.groupby('region')['customer_id'].nunique().items(): print(k, v)",
         "".join(f"{k} {len({r.customer for r in rows if r.region == k})}\n" for k in sorted(REGIONS))),
    ]
    for variant, what, code, expected in cases:
        yield _task(family, variant, f"pandas groupby on a 300-row sales CSV: {what}",
                    [_py(LOAD + code, (_out(expected),))], setup=setup)


NAMES = ("Ana", "Bjørn", "Chloé", "Dmitri", "Eun-ji", "Fatima", "Gustav", "Hiroshi", "Ifeoma", "José")


@dataclass(frozen=True)
class Customer:
    id: int
    name: str
    country: str


def customers(seed: int, n: int = 45) -> list[Customer]:
    rng = random.Random(seed)  # noqa: S311 - reproducible test data
    return [Customer(i + 1, f"{rng.choice(NAMES)} {i + 1}", rng.choice(("NO", "FR", "KR", "JP", "NG")))
            for i in range(n)]


def _joins() -> Iterator[Task]:
    family = "data_analysis.join"
    rows = sales(3, 200)
    custs = customers(3)
    cust_csv = "id,name,country\n" + "".join(f"{c.id},{c.name},{c.country}\n" for c in custs)
    # Orders reference customers 1..40; customers 41..45 have none. Drop customers 5 and 6 so some orders dangle.
    kept = [c for c in custs if c.id not in (5, 6)]
    kept_csv = "id,name,country\n" + "".join(f"{c.id},{c.name},{c.country}\n" for c in kept)
    setup = Setup(files=(("/workspace/sales.csv", Blob.literal(sales_csv(rows))),
                         ("/workspace/customers.csv", Blob.literal(kept_csv)),
                         ("/workspace/all_customers.csv", Blob.literal(cust_csv))))
    load = LOAD + "cu = pd.read_csv('/workspace/customers.csv')\nallc = pd.read_csv('/workspace/all_customers.csv')\n"
    kept_ids = {c.id for c in kept}
    inner = [r for r in rows if r.customer in kept_ids]
    country = {c.id: c.country for c in custs}
    by_country: Counter[str] = Counter()
    for r in rows:
        by_country[country[r.customer]] += r.units
    no_orders = sorted(c.id for c in custs if c.id not in {r.customer for r in rows})
    name = {c.id: c.name for c in custs}
    top_customer = max(sorted({r.customer for r in rows}),
                       key=lambda c: (sum(r.revenue for r in rows if r.customer == c), -c))
    cases: list[tuple[str, str, str, str]] = [
        ("inner-count", "inner join orders to customers (two customers missing)",
         "m = df.merge(cu, left_on='customer_id', right_on='id')\nprint(len(m))", f"{len(inner)}\n"),
        ("left-unmatched", "left join: orders without a customer row",
         "m = df.merge(cu, left_on='customer_id', right_on='id', how='left')\nprint(len(m), m['name'].isna().sum())",
         f"{len(rows)} {len(rows) - len(inner)}\n"),
        ("anti-join", "customers who never ordered",
         "print(*sorted(set(allc.id) - set(df.customer_id)))", " ".join(map(str, no_orders)) + "\n"),
        ("units-by-country", "units per customer country",
         "m = df.merge(allc, left_on='customer_id', right_on='id')\n"
         "for k, v in m.groupby('country')['units'].sum().items(): print(k, v)",
         "".join(f"{k} {v}\n" for k, v in sorted(by_country.items()))),
        ("best-customer-name", "the name of the customer with the most revenue (non-ASCII names)",
         "df['rev'] = df.units * df.price\nm = df.merge(allc, left_on='customer_id', right_on='id')\n"
         "s = m.groupby(['customer_id', 'name'])['rev'].sum().reset_index()\n"
         "s = s.sort_values(['rev', 'customer_id'], ascending=[False, True])\nprint(s.iloc[0]['name'])",
         f"{name[top_customer]}\n"),
        ("outer-count", "outer join row count",
         "m = df.merge(allc, left_on='customer_id', right_on='id', how='outer')\nprint(len(m))",
         f"{len(rows) + len(no_orders)}\n"),
        ("concat-halves", "concatenate two halves and dedupe",
         "a, b = df.iloc[:120], df.iloc[80:]\nc = pd.concat([a, b]).drop_duplicates('order_id')\nprint(len(c))",
         f"{len(rows)}\n"),
        ("merge-suffixes", "self-merge on region keeps both sides' columns",
         "a = df[df.order_id <= 3][['region', 'units']]\nm = a.merge(a, on='region', suffixes=('_l', '_r'))\n"
         "print(sorted(m.columns))",
         "['region', 'units_l', 'units_r']\n"),
        ("validate-many-to-one", "a many-to-one merge validates",
         "m = df.merge(allc, left_on='customer_id', right_on='id', validate='many_to_one')\nprint('valid', len(m))",
         f"valid {len(rows)}\n"),
    ]
    for variant, what, code, expected in cases:
        yield _task(family, variant, f"pandas join of orders and customers: {what}",
                    [_py(load + code, (_out(expected),))], setup=setup)


def _quarter(d: date) -> int:
    return (d.month - 1) // 3 + 1


def _pivots() -> Iterator[Task]:
    family = "data_analysis.pivot"
    rows = sales(4, 260)
    setup = _sales_setup(rows)
    table: dict[tuple[str, int], int] = Counter()
    for r in rows:
        table[r.region, _quarter(r.day)] += r.units
    regions = sorted(REGIONS)
    pivot_text = "".join(f"{g} " + " ".join(str(table[g, q]) for q in range(1, 5)) + "\n" for g in regions)
    counts = Counter((r.region, r.product) for r in rows)
    cross = "".join(f"{g} " + " ".join(str(counts[g, p]) for p in PRODUCTS) + "\n" for g in regions)
    totals = [sum(table[g, q] for g in regions) for q in range(1, 5)]
    cases: list[tuple[str, str, str, str]] = [
        ("region-by-quarter", "units by region and quarter",
         "df['q'] = df.date.dt.quarter\n"
         "p = df.pivot_table(index='region', columns='q', values='units', aggfunc='sum', fill_value=0)\n"
         "for k, r in p.astype(int).iterrows(): print(k, *r.tolist())", pivot_text),
        ("crosstab-counts", "orders per region and product (crosstab)",
         "c = pd.crosstab(df.region, df['product'])\nfor k, r in c.iterrows(): print(k, *r.tolist())", cross),
        ("margins-total", "the quarter totals row of a pivot with margins",
         "df['q'] = df.date.dt.quarter\n"
         "p = df.pivot_table(index='region', columns='q', values='units', aggfunc='sum', margins=True)\n"
         "print(*p.loc['All'].astype(int).tolist())", " ".join(map(str, [*totals, sum(totals)])) + "\n"),
        ("unstack", "groupby then unstack equals the pivot",
         "df['q'] = df.date.dt.quarter\nu = df.groupby(['region', 'q'])['units'].sum().unstack(fill_value=0)\n"
         "for k, r in u.iterrows(): print(k, *r.tolist())", pivot_text),
        ("melt-roundtrip", "melt the pivot back to long form and total it",
         "df['q'] = df.date.dt.quarter\n"
         "p = df.pivot_table(index='region', columns='q', values='units', aggfunc='sum', fill_value=0)\n"
         "m = p.reset_index().melt(id_vars='region')\nprint(len(m), m.value.sum())",
         f"16 {sum(table.values())}\n"),
        ("pivot-to-csv", "write the pivot to CSV and read the file back",
         "df['q'] = df.date.dt.quarter\n"
         "p = df.pivot_table(index='region', columns='q', values='units', aggfunc='sum', fill_value=0)\n"
         "p.to_csv('/workspace/pivot.csv')\nprint(open('/workspace/pivot.csv').read().splitlines()[1])",
         f"{regions[0]}," + ",".join(str(table[regions[0], q]) for q in range(1, 5)) + "\n"),
        ("max-cell", "the region and quarter with the most units",
         "df['q'] = df.date.dt.quarter\ns = df.groupby(['region', 'q'])['units'].sum()\n"
         "best = sorted(s.items(), key=lambda kv: (-kv[1], kv[0]))[0]\nprint(best[0][0], best[0][1], best[1])",
         "{} {} {}\n".format(*min(((g, q, table[g, q]) for g in regions for q in range(1, 5)),
                                  key=lambda t: (-t[2], t[0], t[1])))),
    ]
    for variant, what, code, expected in cases:
        yield _task(family, variant, f"pandas reshaping: {what}", [_py(LOAD + code, (_out(expected),))], setup=setup)


def _dates() -> Iterator[Task]:
    family = "data_analysis.dates"
    rows = sales(5, 200)
    days = sorted(r.day for r in rows)
    weekday = Counter(d.strftime("%A") for d in days)
    gaps = max((b - a).days for a, b in itertools.pairwise(days))
    eu_csv = "when,amount\n" + "".join(f"{r.day.strftime('%d/%m/%Y')},{r.units}\n" for r in rows)
    epoch_csv = "ts,v\n" + "".join(
        f"{int((r.day - date(1970, 1, 1)).total_seconds()) + 3600 * (r.order_id % 24)},{r.units}\n" for r in rows)
    setup = Setup(files=(("/workspace/sales.csv", Blob.literal(sales_csv(rows))),
                         ("/workspace/eu.csv", Blob.literal(eu_csv)),
                         ("/workspace/epoch.csv", Blob.literal(epoch_csv))))
    june = sum(r.units for r in rows if r.day.month == 6)
    busdays = sum(1 for k in range(365) if (date(2023, 1, 1) + timedelta(k)).weekday() < 5)
    q_counts = Counter(_quarter(d) for d in days)
    doy = Counter((d.timetuple().tm_yday - 1) // 7 for d in days).most_common()
    best_week = min(doy, key=lambda kv: (-kv[1], kv[0]))
    cases: list[tuple[str, str, str, str]] = [
        ("weekday-counts", "orders per weekday",
         "for k, v in sorted(df.date.dt.day_name().value_counts().items()): print(k, v)",
         "".join(f"{k} {v}\n" for k, v in sorted(weekday.items()))),
        ("largest-gap", "the longest stretch without orders, in days",
         "d = df.date.sort_values()\nprint(d.diff().max().days)", f"{gaps}\n"),
        ("dayfirst-format", "parse dd/mm/yyyy dates and total June",
         "e = pd.read_csv('/workspace/eu.csv')\ne['when'] = pd.to_datetime(e['when'], format='%d/%m/%Y')\n"
         "print(e[e['when'].dt.month == 6].amount.sum())", f"{june}\n"),
        ("epoch-seconds", "convert epoch seconds and count orders per quarter",
         "e = pd.read_csv('/workspace/epoch.csv')\ne['t'] = pd.to_datetime(e.ts, unit='s')\n"
         "for k, v in e.t.dt.quarter.value_counts().sort_index().items(): print(k, v)",
         "".join(f"{k} {v}\n" for k, v in sorted(q_counts.items()))),
        ("business-days", "business days in 2023 (numpy busday_count)",
         "import numpy as np\nprint(np.busday_count('2023-01-01', '2024-01-01'))", f"{busdays}\n"),
        ("timezone-convert", "a UTC timestamp in New York and Tokyo",
         "t = pd.Timestamp('2023-03-12 12:00', tz='UTC')\n"
         "print(t.tz_convert('America/New_York').strftime('%H:%M %Z'), t.tz_convert('Asia/Tokyo').strftime('%H:%M'))",
         "08:00 EDT 21:00\n"),
        ("busiest-week", "the week of the year with the most orders",
         "w = ((df.date.dt.dayofyear - 1) // 7).value_counts()\n"
         "k = sorted(w.items(), key=lambda kv: (-kv[1], kv[0]))[0]\nprint(k[0], k[1])",
         f"{best_week[0]} {best_week[1]}\n"),
        ("date-range-fill", "days of 2023 without any order",
         "r = pd.date_range('2023-01-01', '2023-12-31')\nprint(len(r.difference(pd.DatetimeIndex(df.date))))",
         f"{365 - len(set(days))}\n"),
        ("month-end-offset", "month ends of the first three order months",
         "d = sorted(set((df.date + pd.offsets.MonthEnd(0)).dt.date))[:3]\nprint(*d)",
         " ".join(str(d) for d in sorted({_month_end(d) for d in days})[:3]) + "\n"),
    ]
    for variant, what, code, expected in cases:
        yield _task(family, variant, f"dates in pandas: {what}", [_py(LOAD + code, (_out(expected),))], setup=setup)


def _month_end(d: date) -> date:
    nxt = date(d.year + d.month // 12, d.month % 12 + 1, 1)
    return nxt - timedelta(days=1)


def _missing() -> Iterator[Task]:
    family = "data_analysis.missing"
    rng = random.Random(6)  # noqa: S311 - reproducible test data
    n = 150
    # Columns a (ints, ~20% missing as empty), b (floats with 1 decimal, 'NA' and 'n/a' markers), c (text, '' missing)
    a = [None if rng.random() < 0.2 else rng.randint(0, 100) for _ in range(n)]
    b = [None if rng.random() < 0.15 else rng.randint(0, 500) for _ in range(n)]  # tenths
    markers = ("NA", "n/a")
    c = [None if rng.random() < 0.1 else rng.choice(("x", "y", "z")) for _ in range(n)]
    lines = ["id,a,b,c"]
    for i in range(n):
        bi = b[i]
        bs = rng.choice(markers) if bi is None else f"{bi // 10}.{bi % 10}"
        lines.append(f"{i},{'' if a[i] is None else a[i]},{bs},{'' if c[i] is None else c[i]}")
    setup = Setup(files=(("/workspace/gaps.csv", Blob.literal("\n".join(lines) + "\n")),))
    load = "import pandas as pd\ndf = pd.read_csv('/workspace/gaps.csv', na_values=['NA', 'n/a'])\n"
    av = [x for x in a if x is not None]
    bv = [x for x in b if x is not None]
    mean_a = Fraction(sum(av), len(av))
    ffill: list[int] = []
    last: int | None = None
    for x in a:
        last = x if x is not None else last
        if last is not None:
            ffill.append(last)
    complete = sum(1 for i in range(n) if a[i] is not None and b[i] is not None and c[i] is not None)
    interp = _interpolated_sum(a)
    cases: list[tuple[str, str, str, str]] = [
        ("isna-per-column", "missing values per column",
         "print(*df.isna().sum().tolist())", f"0 {n - len(av)} {n - len(bv)} {c.count(None)}\n"),
        ("mean-skips-nan", "mean of a column with gaps",
         "print(f'{df.a.mean():.4f}')", _fmt(mean_a, 4) + "\n"),
        ("fillna-mean-sum", "fill gaps with the mean, then total",
         "print(f'{df.a.fillna(df.a.mean()).sum():.3f}')",
         _fmt(sum(av) + (n - len(av)) * mean_a, 3) + "\n"),
        ("dropna-rows", "rows with no missing value", "print(len(df.dropna()))", f"{complete}\n"),
        ("dropna-subset", "rows where b is present", "print(len(df.dropna(subset=['b'])))", f"{len(bv)}\n"),
        ("na-markers-sum", "'NA' and 'n/a' read as missing: sum of b",
         "print(f'{df.b.sum():.1f}')", _fmt(Fraction(sum(bv), 10), 1) + "\n"),
        ("ffill-sum", "forward-fill, then total (leading gaps stay)",
         "print(int(df.a.ffill().sum()))", f"{sum(ffill)}\n"),
        ("fillna-text", "fill missing text with 'unknown' and count values",
         "s = df.c.fillna('unknown').value_counts()\nfor k in sorted(s.index): print(k, s[k])",
         "".join(f"{k} {v}\n" for k, v in sorted(Counter(x or "unknown" for x in c).items()))),
        ("interpolate-sum", "linear interpolation of inner gaps, then total",
         "print(f'{df.a.interpolate(limit_area=\"inside\").sum():.3f}')", _fmt(interp, 3) + "\n"),
        ("dtype-with-gaps", "an int column with gaps becomes float; Int64 keeps ints",
         "print(df.a.dtype, pd.read_csv('/workspace/gaps.csv', dtype={'a': 'Int64'}).a.dtype)",
         "float64 Int64\n"),
    ]
    for variant, what, code, expected in cases:
        yield _task(family, variant, f"missing values in pandas: {what}", [_py(load + code, (_out(expected),))],
                    setup=setup)


def _interpolated_sum(values: list[int | None]) -> Fraction:
    known = [i for i, v in enumerate(values) if v is not None]
    total = Fraction(sum(v for v in values if v is not None))
    for lo, hi in itertools.pairwise(known):
        va, vb = values[lo], values[hi]
        assert va is not None and vb is not None
        for i in range(lo + 1, hi):
            total += va + Fraction(vb - va) * (i - lo) / (hi - lo)
    return total


def _encodings() -> Iterator[Task]:
    family = "data_analysis.encodings"
    rows = [("東京", 1200, "🍣"), ("Zürich", 950, "🧀"), ("São Paulo", 800, "☕"), ("Kraków", 640, "🥟"),
            ("Reykjavík", 130, "🐟")]
    total = sum(r[1] for r in rows)
    uni_csv = "城市,人口,符号\n" + "".join(f"{a},{b},{c}\n" for a, b, c in rows)
    latin = [("café", 3), ("crème brûlée", 5), ("naïve", 2)]
    latin_csv = "item,qty\n" + "".join(f"{a},{b}\n" for a, b in latin)
    eu_rows = sales(7, 50)
    eu_cents = sum(r.cents for r in eu_rows)
    quoted = [("Smith, John", 'He said "hi"', 3), ("Doe, Jane", "multi\nline note", 4), ("Plain", "", 5)]
    buf = io.StringIO()
    writer = csv.writer(buf, lineterminator="\r\n")
    writer.writerow(("name", "note", "n"))
    writer.writerows(quoted)
    wide_cols = 400
    wide = ",".join(f"c{i}" for i in range(wide_cols)) + "\n" + ",".join(str(i) for i in range(wide_cols)) + "\n"
    files: dict[str, bytes] = {
        "/workspace/unicode.csv": uni_csv.encode(),
        "/workspace/bom.csv": b"\xef\xbb\xbf" + latin_csv.encode(),
        "/workspace/latin1.csv": latin_csv.encode("latin-1"),
        "/workspace/cp1252.csv": "quote,n\n\u201cfancy\u201d,1\n\u2013dash,2\n".encode("cp1252"),
        "/workspace/utf16.csv": b"\xff\xfe" + latin_csv.encode("utf-16-le"),
        "/workspace/eu.csv": sales_csv(eu_rows, sep=";", decimal=",").encode(),
        "/workspace/tabs.tsv": latin_csv.replace(",", "\t").encode(),
        "/workspace/quoted.csv": buf.getvalue().encode(),
        "/workspace/wide.csv": wide.encode(),
        "/workspace/thousands.csv": b'city,pop\nA,"1,234,567"\nB,"89,012"\n',
    }
    setup = Setup(files=tuple((p, Blob.literal(d)) for p, d in files.items()))
    pd_ = "import pandas as pd\n"
    cases: list[tuple[str, str, str, str]] = [
        ("unicode-header-sum", "sum a column whose header is Chinese",
         pd_ + "d = pd.read_csv('/workspace/unicode.csv')\nprint(d['人口'].sum())", f"{total}\n"),
        ("unicode-values-filter", "filter rows by a Unicode city name and print its emoji",
         pd_ + "d = pd.read_csv('/workspace/unicode.csv')\nprint(d[d['城市'] == 'Zürich']['符号'].iloc[0])",
         "🧀\n"),
        ("unicode-columns-list", "column names come back exactly",
         pd_ + "print('|'.join(pd.read_csv('/workspace/unicode.csv').columns))", "城市|人口|符号\n"),
        ("utf8-bom-header", "a UTF-8 BOM does not stick to the first header (utf-8-sig)",
         pd_ + "d = pd.read_csv('/workspace/bom.csv', encoding='utf-8-sig')\nprint(list(d.columns), d.qty.sum())",
         f"['item', 'qty'] {sum(q for _, q in latin)}\n"),
        ("latin1-read", "read a Latin-1 CSV with its encoding",
         pd_ + "d = pd.read_csv('/workspace/latin1.csv', encoding='latin-1')\nprint(d.item.iloc[1])",
         "crème brûlée\n"),
        ("latin1-wrong-codec-fails", "reading Latin-1 as UTF-8 fails with UnicodeDecodeError",
         pd_ + "try:\n    pd.read_csv('/workspace/latin1.csv')\nexcept UnicodeDecodeError as e:\n"
               "    print('UnicodeDecodeError', hex(e.object[e.start]))",
         "UnicodeDecodeError 0xe9\n"),
        ("cp1252-read", "Windows-1252 smart quotes decode right",
         pd_ + "d = pd.read_csv('/workspace/cp1252.csv', encoding='cp1252')\nprint(d.quote.tolist())",
         "['\u201cfancy\u201d', '\u2013dash']\n"),
        ("utf16-read", "read a UTF-16 CSV",
         pd_ + "d = pd.read_csv('/workspace/utf16.csv', encoding='utf-16')\nprint(d.qty.sum(), d.item.iloc[2])",
         f"{sum(q for _, q in latin)} naïve\n"),
        ("semicolon-decimal-comma", "semicolons and decimal commas (European Excel export)",
         pd_ + "d = pd.read_csv('/workspace/eu.csv', sep=';', decimal=',')\nprint(f'{d.price.sum():.2f}')",
         f"{money(eu_cents)}\n"),
        ("tab-separated", "a tab-separated file",
         pd_ + "d = pd.read_csv('/workspace/tabs.tsv', sep='\\t')\nprint(d.qty.sum())",
         f"{sum(q for _, q in latin)}\n"),
        ("quoted-fields", "quoted commas, doubled quotes and a newline inside a field",
         pd_ + "d = pd.read_csv('/workspace/quoted.csv', keep_default_na=False)\n"
               "print(len(d), repr(d.note[0]), repr(d.note[1]), d.n.sum())",
         f"3 'He said \"hi\"' 'multi\\nline note' {sum(q[2] for q in quoted)}\n"),
        ("wide-400-columns", "a 400-column CSV",
         pd_ + "d = pd.read_csv('/workspace/wide.csv')\nprint(d.shape, d.iloc[0].sum())",
         f"(1, {wide_cols}) {sum(range(wide_cols))}\n"),
        ("thousands-separator", "numbers with thousands separators",
         pd_ + "d = pd.read_csv('/workspace/thousands.csv', thousands=',')\nprint(d['pop'].sum())",
         f"{1234567 + 89012}\n"),
    ]
    for variant, what, code, expected in cases:
        yield _task(family, variant, f"CSV encodings and dialects: {what}", [_py(code, (_out(expected),))],
                    setup=setup)


def _json() -> Iterator[Task]:
    family = "data_analysis.json"
    rows = sales(8, 120)
    records = [{"id": r.order_id, "region": r.region, "units": r.units, "price": money(r.cents)} for r in rows]
    nested = [{"id": r.order_id, "customer": {"id": r.customer, "address": {"region": r.region}},
               "items": [{"sku": r.product, "qty": r.units}]} for r in rows]
    big = [{"id": 2**53 + i, "v": i} for i in range(5)]
    files = {
        "/workspace/records.json": json.dumps(records, indent=1),
        "/workspace/nested.json": json.dumps(nested),
        "/workspace/events.jsonl": "".join(json.dumps(rec) + "\n" for rec in records),
        "/workspace/unicode.json": json.dumps({"名前": "テスト", "emoji": "🦀", "esc": "tab\there"}),
        "/workspace/bigints.json": json.dumps(big),
        "/workspace/nulls.json": json.dumps([{"a": 1, "b": None}, {"a": None, "b": 2}, {"a": 3}]),
    }
    setup = Setup(files=tuple((p, Blob.literal(d)) for p, d in files.items()))
    by_region: Counter[str] = Counter()
    for r in rows:
        by_region[r.region] += r.units
    pd_ = "import pandas as pd\n"
    cases: list[tuple[str, str, str, str]] = [
        ("records-sum", "load a list of records and total units",
         pd_ + "d = pd.read_json('/workspace/records.json')\nprint(d.units.sum(), len(d))",
         f"{sum(r.units for r in rows)} {len(rows)}\n"),
        ("records-price-strings", "prices stored as strings convert exactly",
         pd_ + "d = pd.read_json('/workspace/records.json', dtype={'price': str})\n"
               "print(f\"{d.price.astype(float).sum():.2f}\")", f"{money(sum(r.cents for r in rows))}\n"),
        ("json-normalize", "flatten nested JSON and group by a nested field",
         "import json, pandas as pd\nd = pd.json_normalize(json.load(open('/workspace/nested.json')))\n"
         "print(sorted(c for c in d.columns if '.' in c))\n"
         "for k, v in d.groupby('customer.address.region').size().items(): print(k, v)",
         "['customer.address.region', 'customer.id']\n"
         + "".join(f"{k} {v}\n" for k, v in sorted(Counter(r.region for r in rows).items()))),
        ("explode-items", "explode a list column and total quantities",
         "import json, pandas as pd\nd = pd.json_normalize(json.load(open('/workspace/nested.json')), 'items')\n"
         "print(d.qty.sum())", f"{sum(r.units for r in rows)}\n"),
        ("json-lines", "read JSON Lines and group",
         pd_ + "d = pd.read_json('/workspace/events.jsonl', lines=True)\n"
               "for k, v in d.groupby('region').units.sum().items(): print(k, v)",
         "".join(f"{k} {v}\n" for k, v in sorted(by_region.items()))),
        ("unicode-roundtrip", "Unicode keys and values survive json.load and json.dumps",
         "import json\nd = json.load(open('/workspace/unicode.json', encoding='utf-8'))\n"
         "print(json.dumps(d, ensure_ascii=False, sort_keys=True))",
         json.dumps({"名前": "テスト", "emoji": "🦀", "esc": "tab\there"}, ensure_ascii=False, sort_keys=True) + "\n"),
        ("big-integers", "integers above 2**53 keep their exact value",
         "import json\nprint(*[r['id'] for r in json.load(open('/workspace/bigints.json'))])",
         " ".join(str(b["id"]) for b in big) + "\n"),
        ("nulls-and-missing-keys", "null and missing keys both become NaN",
         pd_ + "d = pd.read_json('/workspace/nulls.json')\nprint(*d.isna().sum().tolist(), d.a.sum())",
         "1 2 4.0\n"),
        ("to-json-records", "write records JSON from a DataFrame and read it back",
         pd_ + "d = pd.read_json('/workspace/records.json')\n"
               "d.groupby('region').units.sum().reset_index().to_json('/workspace/out.json', orient='records')\n"
               "import json\nprint(json.load(open('/workspace/out.json')))",
         str([{"region": k, "units": v} for k, v in sorted(by_region.items())]) + "\n"),
        ("stdlib-json-aggregate", "json module only: units per region",
         "import json, collections\nc = collections.Counter()\n"
         "for r in json.load(open('/workspace/records.json')): c[r['region']] += r['units']\n"
         "print(json.dumps(dict(sorted(c.items()))))", json.dumps(dict(sorted(by_region.items()))) + "\n"),
    ]
    for variant, what, code, expected in cases:
        yield _task(family, variant, f"JSON data: {what}", [_py(code, (_out(expected),))], setup=setup)


def _numpy() -> Iterator[Task]:
    family = "data_analysis.numpy"
    rng = random.Random(9)  # noqa: S311 - reproducible test data
    n = 6
    x = [rng.randint(-9, 9) for _ in range(n)]
    a = [[rng.randint(-5, 5) + (12 if i == j else 0) for j in range(n)] for i in range(n)]  # diagonally dominant
    b = [sum(a[i][j] * x[j] for j in range(n)) for i in range(n)]
    det = _det(a)
    data = [rng.randint(0, 1000) for _ in range(1001)]
    pct = sorted(data)
    hist = Counter(v // 100 for v in data)
    np_ = "import numpy as np\n"
    cases: list[tuple[str, str, str, str]] = [
        ("solve-integer-system", "solve a 6x6 system whose solution is integers",
         np_ + f"A = np.array({a}, dtype=float)\nb = np.array({b}, dtype=float)\n"
               "print(*np.rint(np.linalg.solve(A, b)).astype(int))", " ".join(map(str, x)) + "\n"),
        ("determinant", "the determinant of an integer matrix",
         np_ + f"print(int(round(np.linalg.det(np.array({a}, dtype=float)))))", f"{det}\n"),
        ("inverse-identity", "A times its inverse is the identity",
         np_ + f"A = np.array({a}, dtype=float)\nprint(np.allclose(A @ np.linalg.inv(A), np.eye({n})))", "True\n"),
        ("symmetric-eigenvalues", "eigenvalues of Q diag(1..5) Q^T",
         np_ + "rng = np.random.default_rng(0)\nq, _ = np.linalg.qr(rng.normal(size=(5, 5)))\n"
               "m = q @ np.diag([1., 2., 3., 4., 5.]) @ q.T\nprint(*np.round(np.linalg.eigvalsh(m), 6))",
         "1.0 2.0 3.0 4.0 5.0\n"),
        ("lstsq-exact-line", "least squares recovers y = 3x - 2",
         np_ + "x = np.arange(10.)\nA = np.vstack([x, np.ones(10)]).T\n"
               "c = np.linalg.lstsq(A, 3 * x - 2, rcond=None)[0]\nprint(*np.round(c, 6))", "3.0 -2.0\n"),
        ("matrix-rank", "rank of a matrix with a dependent row",
         np_ + "m = np.array([[1, 2, 3], [2, 4, 6], [1, 0, 1]])\nprint(np.linalg.matrix_rank(m))", "2\n"),
        ("svd-singular-values", "singular values of a scaled orthogonal matrix",
         np_ + "print(*np.round(np.linalg.svd(np.diag([3., -7., 2.]), compute_uv=False), 6))", "7.0 3.0 2.0\n"),
        ("cholesky", "Cholesky factor of a known SPD matrix",
         np_ + "L = np.array([[2., 0, 0], [1., 3., 0], [4., 5., 6.]])\n"
               "print(*np.round(np.linalg.cholesky(L @ L.T).ravel(), 6))",
         "2.0 0.0 0.0 1.0 3.0 0.0 4.0 5.0 6.0\n"),
        ("percentiles", "percentiles of 1001 integers (exact ranks)",
         np_ + f"d = np.array({data})\nprint(*np.percentile(d, [0, 25, 50, 75, 100]).astype(int))",
         " ".join(str(pct[k]) for k in (0, 250, 500, 750, 1000)) + "\n"),
        ("histogram-bins", "histogram counts with bins of width 100",
         np_ + f"d = np.array({data})\nprint(*np.bincount(d // 100))",
         " ".join(str(hist[k]) for k in range(max(hist) + 1)) + "\n"),
        ("unique-counts", "distinct values and the commonest",
         np_ + f"d = np.array({data})\nu, c = np.unique(d, return_counts=True)\n"
               "print(len(u), u[np.argmax(c)], c.max())",
         "{} {} {}\n".format(len(set(data)), *min(Counter(data).items(), key=lambda kv: (-kv[1], kv[0])))),
        ("broadcast-outer", "an outer product by broadcasting",
         np_ + "a = np.arange(1, 5)\nprint((a[:, None] * a[None, :]).sum(), np.trace(np.outer(a, a)))",
         f"{sum(range(1, 5)) ** 2} {sum(k * k for k in range(1, 5))}\n"),
        ("int-overflow-dtype", "int64 arithmetic wraps; Python ints do not",
         np_ + "a = np.array([2**62], dtype=np.int64)\nprint(int((a * 4)[0]), 2**62 * 4)",
         f"0 {2**64}\n"),
    ]
    for variant, what, code, expected in cases:
        yield _task(family, variant, f"numpy: {what}", [_py(code, (_out(expected),))])
    # Arrays saved in one step and loaded in a later one.
    yield _task(family, "save-load-npy", "save an array with np.save; load it in a later command",
                [_py(np_ + "np.save('/workspace/arr.npy', np.arange(12, dtype=np.int32).reshape(3, 4))", ()),
                 Exec("echo between", (ExitCode(0),)),
                 _py(np_ + "a = np.load('/workspace/arr.npy')\nprint(a.dtype, a.shape, a.sum())",
                     (_out("int32 (3, 4) 66\n", "lost_state"),))])


def _det(m: list[list[int]]) -> int:
    """Exact determinant by fraction-free elimination (Bareiss)."""
    a = [row[:] for row in m]
    n, sign, prev = len(a), 1, 1
    for k in range(n - 1):
        if a[k][k] == 0:
            swap = next(i for i in range(k + 1, n) if a[i][k] != 0)
            a[k], a[swap] = a[swap], a[k]
            sign = -sign
        for i in range(k + 1, n):
            for j in range(k + 1, n):
                a[i][j] = (a[i][j] * a[k][k] - a[i][k] * a[k][j]) // prev
        prev = a[k][k]
    return sign * a[n - 1][n - 1]


def _stdlib_and_shell() -> Iterator[Task]:
    """The same questions answered without pandas: csv, statistics, sqlite3, awk, sort and uniq."""
    family = "data_analysis.stdlib_shell"
    rows = sales(10, 400)
    setup = _sales_setup(rows)
    by_region = _grouped(rows, lambda r: r.region, lambda r: r.units)
    products = Counter(r.product for r in rows)
    rev_by_product = _grouped(rows, lambda r: r.product, lambda r: r.revenue)
    units = [r.units for r in rows]
    cases: list[tuple[str, str, Exec]] = [
        ("csv-module-sum", "csv.DictReader totals units per region", _py(
            "import csv, collections\nc = collections.Counter()\n"
            "for r in csv.DictReader(open('/workspace/sales.csv')): c[r['region']] += int(r['units'])\n"
            "for k in sorted(c): print(k, c[k])",
            (_out("".join(f"{k} {sum(v)}\n" for k, v in by_region.items())),))),
        ("statistics-module", "statistics.mean/median/pstdev of units", _py(
            "import csv, statistics as s\nu = [int(r['units']) for r in csv.DictReader(open('/workspace/sales.csv'))]\n"
            "print(f'{s.mean(u):.4f} {s.median(u)} {s.pstdev(u):.4f}')",
            (_out(f"{_fmt(Fraction(sum(units), len(units)), 4)} {statistics.median(units)} "
                  f"{_fmt(statistics.pstdev(units), 4)}\n"),))),
        ("decimal-exact-revenue", "decimal.Decimal gives the exact revenue", _py(
            "import csv\nfrom decimal import Decimal\n"
            "print(sum(Decimal(r['price']) * int(r['units']) for r in csv.DictReader(open('/workspace/sales.csv'))))",
            (_out(f"{money(sum(r.revenue for r in rows))}\n"),))),
        ("sqlite-group-by", "load the CSV into sqlite3 and GROUP BY", _py(
            "import csv, sqlite3\ndb = sqlite3.connect(':memory:')\n"
            "db.execute('create table s (region text, product text, units int, price text)')\n"
            "db.executemany('insert into s values (?,?,?,?)', [(r['region'], r['product'], r['units'], r['price'])"
            " for r in csv.DictReader(open('/workspace/sales.csv'))])\n"
            "for row in db.execute('select product, count(*) from s group by product order by product'): print(*row)",
            (_out("".join(f"{k} {v}\n" for k, v in sorted(products.items()))),))),
        ("sqlite-file-persists", "a sqlite database file written in one command is queried in the next", Exec(
            "python3 -c \"import csv, sqlite3; db = sqlite3.connect('/workspace/s.db'); "
            "db.execute('create table s (units int)'); db.executemany('insert into s values (?)', "
            "[(r['units'],) for r in csv.DictReader(open('/workspace/sales.csv'))]); db.commit()\" && "
            "python3 -c \"import sqlite3; print(sqlite3.connect('/workspace/s.db').execute("
            "'select sum(units) from s').fetchone()[0])\"", (ExitCode(0), _out(f"{sum(units)}\n")))),
        ("awk-sum-by-region", "awk totals units per region", Exec(
            "awk -F, 'NR > 1 { s[$3] += $5 } END { for (k in s) print k, s[k] }' /workspace/sales.csv | sort",
            (ExitCode(0), _out("".join(f"{k} {sum(v)}\n" for k, v in by_region.items()))))),
        ("sort-uniq-count", "cut | sort | uniq -c counts products", Exec(
            "tail -n +2 /workspace/sales.csv | cut -d, -f4 | sort | uniq -c | awk '{print $2, $1}'",
            (ExitCode(0), _out("".join(f"{k} {v}\n" for k, v in sorted(products.items())))))),
        ("awk-max-revenue-product", "awk finds the product with the most revenue", Exec(
            "awk -F, 'NR > 1 { s[$4] += $5 * $6 } END { for (k in s) printf \"%s %.2f\\n\", k, s[k] }' "
            "/workspace/sales.csv | sort -k2,2nr -k1,1 | head -1",
            (ExitCode(0), _out("{} {}\n".format(*min(((k, money(sum(v))) for k, v in rev_by_product.items()),
                                                    key=lambda kv: (-int(kv[1].replace('.', '')), kv[0]))))))),
        ("grep-count", "grep counts the orders of one region", Exec(
            "grep -c ',East,' /workspace/sales.csv", (ExitCode(0), _out(f"{len(by_region['East'])}\n")))),
        ("wc-lines", "wc -l counts header plus rows", Exec(
            "wc -l < /workspace/sales.csv", (ExitCode(0), _out(f"{len(rows) + 1}\n")))),
    ]
    for variant, what, step in cases:
        yield _task(family, variant, f"data without pandas: {what}", [step], setup=setup)


def _code_cells() -> Iterator[Task]:
    """Notebook-style work: load in one cell, ask in the next; state must carry over, tables come back as HTML."""
    family = "data_analysis.code_cells"
    rows = sales(11, 250)
    setup = _sales_setup(rows)
    load = Code("import pandas as pd\ndf = pd.read_csv('/workspace/sales.csv', parse_dates=['date'])\nlen(df)",
                (CodeText(equals=str(len(rows))),), timeout=90)
    units = sum(r.units for r in rows)
    by_region = _grouped(rows, lambda r: r.region, lambda r: r.units)
    yield _task(family, "load-then-sum", "load a CSV in one cell; sum a column in the next",
                [load, Code("int(df.units.sum())", (CodeText(equals=str(units), mode="lost_state"),))], setup=setup)
    yield _task(family, "state-after-error", "a cell that raises does not lose the DataFrame",
                [load, Code("df['nope']", (CodeError(name="KeyError", matches="nope"),)),
                 Code("int(df.units.max())", (CodeText(equals=str(max(r.units for r in rows)), mode="lost_state"),))],
                setup=setup)
    yield _task(family, "derived-column-later", "a column added in cell 2 is used in cell 3",
                [load, Code("df['rev'] = df.units * df.price", ()),
                 Code("f'{df.rev.sum():.2f}'",
                      (CodeText(equals=repr(money(sum(r.revenue for r in rows))), mode="lost_state"),))],
                setup=setup)
    yield _task(family, "function-defined-earlier", "a helper function from cell 1 is called in cell 3",
                [Code("def top(s, n=2):\n    return sorted(s.items(), key=lambda kv: (-kv[1], kv[0]))[:n]", ()),
                 load,
                 Code("top(df.groupby('region').units.sum().to_dict())",
                      (CodeText(equals=repr(sorted(((k, sum(v)) for k, v in by_region.items()),
                                                   key=lambda kv: (-kv[1], kv[0]))[:2]), mode="lost_state"),))],
                setup=setup)
    yield _task(family, "dataframe-html", "a DataFrame as the last expression comes back as an HTML table",
                [load, Code("df.groupby('region').units.sum().to_frame()",
                            (RichResult(mime="text/html", min_size=100), CodeText(matches=r"units")))], setup=setup)
    yield _task(family, "describe-html", "df.describe() comes back as HTML and text",
                [load, Code("df.describe()", (RichResult(mime="text/html", min_size=200),
                                              CodeText(matches=r"count\s+250")))], setup=setup)
    yield _task(family, "display-two-tables", "display() of two DataFrames gives two HTML results",
                [load, Code("display(df.head(3))\ndisplay(df.tail(2))\n",
                            (RichResult(mime="text/html", min_size=100), CodeText(matches=r"^$")))],
                setup=setup)
    yield _task(family, "series-text", "a Series comes back as its text repr",
                [load, Code("df.groupby('region').units.sum()",
                            (CodeText(matches="".join(rf"{k}\s+{sum(v)}\n" for k, v in by_region.items())),))],
                setup=setup)
    yield _task(family, "print-and-value", "printed output and the last value both come back",
                [load, Code("print('rows:', len(df))\ndf.units.min()",
                            (_out(f"rows: {len(rows)}\n"), CodeText(equals=str(min(r.units for r in rows)))))],
                setup=setup)
    yield _task(family, "modify-in-place", "a filter applied in cell 2 is what cell 3 sees",
                [load, Code("df = df[df.region == 'East']", ()),
                 Code("len(df)", (CodeText(equals=str(len(by_region["East"])), mode="lost_state"),))], setup=setup)
    yield _task(family, "generated-100k-rows", "generate 100,000 rows in a cell and aggregate them in the next",
                [Code("import numpy as np, pandas as pd\nrng = np.random.default_rng(1)\n"
                      "big = pd.DataFrame({'k': np.arange(100_000) % 7, 'v': np.arange(100_000)})", (), timeout=90),
                 Code("big.groupby('k').v.sum().tolist()",
                      (CodeText(equals=repr([sum(range(k, 100_000, 7)) for k in range(7)]), mode="lost_state"),))])
    yield _task(family, "shell-line-in-cell", "a '!' shell line in a cell lists the uploaded CSV",
                [Code("!wc -l /workspace/sales.csv", (_out(f"{len(rows) + 1} /workspace/sales.csv\n"),))],
                setup=setup, severity="medium")
    yield _task(family, "separate-sessions", "two named sessions keep separate variables",
                [Code("x = 'first'", (), session="one"), Code("x = 'second'", (), session="two"),
                 Code("x", (CodeText(equals="'first'", mode="lost_state"),), session="one"),
                 Code("x", (CodeText(equals="'second'", mode="lost_state"),), session="two")], severity="medium")
    yield _task(family, "to-csv-then-command", "a cell writes a CSV; a command reads it",
                [load, Code("df.groupby('region').units.sum().to_csv('/workspace/by_region.csv')", ()),
                 Exec("cat /workspace/by_region.csv",
                      (_out("region,units\n" + "".join(f"{k},{sum(v)}\n" for k, v in by_region.items()),
                            "lost_state"),))], setup=setup)
    yield _task(family, "long-cell-output", "a cell that prints 20,000 lines returns them all",
                [Code("for i in range(20000): print(i)",
                      (Stdout(equals="".join(f"{i}\n" for i in range(20000))),))], severity="medium")


def _charts() -> Iterator[Task]:
    """Figures come back as PNG results without savefig; saved files are real PNGs."""
    family = "data_analysis.charts"
    rows = sales(12, 120)
    setup = _sales_setup(rows)
    png = RichResult(mime="image/png", min_size=2000)
    plt = "import matplotlib.pyplot as plt\n"
    cells: list[tuple[str, str, str]] = [
        ("line", "a line chart", plt + "plt.plot(range(10), [v * v for v in range(10)])\nplt.title('squares')"),
        ("bar", "a bar chart of units per region",
         plt + "import pandas as pd\ndf = pd.read_csv('/workspace/sales.csv')\n"
               "df.groupby('region').units.sum().plot(kind='bar')"),
        ("histogram", "a histogram", plt + "import numpy as np\nplt.hist(np.random.default_rng(0).normal(size=1000), "
                                           "bins=30)"),
        ("scatter", "a scatter plot", plt + "import pandas as pd\ndf = pd.read_csv('/workspace/sales.csv')\n"
                                            "plt.scatter(df.units, df.price)"),
        ("subplots-grid", "a 2x2 grid of subplots",
         plt + "fig, ax = plt.subplots(2, 2)\nfor i, a in enumerate(ax.flat): a.plot([0, 1], [0, i])"),
        ("pie-unicode-labels", "a pie chart with Unicode labels",
         plt + "plt.pie([3, 2, 1], labels=['Zürich', 'São Paulo', 'Kraków'])"),
        ("pandas-plot-line", "DataFrame.plot over dates",
         "import pandas as pd\ndf = pd.read_csv('/workspace/sales.csv', parse_dates=['date'])\n"
         "df.groupby(df.date.dt.month).units.sum().plot()"),
    ]
    for variant, what, code in cells:
        yield _task(family, variant, f"a code cell draws {what}; the figure comes back as a PNG",
                    [Code(code, (png,), timeout=90)], setup=setup, severity="medium")
    yield _task(family, "two-figures", "two figures in one cell come back as two PNGs",
                [Code(plt + "plt.figure(); plt.plot([1, 2])\nplt.figure(); plt.plot([2, 1])\nNone",
                      (png, CodeText(matches=r"^$")), timeout=90)], severity="medium")
    yield _task(family, "savefig-file", "plt.savefig writes a real PNG that a command can inspect",
                [Code(plt + "plt.plot([1, 2, 3])\nplt.savefig('/workspace/chart.png', dpi=50)\nplt.close('all')",
                      (), timeout=90),
                 _py("d = open('/workspace/chart.png', 'rb').read()\n"
                     "import struct\nprint(d[:8] == b'\\x89PNG\\r\\n\\x1a\\n', struct.unpack('>II', d[16:24]))",
                     (_out("True (320, 240)\n"),))], severity="medium")
    yield _task(family, "agg-script", "a script renders a chart with the Agg backend and no display",
                [_py("import matplotlib\nmatplotlib.use('Agg')\nimport matplotlib.pyplot as plt\n"
                     "plt.bar(['a', 'b'], [1, 2])\nplt.savefig('/workspace/bar.png')\n"
                     "print(open('/workspace/bar.png', 'rb').read(4))", (_out("b'\\x89PNG'\n"),))],
                severity="medium")
