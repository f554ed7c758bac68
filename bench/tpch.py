"""TPC-H for Tandem benchmarks and tests: schemas, a data generator, the 22 queries, and
changes to lineitem.

    from bench import tpch
    tables = tpch.generate(0.01)                      # {"lineitem": pyarrow.Table, ...}
    tpch.load(client, tables)                         # sources named like the tables
    client.create_dataflow("prod", "q1", tpch.QUERIES["q1"], index_key=())
    change = tpch.lineitem_change(tables, 1000, seed=1)
    client.append("lineitem", change)                 # half retractions, half inserts
    expected = tpch.apply_change(tables, change)      # the tables after it, to check

    python bench/tpch.py --sf 0.1                     # generation time and row counts
    python bench/tpch.py --check --sf 0.01            # the 22 queries in local Spark
    python bench/tpch.py --check-change --sf 0.01     # q1 and q6 follow a change
    python bench/tpch.py --plans 3 --sf 0.001         # each query's delta plan: time, round trips

Rules:
- Deterministic: `generate(sf, seed)` gives byte-identical tables for the same
  arguments; every table draws from its own `random.Random` stream. No numpy: random
  integers come from `Random.randbytes` viewed as an Arrow uint32 array and scaled with
  pyarrow.compute, so generation is vectorised except for p_name and the text pool.
- Spec-faithful (TPC-H 3.0, clause 4.2.3) wherever a query's answer depends on it:
  cardinalities, key ranges (sparse order keys, customers with key divisible by 3 have
  no orders, the partsupp/lineitem supplier formula), the date rules (order dates up to
  ENDDATE - 151 days, ship/commit/receipt offsets, returnflag and linestatus around
  CURRENTDATE 1995-06-17, orderstatus and totalprice from the lines), every enumerated
  value (nation and region names, segments, priorities, ship modes and instructions,
  types, containers, brands, sizes, the 92 p_name colours), phone country codes
  (nationkey + 10), the retail price formula, and comments cut from a pool built with
  dbgen's grammar and word weights (LIKE '%special%requests%' matches about 1% of the
  order comments).
- Simplified: the text pool is 1 MiB, not 300 MB; v-strings (addresses) are cut from a
  pool of random characters, not drawn character by character; 'Customer ...
  Complaints' and '... Recommends' go into SF * 5 supplier comments each (the spec's
  count) but at least one each, so Q16's NOT IN excludes something at small scale
  factors; the partsupp supplier formula falls back to a step of 1 for the parts where
  it would repeat a supplier (possible only with at most 228 suppliers); money columns
  hold exact cents (DECIMAL(15,2)) and o_totalprice truncates per line as dbgen does.
  Random draws are uniform, as the spec asks, but not dbgen's streams: the answers are
  not the spec's reference answers.
- QUERIES hold the spec's text with its validation parameters, in Spark SQL: Spark's
  interval and `extract`/`substring` forms, Q15's view as a CTE, the spec's ORDER BY
  and row limits. They name the tables without a prefix.
- `lineitem_change` retracts existing rows exactly and inserts rows made by the same
  rules as `generate` for existing orders, parts and suppliers; orders are left as
  they are, so an order's o_totalprice and o_orderstatus may no longer match its lines.
"""

from __future__ import annotations

import argparse
import bisect
import datetime as dt
import decimal
import functools
import random
import re
import sys
import tempfile
import time
from collections import Counter
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.compute as pc

from storage import parse_schema

TABLES = ("region", "nation", "supplier", "customer", "part", "partsupp", "orders", "lineitem")

# Clause 1.4.1, as dbgen's dss.ddl declares them: every column NOT NULL but the region
# and nation comments. Identifiers are BIGINT, other integers INT, money and quantities
# DECIMAL(15,2), and CHAR/VARCHAR are STRING.
SCHEMAS: dict[str, str] = {
    "region": "r_regionkey BIGINT NOT NULL, r_name STRING NOT NULL, r_comment STRING",
    "nation": (
        "n_nationkey BIGINT NOT NULL, n_name STRING NOT NULL, n_regionkey BIGINT NOT NULL, "
        "n_comment STRING"
    ),
    "supplier": (
        "s_suppkey BIGINT NOT NULL, s_name STRING NOT NULL, s_address STRING NOT NULL, "
        "s_nationkey BIGINT NOT NULL, s_phone STRING NOT NULL, "
        "s_acctbal DECIMAL(15,2) NOT NULL, s_comment STRING NOT NULL"
    ),
    "customer": (
        "c_custkey BIGINT NOT NULL, c_name STRING NOT NULL, c_address STRING NOT NULL, "
        "c_nationkey BIGINT NOT NULL, c_phone STRING NOT NULL, "
        "c_acctbal DECIMAL(15,2) NOT NULL, c_mktsegment STRING NOT NULL, "
        "c_comment STRING NOT NULL"
    ),
    "part": (
        "p_partkey BIGINT NOT NULL, p_name STRING NOT NULL, p_mfgr STRING NOT NULL, "
        "p_brand STRING NOT NULL, p_type STRING NOT NULL, p_size INT NOT NULL, "
        "p_container STRING NOT NULL, p_retailprice DECIMAL(15,2) NOT NULL, "
        "p_comment STRING NOT NULL"
    ),
    "partsupp": (
        "ps_partkey BIGINT NOT NULL, ps_suppkey BIGINT NOT NULL, ps_availqty INT NOT NULL, "
        "ps_supplycost DECIMAL(15,2) NOT NULL, ps_comment STRING NOT NULL"
    ),
    "orders": (
        "o_orderkey BIGINT NOT NULL, o_custkey BIGINT NOT NULL, "
        "o_orderstatus STRING NOT NULL, o_totalprice DECIMAL(15,2) NOT NULL, "
        "o_orderdate DATE NOT NULL, o_orderpriority STRING NOT NULL, "
        "o_clerk STRING NOT NULL, o_shippriority INT NOT NULL, o_comment STRING NOT NULL"
    ),
    "lineitem": (
        "l_orderkey BIGINT NOT NULL, l_partkey BIGINT NOT NULL, l_suppkey BIGINT NOT NULL, "
        "l_linenumber INT NOT NULL, l_quantity DECIMAL(15,2) NOT NULL, "
        "l_extendedprice DECIMAL(15,2) NOT NULL, l_discount DECIMAL(15,2) NOT NULL, "
        "l_tax DECIMAL(15,2) NOT NULL, l_returnflag STRING NOT NULL, "
        "l_linestatus STRING NOT NULL, l_shipdate DATE NOT NULL, "
        "l_commitdate DATE NOT NULL, l_receiptdate DATE NOT NULL, "
        "l_shipinstruct STRING NOT NULL, l_shipmode STRING NOT NULL, "
        "l_comment STRING NOT NULL"
    ),
}

# The Arrow schemas storage derives from SCHEMAS: generated tables have exactly these.
ARROW_SCHEMAS: dict[str, pa.Schema] = {name: parse_schema(ddl) for name, ddl in SCHEMAS.items()}

DIFF = "_diff"

# --- Queries ---------------------------------------------------------------------------

# Clause 2.4 with the validation parameters of clause 2.4.x.3, one query per entry.
QUERIES: dict[str, str] = {
    "q1": """
select
    l_returnflag,
    l_linestatus,
    sum(l_quantity) as sum_qty,
    sum(l_extendedprice) as sum_base_price,
    sum(l_extendedprice * (1 - l_discount)) as sum_disc_price,
    sum(l_extendedprice * (1 - l_discount) * (1 + l_tax)) as sum_charge,
    avg(l_quantity) as avg_qty,
    avg(l_extendedprice) as avg_price,
    avg(l_discount) as avg_disc,
    count(*) as count_order
from
    lineitem
where
    l_shipdate <= date '1998-12-01' - interval '90' day
group by
    l_returnflag,
    l_linestatus
order by
    l_returnflag,
    l_linestatus
""",
    "q2": """
select
    s_acctbal,
    s_name,
    n_name,
    p_partkey,
    p_mfgr,
    s_address,
    s_phone,
    s_comment
from
    part,
    supplier,
    partsupp,
    nation,
    region
where
    p_partkey = ps_partkey
    and s_suppkey = ps_suppkey
    and p_size = 15
    and p_type like '%BRASS'
    and s_nationkey = n_nationkey
    and n_regionkey = r_regionkey
    and r_name = 'EUROPE'
    and ps_supplycost = (
        select
            min(ps_supplycost)
        from
            partsupp,
            supplier,
            nation,
            region
        where
            p_partkey = ps_partkey
            and s_suppkey = ps_suppkey
            and s_nationkey = n_nationkey
            and n_regionkey = r_regionkey
            and r_name = 'EUROPE'
    )
order by
    s_acctbal desc,
    n_name,
    s_name,
    p_partkey
limit 100
""",
    "q3": """
select
    l_orderkey,
    sum(l_extendedprice * (1 - l_discount)) as revenue,
    o_orderdate,
    o_shippriority
from
    customer,
    orders,
    lineitem
where
    c_mktsegment = 'BUILDING'
    and c_custkey = o_custkey
    and l_orderkey = o_orderkey
    and o_orderdate < date '1995-03-15'
    and l_shipdate > date '1995-03-15'
group by
    l_orderkey,
    o_orderdate,
    o_shippriority
order by
    revenue desc,
    o_orderdate
limit 10
""",
    "q4": """
select
    o_orderpriority,
    count(*) as order_count
from
    orders
where
    o_orderdate >= date '1993-07-01'
    and o_orderdate < date '1993-07-01' + interval '3' month
    and exists (
        select
            *
        from
            lineitem
        where
            l_orderkey = o_orderkey
            and l_commitdate < l_receiptdate
    )
group by
    o_orderpriority
order by
    o_orderpriority
""",
    "q5": """
select
    n_name,
    sum(l_extendedprice * (1 - l_discount)) as revenue
from
    customer,
    orders,
    lineitem,
    supplier,
    nation,
    region
where
    c_custkey = o_custkey
    and l_orderkey = o_orderkey
    and l_suppkey = s_suppkey
    and c_nationkey = s_nationkey
    and s_nationkey = n_nationkey
    and n_regionkey = r_regionkey
    and r_name = 'ASIA'
    and o_orderdate >= date '1994-01-01'
    and o_orderdate < date '1994-01-01' + interval '1' year
group by
    n_name
order by
    revenue desc
""",
    "q6": """
select
    sum(l_extendedprice * l_discount) as revenue
from
    lineitem
where
    l_shipdate >= date '1994-01-01'
    and l_shipdate < date '1994-01-01' + interval '1' year
    and l_discount between 0.06 - 0.01 and 0.06 + 0.01
    and l_quantity < 24
""",
    "q7": """
select
    supp_nation,
    cust_nation,
    l_year,
    sum(volume) as revenue
from
    (
        select
            n1.n_name as supp_nation,
            n2.n_name as cust_nation,
            extract(year from l_shipdate) as l_year,
            l_extendedprice * (1 - l_discount) as volume
        from
            supplier,
            lineitem,
            orders,
            customer,
            nation n1,
            nation n2
        where
            s_suppkey = l_suppkey
            and o_orderkey = l_orderkey
            and c_custkey = o_custkey
            and s_nationkey = n1.n_nationkey
            and c_nationkey = n2.n_nationkey
            and (
                (n1.n_name = 'FRANCE' and n2.n_name = 'GERMANY')
                or (n1.n_name = 'GERMANY' and n2.n_name = 'FRANCE')
            )
            and l_shipdate between date '1995-01-01' and date '1996-12-31'
    ) as shipping
group by
    supp_nation,
    cust_nation,
    l_year
order by
    supp_nation,
    cust_nation,
    l_year
""",
    "q8": """
select
    o_year,
    sum(case
        when nation = 'BRAZIL' then volume
        else 0
    end) / sum(volume) as mkt_share
from
    (
        select
            extract(year from o_orderdate) as o_year,
            l_extendedprice * (1 - l_discount) as volume,
            n2.n_name as nation
        from
            part,
            supplier,
            lineitem,
            orders,
            customer,
            nation n1,
            nation n2,
            region
        where
            p_partkey = l_partkey
            and s_suppkey = l_suppkey
            and l_orderkey = o_orderkey
            and o_custkey = c_custkey
            and c_nationkey = n1.n_nationkey
            and n1.n_regionkey = r_regionkey
            and r_name = 'AMERICA'
            and s_nationkey = n2.n_nationkey
            and o_orderdate between date '1995-01-01' and date '1996-12-31'
            and p_type = 'ECONOMY ANODIZED STEEL'
    ) as all_nations
group by
    o_year
order by
    o_year
""",
    "q9": """
select
    nation,
    o_year,
    sum(amount) as sum_profit
from
    (
        select
            n_name as nation,
            extract(year from o_orderdate) as o_year,
            l_extendedprice * (1 - l_discount) - ps_supplycost * l_quantity as amount
        from
            part,
            supplier,
            lineitem,
            partsupp,
            orders,
            nation
        where
            s_suppkey = l_suppkey
            and ps_suppkey = l_suppkey
            and ps_partkey = l_partkey
            and p_partkey = l_partkey
            and o_orderkey = l_orderkey
            and s_nationkey = n_nationkey
            and p_name like '%green%'
    ) as profit
group by
    nation,
    o_year
order by
    nation,
    o_year desc
""",
    "q10": """
select
    c_custkey,
    c_name,
    sum(l_extendedprice * (1 - l_discount)) as revenue,
    c_acctbal,
    n_name,
    c_address,
    c_phone,
    c_comment
from
    customer,
    orders,
    lineitem,
    nation
where
    c_custkey = o_custkey
    and l_orderkey = o_orderkey
    and o_orderdate >= date '1993-10-01'
    and o_orderdate < date '1993-10-01' + interval '3' month
    and l_returnflag = 'R'
    and c_nationkey = n_nationkey
group by
    c_custkey,
    c_name,
    c_acctbal,
    c_phone,
    n_name,
    c_address,
    c_comment
order by
    revenue desc
limit 20
""",
    "q11": """
select
    ps_partkey,
    sum(ps_supplycost * ps_availqty) as value
from
    partsupp,
    supplier,
    nation
where
    ps_suppkey = s_suppkey
    and s_nationkey = n_nationkey
    and n_name = 'GERMANY'
group by
    ps_partkey having
        sum(ps_supplycost * ps_availqty) > (
            select
                sum(ps_supplycost * ps_availqty) * 0.0001
            from
                partsupp,
                supplier,
                nation
            where
                ps_suppkey = s_suppkey
                and s_nationkey = n_nationkey
                and n_name = 'GERMANY'
        )
order by
    value desc
""",
    "q12": """
select
    l_shipmode,
    sum(case
        when o_orderpriority = '1-URGENT'
            or o_orderpriority = '2-HIGH'
            then 1
        else 0
    end) as high_line_count,
    sum(case
        when o_orderpriority <> '1-URGENT'
            and o_orderpriority <> '2-HIGH'
            then 1
        else 0
    end) as low_line_count
from
    orders,
    lineitem
where
    o_orderkey = l_orderkey
    and l_shipmode in ('MAIL', 'SHIP')
    and l_commitdate < l_receiptdate
    and l_shipdate < l_commitdate
    and l_receiptdate >= date '1994-01-01'
    and l_receiptdate < date '1994-01-01' + interval '1' year
group by
    l_shipmode
order by
    l_shipmode
""",
    "q13": """
select
    c_count,
    count(*) as custdist
from
    (
        select
            c_custkey,
            count(o_orderkey)
        from
            customer left outer join orders on
                c_custkey = o_custkey
                and o_comment not like '%special%requests%'
        group by
            c_custkey
    ) as c_orders (c_custkey, c_count)
group by
    c_count
order by
    custdist desc,
    c_count desc
""",
    "q14": """
select
    100.00 * sum(case
        when p_type like 'PROMO%'
            then l_extendedprice * (1 - l_discount)
        else 0
    end) / sum(l_extendedprice * (1 - l_discount)) as promo_revenue
from
    lineitem,
    part
where
    l_partkey = p_partkey
    and l_shipdate >= date '1995-09-01'
    and l_shipdate < date '1995-09-01' + interval '1' month
""",
    "q15": """
with revenue0 (supplier_no, total_revenue) as (
    select
        l_suppkey,
        sum(l_extendedprice * (1 - l_discount))
    from
        lineitem
    where
        l_shipdate >= date '1996-01-01'
        and l_shipdate < date '1996-01-01' + interval '3' month
    group by
        l_suppkey
)
select
    s_suppkey,
    s_name,
    s_address,
    s_phone,
    total_revenue
from
    supplier,
    revenue0
where
    s_suppkey = supplier_no
    and total_revenue = (
        select
            max(total_revenue)
        from
            revenue0
    )
order by
    s_suppkey
""",
    "q16": """
select
    p_brand,
    p_type,
    p_size,
    count(distinct ps_suppkey) as supplier_cnt
from
    partsupp,
    part
where
    p_partkey = ps_partkey
    and p_brand <> 'Brand#45'
    and p_type not like 'MEDIUM POLISHED%'
    and p_size in (49, 14, 23, 45, 19, 3, 36, 9)
    and ps_suppkey not in (
        select
            s_suppkey
        from
            supplier
        where
            s_comment like '%Customer%Complaints%'
    )
group by
    p_brand,
    p_type,
    p_size
order by
    supplier_cnt desc,
    p_brand,
    p_type,
    p_size
""",
    "q17": """
select
    sum(l_extendedprice) / 7.0 as avg_yearly
from
    lineitem,
    part
where
    p_partkey = l_partkey
    and p_brand = 'Brand#23'
    and p_container = 'MED BOX'
    and l_quantity < (
        select
            0.2 * avg(l_quantity)
        from
            lineitem
        where
            l_partkey = p_partkey
    )
""",
    "q18": """
select
    c_name,
    c_custkey,
    o_orderkey,
    o_orderdate,
    o_totalprice,
    sum(l_quantity)
from
    customer,
    orders,
    lineitem
where
    o_orderkey in (
        select
            l_orderkey
        from
            lineitem
        group by
            l_orderkey having
                sum(l_quantity) > 300
    )
    and c_custkey = o_custkey
    and o_orderkey = l_orderkey
group by
    c_name,
    c_custkey,
    o_orderkey,
    o_orderdate,
    o_totalprice
order by
    o_totalprice desc,
    o_orderdate
limit 100
""",
    "q19": """
select
    sum(l_extendedprice* (1 - l_discount)) as revenue
from
    lineitem,
    part
where
    (
        p_partkey = l_partkey
        and p_brand = 'Brand#12'
        and p_container in ('SM CASE', 'SM BOX', 'SM PACK', 'SM PKG')
        and l_quantity >= 1 and l_quantity <= 1 + 10
        and p_size between 1 and 5
        and l_shipmode in ('AIR', 'AIR REG')
        and l_shipinstruct = 'DELIVER IN PERSON'
    )
    or
    (
        p_partkey = l_partkey
        and p_brand = 'Brand#23'
        and p_container in ('MED BAG', 'MED BOX', 'MED PKG', 'MED PACK')
        and l_quantity >= 10 and l_quantity <= 10 + 10
        and p_size between 1 and 10
        and l_shipmode in ('AIR', 'AIR REG')
        and l_shipinstruct = 'DELIVER IN PERSON'
    )
    or
    (
        p_partkey = l_partkey
        and p_brand = 'Brand#34'
        and p_container in ('LG CASE', 'LG BOX', 'LG PACK', 'LG PKG')
        and l_quantity >= 20 and l_quantity <= 20 + 10
        and p_size between 1 and 15
        and l_shipmode in ('AIR', 'AIR REG')
        and l_shipinstruct = 'DELIVER IN PERSON'
    )
""",
    "q20": """
select
    s_name,
    s_address
from
    supplier,
    nation
where
    s_suppkey in (
        select
            ps_suppkey
        from
            partsupp
        where
            ps_partkey in (
                select
                    p_partkey
                from
                    part
                where
                    p_name like 'forest%'
            )
            and ps_availqty > (
                select
                    0.5 * sum(l_quantity)
                from
                    lineitem
                where
                    l_partkey = ps_partkey
                    and l_suppkey = ps_suppkey
                    and l_shipdate >= date '1994-01-01'
                    and l_shipdate < date '1994-01-01' + interval '1' year
            )
    )
    and s_nationkey = n_nationkey
    and n_name = 'CANADA'
order by
    s_name
""",
    "q21": """
select
    s_name,
    count(*) as numwait
from
    supplier,
    lineitem l1,
    orders,
    nation
where
    s_suppkey = l1.l_suppkey
    and o_orderkey = l1.l_orderkey
    and o_orderstatus = 'F'
    and l1.l_receiptdate > l1.l_commitdate
    and exists (
        select
            *
        from
            lineitem l2
        where
            l2.l_orderkey = l1.l_orderkey
            and l2.l_suppkey <> l1.l_suppkey
    )
    and not exists (
        select
            *
        from
            lineitem l3
        where
            l3.l_orderkey = l1.l_orderkey
            and l3.l_suppkey <> l1.l_suppkey
            and l3.l_receiptdate > l3.l_commitdate
    )
    and s_nationkey = n_nationkey
    and n_name = 'SAUDI ARABIA'
group by
    s_name
order by
    numwait desc,
    s_name
limit 100
""",
    "q22": """
select
    cntrycode,
    count(*) as numcust,
    sum(c_acctbal) as totacctbal
from
    (
        select
            substring(c_phone from 1 for 2) as cntrycode,
            c_acctbal
        from
            customer
        where
            substring(c_phone from 1 for 2) in
                ('13', '31', '23', '29', '30', '18', '17')
            and c_acctbal > (
                select
                    avg(c_acctbal)
                from
                    customer
                where
                    c_acctbal > 0.00
                    and substring(c_phone from 1 for 2) in
                        ('13', '31', '23', '29', '30', '18', '17')
            )
            and not exists (
                select
                    *
                from
                    orders
                where
                    o_custkey = c_custkey
            )
    ) as custsale
group by
    cntrycode
order by
    cntrycode
""",
}

# --- The spec's value lists (clause 4.2.2.13, 4.2.3; dbgen's dists.dss) -----------------

REGIONS = ("AFRICA", "AMERICA", "ASIA", "EUROPE", "MIDDLE EAST")
# (name, regionkey); the nationkey is the position.
NATIONS = (
    ("ALGERIA", 0), ("ARGENTINA", 1), ("BRAZIL", 1), ("CANADA", 1), ("EGYPT", 4),
    ("ETHIOPIA", 0), ("FRANCE", 3), ("GERMANY", 3), ("INDIA", 2), ("INDONESIA", 2),
    ("IRAN", 4), ("IRAQ", 4), ("JAPAN", 2), ("JORDAN", 4), ("KENYA", 0),
    ("MOROCCO", 0), ("MOZAMBIQUE", 0), ("PERU", 1), ("CHINA", 2), ("ROMANIA", 3),
    ("SAUDI ARABIA", 4), ("VIETNAM", 2), ("RUSSIA", 3), ("UNITED KINGDOM", 3),
    ("UNITED STATES", 1),
)  # fmt: skip
SEGMENTS = ("AUTOMOBILE", "BUILDING", "FURNITURE", "MACHINERY", "HOUSEHOLD")
PRIORITIES = ("1-URGENT", "2-HIGH", "3-MEDIUM", "4-NOT SPECIFIED", "5-LOW")
SHIP_INSTRUCTIONS = ("DELIVER IN PERSON", "COLLECT COD", "NONE", "TAKE BACK RETURN")
SHIP_MODES = ("REG AIR", "AIR", "RAIL", "SHIP", "TRUCK", "MAIL", "FOB")
TYPES = tuple(
    f"{a} {b} {c}"
    for a in ("STANDARD", "SMALL", "MEDIUM", "LARGE", "ECONOMY", "PROMO")
    for b in ("ANODIZED", "BURNISHED", "PLATED", "POLISHED", "BRUSHED")
    for c in ("TIN", "NICKEL", "BRASS", "STEEL", "COPPER")
)
CONTAINERS = tuple(
    f"{a} {b}"
    for a in ("SM", "LG", "MED", "JUMBO", "WRAP")
    for b in ("CASE", "BOX", "BAG", "JAR", "PKG", "PACK", "CAN", "DRUM")
)
COLORS = (
    "almond antique aquamarine azure beige bisque black blanched blue blush brown burlywood "
    "burnished chartreuse chiffon chocolate coral cornflower cornsilk cream cyan dark deep dim "
    "dodger drab firebrick floral forest frosted gainsboro ghost goldenrod green grey honeydew "
    "hot indian ivory khaki lace lavender lawn lemon light lime linen magenta maroon medium "
    "metallic midnight mint misty moccasin navajo navy olive orange orchid pale papaya peach "
    "peru pink plum powder puff purple red rose rosy royal saddle salmon sandy seashell sienna "
    "sky slate smoke snow spring steel tan thistle tomato turquoise violet wheat white yellow"
).split()

# The pseudo-text grammar (clause 4.2.2.14) with dbgen's weights: word -> weight.
_WORDS: dict[str, dict[str, int]] = {
    "N": {
        "packages": 40, "requests": 40, "accounts": 40, "deposits": 40, "foxes": 20,
        "ideas": 20, "theodolites": 20, "pinto beans": 20, "instructions": 20,
        "dependencies": 10, "excuses": 10, "platelets": 10, "asymptotes": 10, "courts": 5,
        "dolphins": 5, "multipliers": 1, "sauternes": 1, "warthogs": 1, "frets": 1,
        "dinos": 1, "attainments": 1, "somas": 1, "Tiresias": 1, "patterns": 1,
        "forges": 1, "braids": 1, "frays": 1, "warhorses": 1, "dugouts": 1, "notornis": 1,
        "epitaphs": 1, "pearls": 1, "tithes": 1, "waters": 1, "orbits": 1, "gifts": 1,
        "sheaves": 1, "depths": 1, "sentiments": 1, "decoys": 1, "realms": 1, "pains": 1,
        "grouches": 1, "escapades": 1, "hockey players": 1,
    },
    "V": {
        "sleep": 20, "wake": 20, "are": 20, "cajole": 20, "haggle": 20, "nag": 10,
        "use": 10, "boost": 10, "affix": 5, "detect": 5, "integrate": 5, "maintain": 1,
        "nod": 1, "was": 1, "lose": 1, "sublate": 1, "solve": 1, "thrash": 1,
        "promise": 1, "engage": 1, "hinder": 1, "print": 1, "x-ray": 1, "breach": 1,
        "eat": 1, "grow": 1, "impress": 1, "mold": 1, "poach": 1, "serve": 1, "run": 1,
        "dazzle": 1, "snooze": 1, "doze": 1, "unwind": 1, "kindle": 1, "play": 1,
        "hang": 1, "believe": 1, "doubt": 1,
    },
    "J": {
        "special": 20, "pending": 20, "unusual": 20, "express": 20, "furious": 1, "sly": 1,
        "careful": 1, "blithe": 1, "quick": 1, "fluffy": 1, "slow": 1, "quiet": 1,
        "ruthless": 1, "thin": 1, "close": 1, "dogged": 1, "daring": 1, "brave": 1,
        "stealthy": 1, "permanent": 1, "enticing": 1, "idle": 1, "busy": 1, "regular": 50,
        "final": 40, "ironic": 40, "even": 30, "bold": 20, "silent": 10,
    },
    "D": {
        "sometimes": 1, "always": 1, "never": 1, "furiously": 50, "slyly": 50,
        "carefully": 50, "blithely": 40, "quickly": 30, "fluffily": 20, "slowly": 1,
        "quietly": 1, "ruthlessly": 1, "thinly": 1, "closely": 1, "doggedly": 1,
        "daringly": 1, "bravely": 1, "stealthily": 1, "permanently": 1, "enticingly": 1,
        "idly": 1, "busily": 1, "regularly": 1, "finally": 1, "ironically": 1, "evenly": 1,
        "boldly": 1, "silently": 1,
    },
    "P": {
        "about": 50, "above": 50, "according to": 50, "across": 50, "after": 50,
        "against": 40, "along": 40, "alongside of": 30, "among": 30, "around": 20, "at": 10,
        "atop": 1, "before": 1, "behind": 1, "beneath": 1, "beside": 1, "besides": 1,
        "between": 1, "beyond": 1, "by": 1, "despite": 1, "during": 1, "except": 1,
        "for": 1, "from": 1, "in place of": 1, "inside": 1, "instead of": 1, "into": 1,
        "near": 1, "of": 1, "on": 1, "outside": 1, "over": 1, "past": 1, "since": 1,
        "through": 1, "throughout": 1, "to": 1, "toward": 1, "under": 1, "until": 1,
        "up": 1, "upon": 1, "without": 1, "with": 1, "within": 1,
    },
    "X": {
        "do": 1, "may": 1, "might": 1, "shall": 1, "will": 1, "would": 1, "can": 1,
        "could": 1, "should": 1, "ought to": 1, "must": 1, "will have to": 1,
        "shall have to": 1, "could have to": 1, "should have to": 1, "must have to": 1,
        "need to": 1, "try to": 1,
    },
    "T": {".": 50, ";": 1, ":": 1, "?": 1, "!": 1, "--": 1},
    # Sentence forms: noun phrase N, verb phrase V, prepositional phrase P, terminator T.
    "sentence": {"N V T": 3, "N V P T": 3, "N V N T": 3, "N P V N T": 1, "N P V P T": 1},
    "noun_phrase": {"N": 10, "J N": 20, "J, J N": 10, "D J N": 50},
    "verb_phrase": {"V": 30, "X V": 1, "V D": 40, "X V D": 1},
}  # fmt: skip

_TEXT_POOL_BYTES = 1 << 20
_CHAR_POOL_BYTES = 1 << 16
# The v-string alphabet: 64 characters, so a random byte modulo 64 picks one evenly.
_ALPHABET = "0123456789abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ, "


def _day(date: dt.date) -> int:
    return (date - dt.date(1970, 1, 1)).days


# Clause 4.2.3: STARTDATE, CURRENTDATE, ENDDATE as days since 1970-01-01 (date32).
START_DATE = _day(dt.date(1992, 1, 1))
CURRENT_DATE = _day(dt.date(1995, 6, 17))
END_DATE = _day(dt.date(1998, 12, 31))


# --- Vectorised random draws -------------------------------------------------------------


@functools.lru_cache(maxsize=4)
def _text_pool(seed: int) -> pa.Array:
    """The pseudo-text every comment is cut from (clause 4.2.2.14), as uint8 bytes."""
    rng = random.Random(f"tpch:{seed}:text")
    words = {kind: (list(ws), list(_cumulative(ws.values()))) for kind, ws in _WORDS.items()}

    def pick(kind: str) -> str:
        population, cum_weights = words[kind]
        return population[bisect.bisect_right(cum_weights, rng.random() * cum_weights[-1])]

    def phrase(kind: str) -> str:
        # "J, J N" -> "even, final deposits"
        return re.sub(r"[NVJDX]", lambda m: pick(m.group()), pick(kind))

    sentences, size = [], 0
    while size < _TEXT_POOL_BYTES:
        parts: list[str] = []
        for symbol in pick("sentence").split():
            if symbol == "N":
                parts.append(phrase("noun_phrase"))
            elif symbol == "V":
                parts.append(phrase("verb_phrase"))
            elif symbol == "P":
                parts.append(f"{pick('P')} the {phrase('noun_phrase')}")
            else:
                parts[-1] += pick("T")
        sentences.append(" ".join(parts))
        size += len(sentences[-1]) + 1
    return _bytes_array(" ".join(sentences).encode()[:_TEXT_POOL_BYTES])


@functools.lru_cache(maxsize=4)
def _char_pool(seed: int) -> pa.Array:
    """Random characters of the v-string alphabet, as uint8 bytes."""
    table = bytes(ord(_ALPHABET[b % len(_ALPHABET)]) for b in range(256))
    raw = random.Random(f"tpch:{seed}:chars").randbytes(_CHAR_POOL_BYTES)
    return _bytes_array(raw.translate(table))


def _cumulative(weights: Any) -> list[int]:
    total, out = 0, []
    for weight in weights:
        total += weight
        out.append(total)
    return out


def _bytes_array(data: bytes) -> pa.Array:
    return pa.Array.from_buffers(pa.uint8(), len(data), [None, pa.py_buffer(data)])


class _Draws:
    """Uniform draws from one named stream of a seed: whole columns at a time."""

    def __init__(self, seed: int, stream: str) -> None:
        self.seed = seed
        self.rng = random.Random(f"tpch:{seed}:{stream}")

    def ints(self, n: int, low: int, high: int) -> pa.Array:
        """n int64s uniform in [low, high]: 32 random bits each, scaled by multiply and
        shift (Lemire's method without the rejection step: a value's probability is off
        by at most (high - low + 1) / 2**32 of itself, negligible here)."""
        raw = pa.Array.from_buffers(pa.uint32(), n, [None, pa.py_buffer(self.rng.randbytes(4 * n))])
        span = pa.scalar(high - low + 1, pa.uint64())
        product = pc.multiply(raw.cast(pa.uint64()), span)
        scaled = pc.shift_right(product, pa.scalar(32, pa.uint64()))
        return pc.add(scaled.cast(pa.int64()), low)

    def pick(self, n: int, values: Sequence[str]) -> pa.Array:
        return pc.take(pa.array(values, pa.string()), self.ints(n, 0, len(values) - 1))

    def text(self, n: int, low: int, high: int) -> pa.Array:
        """Clause 4.2.2.10 text [low, high]: a random-length cut at a random offset of
        the text pool."""
        return self._cuts(_text_pool(self.seed), n, low, high)

    def vstring(self, n: int, low: int, high: int) -> pa.Array:
        """Clause 4.2.2.7 v-string [low, high]: random characters, random length."""
        return self._cuts(_char_pool(self.seed), n, low, high)

    def _cuts(self, pool: pa.Array, n: int, low: int, high: int) -> pa.Array:
        lengths = self.ints(n, low, high).cast(pa.int32())
        starts = self.ints(n, 0, len(pool) - high).cast(pa.int32())
        # A list view may point anywhere in the pool; flattening it lays the cuts out
        # one after another, which with their running lengths is a string array. (When
        # the cuts happen to be contiguous, e.g. just one, the flattening is a zero-copy
        # slice of the pool: hence the offset.)
        data = pc.list_flatten(pa.ListViewArray.from_arrays(starts, lengths, pool))
        offsets = pa.concat_arrays([pa.array([0], pa.int32()), pc.cumulative_sum(lengths)])
        return pa.Array.from_buffers(
            pa.string(), n, [None, offsets.buffers()[1], data.buffers()[1].slice(data.offset)]
        )


def _arange(n: int, start: int = 0) -> pa.Array:
    """start, start + 1, ..., as int64: a running count, faster than a Python range."""
    return pc.cumulative_sum(pa.repeat(pa.scalar(1, pa.int64()), n), start=start - 1)


def _money(cents: pa.Array) -> pa.Array:
    """DECIMAL(15,2) from int64 cents (the cast to precision 15 checks the range)."""
    return cents.cast(pa.decimal128(19, 0)).cast(pa.decimal128(15, 0)).view(pa.decimal128(15, 2))


def _cents(money: pa.Array) -> pa.Array:
    return money.view(pa.decimal128(15, 0)).cast(pa.int64())


def _dates(days: pa.Array) -> pa.Array:
    return days.cast(pa.int32()).cast(pa.date32())


def _keyed(prefix: str, keys: pa.Array) -> pa.Array:
    """'Supplier#000000042': the prefix and the key on 9 digits."""
    return pc.binary_join_element_wise(prefix, pc.utf8_lpad(keys.cast(pa.string()), 9, "0"), "")


def _phones(draws: _Draws, nationkeys: pa.Array) -> pa.Array:
    """Clause 4.2.2.9: country code (nationkey + 10), then 3, 3 and 4 random digits."""
    n = len(nationkeys)
    return pc.binary_join_element_wise(
        pc.add(nationkeys, 10).cast(pa.string()),
        draws.ints(n, 100, 999).cast(pa.string()),
        draws.ints(n, 100, 999).cast(pa.string()),
        draws.ints(n, 1000, 9999).cast(pa.string()),
        "-",
    )


def _table(name: str, columns: Mapping[str, pa.Array]) -> pa.Table:
    schema = ARROW_SCHEMAS[name]
    return pa.Table.from_arrays([columns[field.name] for field in schema], schema=schema)


# --- Generation --------------------------------------------------------------------------


def _counts(scale_factor: float) -> dict[str, int]:
    counts = {
        "supplier": round(10_000 * scale_factor),
        "customer": round(150_000 * scale_factor),
        "part": round(200_000 * scale_factor),
        "orders": round(1_500_000 * scale_factor),
        "clerks": max(1, round(1_000 * scale_factor)),
    }
    # Every part has 4 distinct suppliers.
    if counts["supplier"] < 4:
        raise ValueError(f"scale factor {scale_factor} is too small: it needs 4 suppliers")
    return counts


def _part_suppliers(partkeys: pa.Array, which: pa.Array, suppliers: int) -> pa.Array:
    """The supplier `which` (0..3) of each part, clause 4.2.3:
    (partkey + which * (S/4 + (partkey - 1)/S)) mod S + 1, integer divisions.
    Where that would give a part one supplier twice (step, 2 * step or 3 * step is a
    multiple of S, which happens only with at most 228 suppliers, e.g. SF 0.001 or
    0.012, never at SF 0.01), the step is 1 instead."""
    step = pc.add(suppliers // 4, pc.divide(pc.subtract(partkeys, 1), suppliers))
    repeats = pc.or_(
        pc.equal(pc.remainder(step, suppliers), 0),
        pc.or_(
            pc.equal(pc.remainder(pc.multiply(step, 2), suppliers), 0),
            pc.equal(pc.remainder(pc.multiply(step, 3), suppliers), 0),
        ),
    )
    step = pc.if_else(repeats, 1, step)
    return pc.add(pc.remainder(pc.add(partkeys, pc.multiply(which, step)), suppliers), 1)


def _retail_cents(partkeys: pa.Array) -> pa.Array:
    """Clause 4.2.3: 90000 + ((partkey / 10) mod 20001) + 100 * (partkey mod 1000), in
    cents."""
    return pc.add(
        pc.add(90_000, pc.remainder(pc.divide(partkeys, 10), 20_001)),
        pc.multiply(100, pc.remainder(partkeys, 1000)),
    )


def _region(seed: int) -> pa.Table:
    draws = _Draws(seed, "region")
    return _table("region", {
        "r_regionkey": _arange(len(REGIONS)),
        "r_name": pa.array(REGIONS),
        "r_comment": draws.text(len(REGIONS), 31, 115),
    })  # fmt: skip


def _nation(seed: int) -> pa.Table:
    draws = _Draws(seed, "nation")
    return _table("nation", {
        "n_nationkey": _arange(len(NATIONS)),
        "n_name": pa.array([name for name, _ in NATIONS]),
        "n_regionkey": pa.array([region for _, region in NATIONS], pa.int64()),
        "n_comment": draws.text(len(NATIONS), 31, 114),
    })  # fmt: skip


def _supplier(seed: int, count: int) -> pa.Table:
    draws = _Draws(seed, "supplier")
    keys = _arange(count, 1)
    nations = draws.ints(count, 0, len(NATIONS) - 1)
    columns = {
        "s_suppkey": keys,
        "s_name": _keyed("Supplier#", keys),
        "s_address": draws.vstring(count, 10, 40),
        "s_nationkey": nations,
        "s_phone": _phones(draws, nations),
        "s_acctbal": _money(draws.ints(count, -99_999, 999_999)),
        "s_comment": draws.text(count, 25, 100),
    }
    columns["s_comment"] = _better_business_bureau(draws, columns["s_comment"])
    return _table("supplier", columns)


def _better_business_bureau(draws: _Draws, comments: pa.Array) -> pa.Array:
    """Clause 4.2.3: SF * 5 comments get 'Customer<noise>Complaints' and as many
    'Customer<noise>Recommends', overwritten at a random place; at least one each, so
    that Q16 excludes someone at any scale factor."""
    per_kind = max(1, round(len(comments) / 2_000))
    chosen = draws.rng.sample(range(len(comments)), 2 * per_kind)
    texts = comments.to_pylist()
    for number, row in enumerate(chosen):
        text, tail = texts[row], "Complaints" if number < per_kind else "Recommends"
        noise = draws.rng.randint(0, len(text) - 19)
        at = draws.rng.randint(0, len(text) - 19 - noise)
        middle = text[at + 9 : at + 9 + noise]
        texts[row] = text[:at] + "Customer " + middle + tail + text[at + 19 + noise :]
    return pa.array(texts, pa.string())


def _customer(seed: int, count: int) -> pa.Table:
    draws = _Draws(seed, "customer")
    keys = _arange(count, 1)
    nations = draws.ints(count, 0, len(NATIONS) - 1)
    return _table("customer", {
        "c_custkey": keys,
        "c_name": _keyed("Customer#", keys),
        "c_address": draws.vstring(count, 10, 40),
        "c_nationkey": nations,
        "c_phone": _phones(draws, nations),
        "c_acctbal": _money(draws.ints(count, -99_999, 999_999)),
        "c_mktsegment": draws.pick(count, SEGMENTS),
        "c_comment": draws.text(count, 29, 116),
    })  # fmt: skip


def _part(seed: int, count: int) -> pa.Table:
    draws = _Draws(seed, "part")
    keys = _arange(count, 1)
    # Five distinct colours: the one column drawn row by row in Python.
    names = pa.array([" ".join(draws.rng.sample(COLORS, 5)) for _ in range(count)], pa.string())
    manufacturers = draws.ints(count, 1, 5).cast(pa.string())
    return _table("part", {
        "p_partkey": keys,
        "p_name": names,
        "p_mfgr": pc.binary_join_element_wise("Manufacturer#", manufacturers, ""),
        "p_brand": pc.binary_join_element_wise(
            "Brand#", manufacturers, draws.ints(count, 1, 5).cast(pa.string()), ""
        ),
        "p_type": draws.pick(count, TYPES),
        "p_size": draws.ints(count, 1, 50).cast(pa.int32()),
        "p_container": draws.pick(count, CONTAINERS),
        "p_retailprice": _money(_retail_cents(keys)),
        "p_comment": draws.text(count, 5, 22),
    })  # fmt: skip


def _partsupp(seed: int, parts: int, suppliers: int) -> pa.Table:
    draws = _Draws(seed, "partsupp")
    count = 4 * parts
    rows = _arange(count)
    partkeys = pc.add(pc.divide(rows, 4), 1)
    return _table("partsupp", {
        "ps_partkey": partkeys,
        "ps_suppkey": _part_suppliers(partkeys, pc.bit_wise_and(rows, 3), suppliers),
        "ps_availqty": draws.ints(count, 1, 9_999).cast(pa.int32()),
        "ps_supplycost": _money(draws.ints(count, 100, 100_000)),
        "ps_comment": draws.text(count, 49, 198),
    })  # fmt: skip


def _lineitem_columns(
    draws: _Draws,
    orderkeys: pa.Array,
    orderdates: pa.Array,
    linenumbers: pa.Array,
    parts: int,
    suppliers: int,
) -> dict[str, pa.Array]:
    """Lines of the given orders (keys, order dates as days) by clause 4.2.3's rules."""
    n = len(orderkeys)
    partkeys = draws.ints(n, 1, parts)
    quantities = draws.ints(n, 1, 50)
    shipdates = pc.add(orderdates, draws.ints(n, 1, 121))
    commitdates = pc.add(orderdates, draws.ints(n, 30, 90))
    receiptdates = pc.add(shipdates, draws.ints(n, 1, 30))
    returned = pc.less_equal(receiptdates, CURRENT_DATE)
    return {
        "l_orderkey": orderkeys,
        "l_partkey": partkeys,
        "l_suppkey": _part_suppliers(partkeys, draws.ints(n, 0, 3), suppliers),
        "l_linenumber": linenumbers.cast(pa.int32()),
        "l_quantity": _money(pc.multiply(quantities, 100)),
        "l_extendedprice": _money(pc.multiply(quantities, _retail_cents(partkeys))),
        "l_discount": _money(draws.ints(n, 0, 10)),
        "l_tax": _money(draws.ints(n, 0, 8)),
        # R or A once received by CURRENTDATE, else N; O while not shipped by then, else F.
        "l_returnflag": pc.if_else(returned, draws.pick(n, ("R", "A")), "N"),
        "l_linestatus": pc.if_else(pc.greater(shipdates, CURRENT_DATE), "O", "F"),
        "l_shipdate": _dates(shipdates),
        "l_commitdate": _dates(commitdates),
        "l_receiptdate": _dates(receiptdates),
        "l_shipinstruct": draws.pick(n, SHIP_INSTRUCTIONS),
        "l_shipmode": draws.pick(n, SHIP_MODES),
        "l_comment": draws.text(n, 10, 43),
    }


def _orders_and_lineitem(seed: int, counts: Mapping[str, int]) -> tuple[pa.Table, pa.Table]:
    draws = _Draws(seed, "orders")
    n = counts["orders"]
    rows = _arange(n)
    # Sparse keys: the first 8 of every 32.
    orderkeys = pc.add(pc.add(pc.multiply(pc.divide(rows, 8), 32), pc.bit_wise_and(rows, 7)), 1)
    # Customers whose key is divisible by 3 place no orders: draw among the others,
    # the j-th of which is 3 * (j div 2) + (j mod 2) + 1.
    customers = counts["customer"]
    j = draws.ints(n, 0, customers - customers // 3 - 1)
    custkeys = pc.add(pc.add(pc.multiply(pc.divide(j, 2), 3), pc.bit_wise_and(j, 1)), 1)
    orderdates = draws.ints(n, START_DATE, END_DATE - 151)
    priorities = draws.pick(n, PRIORITIES)
    clerks = _keyed("Clerk#", draws.ints(n, 1, counts["clerks"]))
    comments = draws.text(n, 19, 78)

    # 1 to 7 lines per order, laid out order after order.
    lines = draws.ints(n, 1, 7)
    offsets = pa.concat_arrays([pa.array([0], pa.int64()), pc.cumulative_sum(lines)])
    total = offsets[-1].as_py()
    order_of_line = pc.list_parent_indices(
        pa.LargeListArray.from_arrays(offsets, pa.nulls(total, pa.int8()))
    )
    linenumbers = pc.add(pc.subtract(_arange(total), pc.take(offsets, order_of_line)), 1)
    line_columns = _lineitem_columns(
        _Draws(seed, "lineitem"),
        pc.take(orderkeys, order_of_line),
        pc.take(orderdates, order_of_line),
        linenumbers,
        counts["part"],
        counts["supplier"],
    )

    def per_order(values: pa.Array) -> pa.Array:
        """Sums of a per-line int64 over each order's lines (they are contiguous)."""
        running = pa.concat_arrays([pa.array([0], pa.int64()), pc.cumulative_sum(values)])
        return pc.subtract(pc.take(running, offsets[1:]), pc.take(running, offsets[:-1]))

    # o_totalprice: sum of extendedprice * (1 - discount) * (1 + tax), truncated to
    # cents after each factor as dbgen does.
    charge = pc.divide(
        pc.multiply(
            pc.divide(
                pc.multiply(
                    _cents(line_columns["l_extendedprice"]),
                    pc.subtract(100, _cents(line_columns["l_discount"])),
                ),
                100,
            ),
            pc.add(100, _cents(line_columns["l_tax"])),
        ),
        100,
    )
    # o_orderstatus: F if every line is F, O if every line is O, else P.
    finished = per_order(pc.equal(line_columns["l_linestatus"], "F").cast(pa.int64()))
    status = pc.case_when(
        pc.make_struct(pc.equal(finished, lines), pc.equal(finished, 0)),
        "F",
        "O",
        "P",
    )
    orders = _table("orders", {
        "o_orderkey": orderkeys,
        "o_custkey": custkeys,
        "o_orderstatus": status,
        "o_totalprice": _money(per_order(charge)),
        "o_orderdate": _dates(orderdates),
        "o_orderpriority": priorities,
        "o_clerk": clerks,
        "o_shippriority": pa.repeat(pa.scalar(0, pa.int32()), n),
        "o_comment": comments,
    })  # fmt: skip
    return orders, _table("lineitem", line_columns)


def generate(scale_factor: float, seed: int = 0) -> dict[str, pa.Table]:
    """The 8 TPC-H tables at `scale_factor`, deterministic in `seed` (module docstring).
    SF 1 is 6 million lineitems; any scale factor with at least 4 suppliers (SF >=
    0.0004) works."""
    counts = _counts(scale_factor)
    orders, lineitem = _orders_and_lineitem(seed, counts)
    return {
        "region": _region(seed),
        "nation": _nation(seed),
        "supplier": _supplier(seed, counts["supplier"]),
        "customer": _customer(seed, counts["customer"]),
        "part": _part(seed, counts["part"]),
        "partsupp": _partsupp(seed, counts["part"], counts["supplier"]),
        "orders": orders,
        "lineitem": lineitem,
    }


# --- Changes -----------------------------------------------------------------------------


def lineitem_change(tables: Mapping[str, pa.Table], n: int, seed: int) -> pa.Table:
    """A change of `n` rows to lineitem, with a `_diff` column: n // 2 retractions of
    distinct existing rows (their exact values, `_diff` -1), then inserts (`_diff` +1) of
    lines made by `generate`'s rules for random existing orders, with parts and
    suppliers that exist in partsupp, and line numbers after the order's last one.
    Deterministic in (tables, n, seed)."""
    lineitem, orders = tables["lineitem"], tables["orders"]
    draws = _Draws(seed, "change")
    retract = min(n // 2, lineitem.num_rows)
    retractions = lineitem.take(sorted(draws.rng.sample(range(lineitem.num_rows), retract)))

    insert = n - retract
    chosen = draws.ints(insert, 0, orders.num_rows - 1)
    orderkeys = pc.take(orders["o_orderkey"], chosen).combine_chunks()
    orderdates = pc.take(orders["o_orderdate"], chosen).combine_chunks()
    # New line numbers continue after each order's highest, also across inserts into
    # the same order, so (l_orderkey, l_linenumber) stays a key.
    lines_of_chosen = lineitem.filter(pc.is_in(lineitem["l_orderkey"], orderkeys))
    maxima = lines_of_chosen.group_by("l_orderkey").aggregate([("l_linenumber", "max")])
    last = dict(zip(maxima["l_orderkey"].to_pylist(), maxima["l_linenumber_max"].to_pylist()))
    added: Counter[int] = Counter()
    linenumbers = []
    for key in orderkeys.to_pylist():
        added[key] += 1
        linenumbers.append(last.get(key, 0) + added[key])
    inserts = _table("lineitem", _lineitem_columns(
        draws,
        orderkeys,
        orderdates.cast(pa.int32()).cast(pa.int64()),
        pa.array(linenumbers, pa.int64()),
        tables["part"].num_rows,
        tables["supplier"].num_rows,
    ))  # fmt: skip
    return pa.concat_tables([_with_diff(retractions, -1), _with_diff(inserts, 1)])


def _with_diff(table: pa.Table, diff: int) -> pa.Table:
    return table.append_column(
        pa.field(DIFF, pa.int64(), nullable=False),
        pa.repeat(pa.scalar(diff, pa.int64()), table.num_rows),
    )


def apply_change(tables: Mapping[str, pa.Table], change: pa.Table) -> dict[str, pa.Table]:
    """The tables after `change` (a lineitem change with `_diff` +1 or -1): lineitem
    without the retracted rows, the inserted ones appended; the other tables as they
    are. ValueError if a retraction does not match an existing row exactly, or a
    `_diff` is neither +1 nor -1."""
    lineitem = tables["lineitem"]
    diffs = change[DIFF]
    if not pc.all(pc.is_in(diffs, pa.array([-1, 1], pa.int64()))).as_py():
        raise ValueError("a lineitem change's _diff must be +1 or -1")
    retracted = change.filter(pc.equal(diffs, -1)).drop_columns([DIFF])
    inserted = change.filter(pc.equal(diffs, 1)).drop_columns([DIFF])
    numbered = lineitem.append_column("_row", _arange(lineitem.num_rows))
    hits = numbered.join(retracted, keys=lineitem.column_names, join_type="left semi")["_row"]
    if len(hits) != retracted.num_rows:
        raise ValueError(
            f"{retracted.num_rows} retractions match {len(hits)} lineitem rows; each must "
            f"match exactly one"
        )
    kept = lineitem.filter(pc.invert(pc.is_in(numbered["_row"], hits)))
    return {**tables, "lineitem": pa.concat_tables([kept, inserted.cast(lineitem.schema)])}


# --- Loading into Tandem -----------------------------------------------------------------


def load(
    client: Any, tables: Mapping[str, pa.Table], *, prefix: str = "", batch_rows: int = 100_000
) -> dict[str, int]:
    """Create a source `prefix + table` for each TPC-H table and append its rows through
    `client` (a `controller.client.Client`), `batch_rows` per append. Returns each
    source's last append timestamp. QUERIES name the unprefixed tables."""
    timestamps = {}
    for name in TABLES:
        source = prefix + name
        client.create_source(source, SCHEMAS[name])
        for batch in tables[name].to_batches(max_chunksize=batch_rows):
            timestamps[source] = client.append(source, pa.Table.from_batches([batch]))
    return timestamps


# --- Self-checks -------------------------------------------------------------------------

_CHECK_CHANGE_ROWS = 1000


def _spark_session(work_dir: Path) -> Any:
    from replica_service._spark import SparkSettings, start_session

    conf = {
        "spark.sql.ansi.enabled": "true",
        "spark.sql.session.timeZone": "UTC",
        # Small data on 2 cores: a few shuffle partitions, not 200.
        "spark.sql.shuffle.partitions": "4",
    }
    session = start_session(SparkSettings("local[2]", "2g", conf), work_dir)
    # Caching the tables warns of large tasks (they carry the rows): not news here.
    session.sparkContext.setLogLevel("ERROR")
    return session


def _register(session: Any, tables: Mapping[str, pa.Table]) -> None:
    for name, table in tables.items():
        frame = session.createDataFrame(table).cache()
        frame.count()
        frame.createOrReplaceTempView(name)


def _run(session: Any, name: str) -> tuple[pa.Table, float]:
    started = time.perf_counter()
    result = session.sql(QUERIES[name]).toArrow()
    return result, time.perf_counter() - started


def _timed_generate(scale_factor: float, seed: int) -> dict[str, pa.Table]:
    started = time.perf_counter()
    tables = generate(scale_factor, seed)
    elapsed = time.perf_counter() - started
    sizes = ", ".join(f"{name} {table.num_rows:,}" for name, table in tables.items())
    print(f"generated SF {scale_factor:g} (seed {seed}) in {elapsed:.2f} s: {sizes}")
    return tables


def _check_queries(tables: Mapping[str, pa.Table], session: Any) -> int:
    """Run the 22 queries; 1 if any fails, else 0."""
    _register(session, tables)
    failures, empty = 0, []
    for name in QUERIES:
        try:
            result, elapsed = _run(session, name)
        except Exception as error:  # report every query, then fail
            failures += 1
            print(f"{name:>4}: FAILED {str(error).splitlines()[0]}")
            continue
        # An aggregate over no rows (Q17, Q19) is one row of NULLs: as empty as no rows.
        if all(column.null_count == result.num_rows for column in result.columns):
            empty.append(name)
        first = str(result.slice(0, 1).to_pylist()[0]) if result.num_rows else ""
        print(f"{name:>4}: {result.num_rows:5d} rows in {elapsed:6.2f} s  {first[:90]}")
    print(
        f"{len(QUERIES) - failures} of {len(QUERIES)} queries ran; empty (no rows, or only "
        f"NULLs): {', '.join(empty) or 'none'}"
    )
    return 1 if failures else 0


def _check_change(tables: Mapping[str, pa.Table], session: Any, seed: int) -> int:
    """Apply a change and compare q1's and q6's answers before and after with the
    deltas computed from the change rows alone; 1 on a mismatch."""
    change = lineitem_change(tables, _CHECK_CHANGE_ROWS, seed)
    after = apply_change(tables, change)
    print(
        f"change: {change.num_rows} rows, {pc.sum(pc.equal(change[DIFF], -1)).as_py()} "
        f"retractions; lineitem {tables['lineitem'].num_rows:,} -> {after['lineitem'].num_rows:,}"
    )
    _register(session, {"lineitem": tables["lineitem"]})
    q1_before, q6_before = _run(session, "q1")[0], _run(session, "q6")[0]
    _register(session, {"lineitem": after["lineitem"]})
    q1_after, q6_after = _run(session, "q1")[0], _run(session, "q6")[0]

    # The expected deltas, by the queries' predicates over the change rows in Python.
    rows = change.to_pylist()
    q1_cutoff = dt.date(1998, 12, 1) - dt.timedelta(days=90)
    expected_q1: dict[tuple[str, str], list] = {}
    for row in rows:
        if row["l_shipdate"] <= q1_cutoff:
            delta = expected_q1.setdefault((row["l_returnflag"], row["l_linestatus"]), [0, 0])
            delta[0] += row["l_quantity"] * row[DIFF]
            delta[1] += row[DIFF]
    expected_q6 = sum(
        (
            row["l_extendedprice"] * row["l_discount"] * row[DIFF]
            for row in rows
            if dt.date(1994, 1, 1) <= row["l_shipdate"] < dt.date(1995, 1, 1)
            and decimal.Decimal("0.05") <= row["l_discount"] <= decimal.Decimal("0.07")
            and row["l_quantity"] < 24
        ),
        decimal.Decimal(0),
    )

    def by_group(result: pa.Table) -> dict[tuple[str, str], tuple[Any, int]]:
        return {
            (r["l_returnflag"], r["l_linestatus"]): (r["sum_qty"], r["count_order"])
            for r in result.to_pylist()
        }

    before, after_groups = by_group(q1_before), by_group(q1_after)
    mismatches = 0
    print(
        "q1 group: sum_qty before -> after (delta, expected), "
        "count_order before -> after (delta, expected)"
    )
    for group in sorted(before.keys() | after_groups.keys()):
        qty0, n0 = before.get(group, (0, 0))
        qty1, n1 = after_groups.get(group, (0, 0))
        want_qty, want_n = expected_q1.get(group, (0, 0))
        ok = qty1 - qty0 == want_qty and n1 - n0 == want_n
        mismatches += not ok
        print(
            f"  {'/'.join(group)}: {qty0} -> {qty1} ({qty1 - qty0:+}, {want_qty:+}), "
            f"{n0} -> {n1} ({n1 - n0:+}, {want_n:+}) {'ok' if ok else 'MISMATCH'}"
        )
    revenue0, revenue1 = q6_before["revenue"][0].as_py(), q6_after["revenue"][0].as_py()
    ok = revenue1 - revenue0 == expected_q6
    mismatches += not ok
    print(
        f"q6 revenue: {revenue0} -> {revenue1} ({revenue1 - revenue0:+}, expected "
        f"{expected_q6:+}) {'ok' if ok else 'MISMATCH'}"
    )
    return 1 if mismatches else 0


def _plan_times(tables: Mapping[str, pa.Table], session: Any, repeats: int) -> int:
    """Build each query's delta plan (what the controller's planner and every replica
    do when a dataflow is created) `repeats` times over empty views of the tables; print
    the median build time and the py4j round trips of one build."""
    from py4j.clientserver import ClientServerConnection

    from replica_service.dataplane import NotIncremental, delta_plan

    for name, table in tables.items():
        session.createDataFrame(table.slice(0, 0)).createOrReplaceTempView(name)
    round_trips = 0
    send = ClientServerConnection.send_command

    def counted(self: Any, command: str) -> Any:
        nonlocal round_trips
        round_trips += 1
        return send(self, command)

    ClientServerConnection.send_command = counted
    total = 0.0
    try:
        for name, sql in QUERIES.items():
            analyzed = session.sql(sql)._jdf.queryExecution().analyzed()
            times, strategy = [], "incremental"
            for _ in range(repeats):
                round_trips, started = 0, time.perf_counter()
                try:
                    delta_plan(session._jsparkSession, analyzed, {table: table for table in tables})
                except NotIncremental:
                    strategy = "recompute"
                times.append(time.perf_counter() - started)
            median = sorted(times)[len(times) // 2]
            total += median
            print(f"{name:>4}: {strategy:<11} {1000 * median:7.0f} ms  {round_trips:7,} round trips")
    finally:
        ClientServerConnection.send_command = send
    print(f"all 22: {total:.2f} s (medians of {repeats})")
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sf", type=float, default=0.01, help="scale factor (default 0.01)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--check", action="store_true", help="run the 22 queries in local Spark")
    parser.add_argument(
        "--check-change", action="store_true", help="check that q1 and q6 follow a lineitem change"
    )
    parser.add_argument(
        "--plans", type=int, metavar="N", default=0, help="time each query's delta plan, N builds each"
    )
    args = parser.parse_args(argv)
    tables = _timed_generate(args.sf, args.seed)
    if not (args.check or args.check_change or args.plans):
        return 0
    with tempfile.TemporaryDirectory(prefix="tpch-check-") as work_dir:
        session = _spark_session(Path(work_dir))
        try:
            status = _check_queries(tables, session) if args.check else 0
            if args.check_change:
                status |= _check_change(tables, session, args.seed + 1)
            if args.plans:
                status |= _plan_times(tables, session, args.plans)
        finally:
            session.stop()
    return status


if __name__ == "__main__":
    sys.exit(main())
