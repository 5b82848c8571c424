"""db easy tiers: generated DBBench-format tasks over small tables, for a policy too small for DBBench itself.

Two tiers, each with a train and a held-out split (`easy-train`/`easy-dev`: one table;
`two-table-train`/`two-table-dev`: two tables joined by a key), drawn from
`EnvSettings.db_tier_seed` and the split and index alone, so a task is the same in every process.
Each task is one of four kinds: read one value (SELECT), COUNT rows with a WHERE, INSERT one row,
UPDATE one cell. Tables have 3 to 5 rows and short column names, so a query and its result stay a
few dozen tokens.

Tasks are written in DBBench's own sample format (description, add_description, table, type,
label, sql, answer_md5) and graded by db.py unchanged. The `answer_md5` of an INSERT/UPDATE task is
the table hash after running its label statement on a fresh SQLite database of the task (the hash
is computed over the rows' text, so MySQL computes the same one from the same all-TEXT table);
every SELECT-style label is its reference query's result. Every task changes the table or has a
non-empty answer, so the no-op (commit nothing, change nothing) never passes.
"""

from __future__ import annotations

import random
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from env_workers.envs import db, db_grading
from env_workers.envs.base import EnvSettings

PEOPLE = ("Ann", "Bob", "Cid", "Dan", "Eve", "Fay", "Gus", "Hal", "Ivy", "Jon", "Kim", "Lea", "Max", "Ned")
CITIES = ("Oslo", "Rome", "Lima", "Bern", "Riga", "Doha", "Baku", "Kyiv")


@dataclass(frozen=True)
class Column:
    """A column and where its values come from: names (`key`: unique per table) or numbers in [low, high]."""

    name: str
    values: tuple[str, ...] = ()
    numbers: tuple[int, int] | None = None
    key: bool = False

    def draw(self, rng: random.Random) -> str:
        return str(rng.randint(*self.numbers)) if self.numbers else rng.choice(self.values)


@dataclass(frozen=True)
class Theme:
    """A table: its name and columns, the first being its key."""

    table: str
    columns: tuple[Column, ...]


THEMES = (
    Theme("pets", (Column("pet", ("Rex", "Tom", "Bo", "Kit", "Max", "Sam", "Zed", "Pip", "Ace", "Jax"), key=True),
                   Column("kind", ("cat", "dog", "bird", "fish")), Column("age", numbers=(1, 15)),
                   Column("owner", PEOPLE))),
    Theme("books", (Column("title", ("Dune", "Emma", "Ulysses", "Walden", "Beloved", "Hamlet", "Ivanhoe", "Heidi"),
                           key=True),
                    Column("genre", ("drama", "novel", "poetry")), Column("year", numbers=(1950, 2020)),
                    Column("pages", numbers=(100, 900)))),
    Theme("staff", (Column("name", PEOPLE, key=True), Column("dept", ("sales", "hr", "it", "ops")),
                    Column("salary", numbers=(30, 90)), Column("city", CITIES))),
    Theme("cars", (Column("model", ("Golf", "Polo", "Civic", "Corsa", "Clio", "Yaris", "Fiesta", "Astra"), key=True),
                   Column("color", ("red", "blue", "black", "white")), Column("year", numbers=(2000, 2024)),
                   Column("price", numbers=(5, 60)))),
    Theme("fruit", (Column("item", ("apple", "pear", "plum", "kiwi", "lime", "fig", "mango", "peach"), key=True),
                    Column("shop", ("north", "south", "east")), Column("qty", numbers=(1, 50)),
                    Column("price", numbers=(1, 20)))),
)

# (left table, its column naming a row of the right table, right table): the two-table tier's schemas.
PAIRS = (
    (Theme("pets", (Column("pet", THEMES[0].columns[0].values, key=True), THEMES[0].columns[1])), "owner",
     Theme("people", (Column("name", PEOPLE, key=True), Column("city", CITIES), Column("age", numbers=(18, 80))))),
    (Theme("books", (Column("title", THEMES[1].columns[0].values, key=True), THEMES[1].columns[1])), "author",
     Theme("authors", (Column("name", PEOPLE, key=True), Column("country", ("UK", "US", "FR", "DE")),
                       Column("born", numbers=(1900, 1990))))),
    (Theme("staff", (Column("name", PEOPLE, key=True), Column("salary", numbers=(30, 90)))), "dept",
     Theme("depts", (Column("dept", ("sales", "hr", "it", "ops", "legal", "admin"), key=True),
                     Column("floor", numbers=(1, 9)), Column("boss", PEOPLE)))),
)

TIERS = {"easy": 1, "two-table": 2}  # tier -> tables per task
KINDS = ("select", "count", "insert", "update")


def _q(name: str) -> str:
    return db_grading.quote_identifier(name)


def _lit(value: str) -> str:
    return "'" + value.replace("'", "''") + "'"


@dataclass(frozen=True)
class Table:
    name: str
    columns: tuple[str, ...]
    rows: tuple[tuple[str, ...], ...]

    def info(self) -> dict[str, Any]:
        return {"table_name": self.name, "table_info": {"columns": [{"name": c, "type": "TEXT"} for c in self.columns],
                                                        "rows": [list(r) for r in self.rows]}}

    def column(self, name: str) -> list[str]:
        return [row[self.columns.index(name)] for row in self.rows]


def draw_table(rng: random.Random, theme: Theme, rows: int, width: int,
               fixed: Mapping[str, Sequence[str]] | None = None) -> Table:
    """`rows` rows of the key and `width - 1` other columns of the theme (in theme order); `fixed` gives a
    column's candidate values (the left table's reference to the right table's keys)."""
    key, *others = theme.columns
    chosen = [key, *sorted(rng.sample(others, width - 1), key=others.index)]
    keys = rng.sample(key.values, rows)
    body = [[k] + [rng.choice(fixed[c.name]) if fixed and c.name in fixed else c.draw(rng) for c in chosen[1:]]
            for k in keys]
    return Table(theme.table, tuple(c.name for c in chosen), tuple(tuple(r) for r in body))


def _fresh_key(rng: random.Random, column: Column, taken: Sequence[str]) -> str:
    return rng.choice([v for v in column.values if v not in taken])


def _new_value(rng: random.Random, column: Column, old: str) -> str:
    while (value := column.draw(rng)) == old:
        pass
    return value


def single_table_task(rng: random.Random, kind: str) -> tuple[list[Table], dict[str, Any]]:
    """One table and a task of `kind` on it: (tables, {description, sql, type})."""
    theme = rng.choice(THEMES)
    table = draw_table(rng, theme, rng.randint(3, 5), rng.randint(3, 4))
    by_name = {c.name: c for c in theme.columns}
    key, other = table.columns[0], rng.choice(table.columns[1:])
    row = rng.randrange(len(table.rows))
    value, where = table.rows[row][table.columns.index(other)], table.rows[row][0]
    t = _q(table.name)
    if kind == "select":
        return [table], {"description": f"What is the {other} of the {table.name} row whose {key} is {where}?",
                         "sql": f"SELECT {_q(other)} FROM {t} WHERE {_q(key)} = {_lit(where)}", "type": "other"}
    if kind == "count":
        return [table], {"description": f"How many rows of {table.name} have {other} {value}?",
                         "sql": f"SELECT COUNT(*) FROM {t} WHERE {_q(other)} = {_lit(value)}", "type": "counting"}
    if kind == "insert":
        new = [_fresh_key(rng, by_name[key], table.column(key))] + [by_name[c].draw(rng) for c in table.columns[1:]]
        values = ", ".join(_lit(v) for v in new)
        return [table], {"description": f"Add ({values}) to the {table.name} table.",
                         "sql": f"INSERT INTO {t} ({', '.join(_q(c) for c in table.columns)}) VALUES ({values})",
                         "type": "INSERT"}
    new_value = _new_value(rng, by_name[other], value)
    return [table], {"description": f"In {table.name}, set the {other} of {where} to {new_value}.",
                     "sql": f"UPDATE {t} SET {_q(other)} = {_lit(new_value)} WHERE {_q(key)} = {_lit(where)}",
                     "type": "UPDATE"}


def two_table_task(rng: random.Random, kind: str) -> tuple[list[Table], dict[str, Any]]:
    """A left table whose `fk` column names rows of a right table, and a task of `kind` across both."""
    left_theme, fk, right_theme = rng.choice(PAIRS)
    right = draw_table(rng, right_theme, 3, 3)
    left = draw_table(rng, Theme(left_theme.table, (*left_theme.columns, Column(fk))), rng.randint(3, 5), 3,
                      fixed={fk: right.column(right.columns[0])})
    lkey, rkey = left.columns[0], right.columns[0]
    rcol = rng.choice(right.columns[1:])
    l, r = _q(left.name), _q(right.name)
    join = f"{l} JOIN {r} ON {l}.{_q(fk)} = {r}.{_q(rkey)}"
    row = rng.choice(left.rows)
    target = right.rows[right.column(rkey).index(row[left.columns.index(fk)])]
    value = target[right.columns.index(rcol)]
    if kind == "select":
        return [left, right], {"description": f"What is the {rcol} of the {fk} of {left.name} {row[0]}?",
                               "sql": f"SELECT {r}.{_q(rcol)} FROM {join} WHERE {l}.{_q(lkey)} = {_lit(row[0])}",
                               "type": "other"}
    if kind == "count":
        return [left, right], {"description": f"How many {left.name} have a {fk} whose {rcol} is {value}?",
                               "sql": f"SELECT COUNT(*) FROM {join} WHERE {r}.{_q(rcol)} = {_lit(value)}",
                               "type": "counting"}
    if kind == "insert":
        # The new row's reference is found through a value that names one right row only.
        unique = [i for i, v in enumerate(right.column(rcol)) if right.column(rcol).count(v) == 1]
        chosen = right.rows[rng.choice(unique)] if unique else target
        by_col = chosen[right.columns.index(rcol)] if unique else chosen[0]
        find = rcol if unique else rkey
        new_key = _fresh_key(rng, left_theme.columns[0], left.column(lkey))
        middle = left_theme.columns[1].draw(rng)
        return [left, right], {
            "description": f"Add {left.name} {new_key} with {left.columns[1]} {middle}, whose {fk} is the "
                           f"{right.name} row with {find} {by_col}.",
            "sql": f"INSERT INTO {l} ({', '.join(_q(c) for c in left.columns)}) SELECT {_lit(new_key)}, "
                   f"{_lit(middle)}, {_q(rkey)} FROM {r} WHERE {_q(find)} = {_lit(by_col)}",
            "type": "INSERT"}
    new_value = _new_value(rng, next(c for c in right_theme.columns if c.name == rcol), value)
    return [left, right], {
        "description": f"Set the {rcol} of the {fk} of {left.name} {row[0]} to {new_value}.",
        "sql": f"UPDATE {r} SET {_q(rcol)} = {_lit(new_value)} WHERE {_q(rkey)} = "
               f"(SELECT {_q(fk)} FROM {l} WHERE {_q(lkey)} = {_lit(row[0])})",
        "type": "UPDATE"}


def _describe(tables: Sequence[Table]) -> str:
    if len(tables) == 1:
        t = tables[0]
        return f"The name of this table is {t.name}, and the headers of this table are {','.join(t.columns)}."
    left, right = tables
    return (f"The tables are {left.name} ({','.join(left.columns)}) and {right.name} ({','.join(right.columns)}); "
            f"{left.name}.{left.columns[-1]} is a {right.name}.{right.columns[0]}.")


def make_task(split: str, index: int, seed: int) -> dict[str, Any]:
    """The task at (seed, split, index) in DBBench's sample format; the split's tier decides the tables."""
    tier = split.rsplit("-", 1)[0]
    rng = random.Random(f"db-tier/{seed}/{split}/{index}")
    kind = KINDS[index % len(KINDS)]  # the four kinds in equal shares
    tables, spec = (single_table_task if TIERS[tier] == 1 else two_table_task)(rng, kind)
    task: dict[str, Any] = {
        "id": f"{split}-{index}", "description": spec["description"], "add_description": _describe(tables),
        "table": tables[0].info() if len(tables) == 1 else [t.info() for t in tables],
        "type": [spec["type"]], "source": f"generated:{seed}",
    }
    if spec["type"] in db_grading.MODIFICATION_TYPES:
        task["label"] = [spec["sql"]]
        task["answer_md5"] = _expected_hash(task)
    else:
        task["sql"] = {"query": spec["sql"]}
        task["label"] = _reference_result(task)
    return task


def _reference_result(task: Mapping[str, Any]) -> list[str]:
    connection = db.create_database(task)
    try:
        return db.result_values(db.execute(connection, task["sql"]["query"], timeout_s=60.0))
    finally:
        connection.close()


def _expected_hash(task: Mapping[str, Any]) -> str:
    """The tables' hash after the label statement, in the form DBBench stores it ("[('<md5>',)]" for one table)."""
    connection = db.create_database(task)
    try:
        result = db.execute(connection, task["label"][0], timeout_s=60.0)
        if result != "[]":
            raise ValueError(f"generated statement failed: {task['label'][0]!r}: {result}")
        value = db.tables_hash(connection, task)
    finally:
        connection.close()
    return f"[('{value}',)]" if isinstance(task["table"], dict) else str(value)


def split_names() -> tuple[str, ...]:
    return tuple(f"{tier}-{part}" for tier in TIERS for part in ("train", "dev"))


def generate(split: str, settings: EnvSettings) -> list[dict[str, Any]]:
    """A tier split's tasks; a held-out (`-dev`) split skips any task whose prompt and tables its train split has."""
    tier, part = split.rsplit("-", 1)
    seed = settings.db_tier_seed
    if part == "train":
        return [make_task(split, index, seed) for index in range(settings.db_tier_train_tasks)]
    seen = {_signature(t) for t in generate(f"{tier}-train", settings)}
    tasks: list[dict[str, Any]] = []
    index = 0
    while len(tasks) < settings.db_tier_dev_tasks:
        candidate = make_task(split, index, seed)
        if _signature(candidate) not in seen:
            tasks.append(candidate)
        index += 1
    return tasks


def _signature(task: Mapping[str, Any]) -> str:
    return repr((task["description"], task["table"]))
