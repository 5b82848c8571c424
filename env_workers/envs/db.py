"""db: AgentBench's DBBench (src/server/tasks/dbbench/task.py) as function calls over SQLite or MySQL.

Each session gets a fresh database holding the task's table, created as AgentBench creates it on
MySQL: every column TEXT, every value inserted as `str(value)` (so a JSON null becomes the text
'None', as upstream). The database is in-memory SQLite by default (`EnvSettings.db_backend`), or
one database per session on a MySQL-compatible server (db_mysql.py). Tools `execute_sql(query)`
and `commit_final_answer(answers)`; 15 rounds. Query results are shown as upstream shows MySQL's:
`str(list of row tuples)`, cut at 800 characters. Grading is in db_grading.py.

The golden policy replays the task's own reference: the label SQL of an INSERT/UPDATE task, or the
reference query of a SELECT-style task, whose result rows it commits as the answer; so a golden
failure means SQLite and the upstream data disagree, not that our grader was given the label.
"""

from __future__ import annotations

import ast
import asyncio
import json
import sqlite3
import time
import unicodedata
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any, Protocol

from env_workers.envs import db_grading
from env_workers.envs.base import (
    ActionError,
    EnvSettings,
    Environment,
    Family,
    Opened,
    Outcome,
    Policy,
    Session,
    Status,
    ToolCall,
    assistant_call,
    scripted,
    tool,
)

SYSTEM_PROMPT = """I will ask you a question, then you should help me operate a MySQL database with SQL to answer the question.
You have to explain the problem and your solution to me and write down your thoughts.
After thinking and explaining thoroughly, every round you can choose to operate or to answer with the two specific tools provided.
If you should execute a SQL query, use the `execute_sql` function, Your SQL should be in one line.
Every time you can only execute one SQL statement. I will only execute the statement in the first SQL code block. Every time you write a SQL, I will execute it for you and give you the output.
If you are done operating, and you want to commit your final answer, then use the `commit_final_answer` function.
DO NOT use this tool unless you are sure about your answer. I expect an accurate and correct answer.
Your answer should be accurate. Your answer must be exactly the same as the correct answer.
If the question is about modifying the database, then after done operation, your answer field can be anything.
If your response cannot match any pattern I mentioned earlier, you will be judged as FAIL immediately.
You should always use the tools provided to submit your answer. Be careful not to write it in the content field.
Your input will be raw MySQL response, you have to deal with it by yourself."""  # AgentBench's, verbatim

TOOLS = [
    tool("execute_sql", "Execute one SQL statement and return its raw result.",
         {"query": {"type": "string", "description": "One SQL statement, on one line."}}),
    tool("commit_final_answer", "Commit the final answer; this ends the task.",
         {"answers": {"type": "array", "items": {"type": "string"},
                      "description": "The answer values (anything for a task that modifies the table)."}}),
]

RESULT_LIMIT = 800  # characters of a query result shown, then "[TRUNCATED]" (AgentBench)
TIMED_OUT = "Error: SQL execution timed out."  # AgentBench's text for its 60 s limit


def load(path: Path) -> list[dict[str, Any]]:
    """A DBBench JSONL file; each task's id is `<file stem>-<line index>`."""
    tasks = []
    for index, line in enumerate(path.read_text(encoding="utf-8").splitlines()):
        if line.strip():
            tasks.append({"id": f"{path.stem}-{index}", **json.loads(line)})
    return tasks


def is_modification(task: Mapping[str, Any]) -> bool:
    return task["type"][0] in db_grading.MODIFICATION_TYPES


def _tables(task: Mapping[str, Any]) -> list[Mapping[str, Any]]:
    table = task["table"]
    return table if isinstance(table, list) else [table]


def table_contents(task: Mapping[str, Any]) -> list[tuple[str, list[str], list[tuple[str, ...]]]]:
    """(table name, column names, rows) of each task table as AgentBench inserts them: every value `str(value)`."""
    return [
        (table["table_name"], [c["name"] for c in table["table_info"]["columns"]],
         [tuple(str(value) for value in row) for row in table["table_info"]["rows"]])
        for table in _tables(task)
    ]


def cut(text: str) -> str:
    """A result or error as AgentBench shows it: at most 800 characters, then "[TRUNCATED]"."""
    return text[:RESULT_LIMIT] + "[TRUNCATED]" if len(text) > RESULT_LIMIT else text


# MySQL reads these backslash escapes in string literals; SQLite reads none (\% and \_ stay for LIKE).
_MYSQL_ESCAPES = {"0": "\0", "b": "\b", "n": "\n", "r": "\r", "t": "\t", "Z": "\x1a", "%": "\\%", "_": "\\_"}


def mysql_literals(sql: str) -> str:
    """Rewrites MySQL string literals (backslash escapes, in '...' or "...") into SQLite's form.

    DBBench's statements are written for MySQL: 'Don\\'t' or '...%\\nWilliam' mean a quote and a
    newline there, and a syntax error or a literal backslash in SQLite.
    """
    out: list[str] = []
    i, n = 0, len(sql)
    while i < n:
        char = sql[i]
        if char == "`":  # identifiers are copied as they are
            end = sql.find("`", i + 1)
            end = n - 1 if end < 0 else end
            out.append(sql[i : end + 1])
            i = end + 1
            continue
        if char not in "'\"":
            out.append(char)
            i += 1
            continue
        quote, value, i = char, [], i + 1
        while i < n:
            c = sql[i]
            if c == "\\" and i + 1 < n:
                value.append(_MYSQL_ESCAPES.get(sql[i + 1], sql[i + 1]))
                i += 2
            elif c == quote and i + 1 < n and sql[i + 1] == quote:
                value.append(quote)
                i += 2
            elif c == quote:
                i += 1
                break
            else:
                value.append(c)
                i += 1
        text = "".join(value)
        out.append(quote + text.replace(quote, quote + quote) + quote)
    return "".join(out)


def _mysql_key(text: str) -> str:
    """utf8mb4_0900_ai_ci at primary strength, approximately: accents and case do not count."""
    decomposed = unicodedata.normalize("NFKD", text)
    return "".join(c for c in decomposed if not unicodedata.combining(c)).casefold()


def mysql_collation(a: str, b: str) -> int:
    ka, kb = _mysql_key(a), _mysql_key(b)
    return (ka > kb) - (ka < kb)


def create_database(task: Mapping[str, Any]) -> sqlite3.Connection:
    """A fresh in-memory database with the task's tables, all columns TEXT (as AgentBench's MySQL init).

    Columns compare with MySQL's default collation (case- and accent-insensitive), so that
    `WHERE Airport = 'Montreal-…'` finds 'Montréal-…' as it does on AgentBench's MySQL.
    """
    # Statements run in a worker thread (see DbEnvironment.call_tool), hence check_same_thread=False.
    connection = sqlite3.connect(":memory:", isolation_level=None, check_same_thread=False)
    connection.create_collation("mysql", mysql_collation)
    for table_name, column_names, rows in table_contents(task):
        name = db_grading.quote_identifier(table_name)
        columns = [db_grading.quote_identifier(c) for c in column_names]
        definitions = ", ".join(c + " TEXT COLLATE mysql" for c in columns)
        connection.execute(f"CREATE TABLE IF NOT EXISTS {name} ({definitions})")
        if rows:
            placeholders = ", ".join("?" * len(columns))
            connection.executemany(f"INSERT INTO {name} ({', '.join(columns)}) VALUES ({placeholders})", rows)
    return connection


def execute(connection: sqlite3.Connection, query: str, timeout_s: float) -> str:
    """Runs one statement; the result or the error text, as AgentBench shows them (cut at 800 characters)."""
    deadline = time.monotonic() + timeout_s
    # SQLite calls this every 10k VM steps; a non-zero return interrupts the statement (a runaway join).
    connection.set_progress_handler(lambda: int(time.monotonic() > deadline), 10_000)
    try:
        cursor = connection.execute(mysql_literals(query))
        text = str(cursor.fetchall()) if cursor.description is not None else "[]"
    except sqlite3.OperationalError as error:
        text = TIMED_OUT if str(error) == "interrupted" else str(error)
    except (sqlite3.Error, sqlite3.Warning, ValueError, OverflowError) as error:
        text = str(error)
    finally:
        connection.set_progress_handler(None, 0)
    return cut(text)


# (table name, column names) -> AgentBench's hash of that table on the session's database.
TableHash = Callable[[str, Sequence[str]], str | None]


def _sqlite_table_hash(connection: sqlite3.Connection) -> TableHash:
    def table_hash(table_name: str, columns: Sequence[str]) -> str | None:
        try:
            return db_grading.table_hash(connection, table_name, columns)
        except sqlite3.OperationalError as error:  # the policy dropped the table or a column: no match
            return str(error)

    return table_hash


def combined_hash(task: Mapping[str, Any], table_hash: TableHash) -> str | None:
    """AgentBench's calculate_tables_hash: per-table hashes, sorted and joined with '_'."""
    hashes = [table_hash(name, columns) for name, columns, _ in table_contents(task)]
    if len(hashes) == 1:
        return hashes[0]
    return "_".join(sorted(str(h) for h in hashes))


def tables_hash(connection: sqlite3.Connection, task: Mapping[str, Any]) -> str | None:
    return combined_hash(task, _sqlite_table_hash(connection))


def grade_with(table_hash: TableHash, task: Mapping[str, Any], answers: Sequence[str]) -> bool:
    """The task's verdict; `table_hash` reads the session's database (for INSERT/UPDATE tasks only)."""
    if is_modification(task):
        return db_grading.compare_modification(combined_hash(task, table_hash), str(task["answer_md5"]))
    return db_grading.compare_select(list(answers), task["label"])


def grade(connection: sqlite3.Connection, task: Mapping[str, Any], answers: Sequence[str]) -> bool:
    return grade_with(_sqlite_table_hash(connection), task, answers)


def prompt(task: Mapping[str, Any]) -> str:
    text = ""
    if task.get("evidence"):
        text += "Evidence about the question: " + task["evidence"] + "\n"
    if task.get("add_description"):
        text += "Additional table information about the question: " + task["add_description"] + "\n"
    return text + "Question: " + task["description"] + "\n"


class Backend(Protocol):
    """Where sessions' databases live. Blocking calls: the environment runs them in worker threads."""

    def create(self, task: Mapping[str, Any]) -> Any:
        """A fresh database holding the task's tables (via table_contents); the session's handle."""

    def execute(self, database: Any, query: str) -> str:
        """One statement: its rows or its error as AgentBench shows them (cut), or TIMED_OUT."""

    def table_hash(self, database: Any) -> TableHash:
        """AgentBench's hash of one table of the session's database."""

    def drop(self, database: Any) -> None:
        """Releases the database; safe on a half-built one."""


class SqliteBackend:
    """One in-memory SQLite database per session (the default)."""

    def __init__(self, query_timeout_s: float) -> None:
        self.query_timeout_s = query_timeout_s

    def create(self, task: Mapping[str, Any]) -> sqlite3.Connection:
        return create_database(task)

    def execute(self, database: sqlite3.Connection, query: str) -> str:
        return execute(database, query, self.query_timeout_s)

    def table_hash(self, database: sqlite3.Connection) -> TableHash:
        return _sqlite_table_hash(database)

    def drop(self, database: sqlite3.Connection) -> None:
        database.close()


class DbEnvironment(Environment):
    family = "db"

    def __init__(self, max_rounds: int, backend: Backend) -> None:
        super().__init__(max_rounds)
        self.backend = backend

    async def open(self, sample: Mapping[str, Any]) -> Opened:
        messages = [{"role": "system", "content": SYSTEM_PROMPT}, {"role": "user", "content": prompt(sample)}]
        return Opened(messages, TOOLS, await asyncio.to_thread(self.backend.create, sample))

    async def call_tool(self, session: Session, call: ToolCall) -> Outcome:
        # Threads keep a slow statement (or a server round trip) from stalling every other session of this loop.
        if call.name == "execute_sql":
            result = await asyncio.to_thread(self.backend.execute, session.state, call.arguments["query"])
            return Outcome(result or "No response from database.")
        if call.name == "commit_final_answer":
            table_hash = self.backend.table_hash(session.state)
            correct = await asyncio.to_thread(grade_with, table_hash, session.sample, call.arguments["answers"])
            return Outcome("Answer committed.", Status.COMPLETED, float(correct), {"score": float(correct)})
        raise ActionError(f"no tool {call.name}")

    async def close(self, session: Session) -> None:
        if session.state is not None:
            await asyncio.to_thread(self.backend.drop, session.state)


def make(settings: EnvSettings) -> DbEnvironment:
    if settings.db_backend == "mysql":
        # Imported here: the driver is needed only where a server is configured.
        from env_workers.envs.db_mysql import MysqlBackend

        return DbEnvironment(settings.db_rounds, MysqlBackend.from_settings(settings))
    return DbEnvironment(settings.db_rounds, SqliteBackend(settings.db_query_timeout_s))


def result_values(result: str) -> list[str]:
    """The values of a shown query result ("[(a, b), (c, d)]"), flattened row by row, as a policy would read them."""
    try:
        rows = ast.literal_eval(result)
    except (ValueError, SyntaxError):
        return [result]
    if not isinstance(rows, list):
        return [result]
    return [str(value) for row in rows for value in (row if isinstance(row, tuple) else (row,))]


def reference_answers(task: Mapping[str, Any]) -> list[str] | None:
    """What the reference query of a SELECT-style task returns here, if that grades as the label."""
    connection = create_database(task)
    try:
        values = result_values(execute(connection, task["sql"]["query"], timeout_s=60.0))
    finally:
        connection.close()
    return values if db_grading.compare_select(values, task["label"]) else None


def golden(task: Mapping[str, Any]) -> Policy:
    """DBBench's labels as actions.

    INSERT/UPDATE: run the label statement, then commit. SELECT-style: run the reference query and
    commit what it returns when that is the label; many upstream reference queries are broken
    (MySQL syntax errors, wrong table names) or disagree with the label, and then the golden
    answer is the label itself, committed directly.
    """
    if is_modification(task):
        return scripted([assistant_call("execute_sql", {"query": task["label"][0]}),
                         assistant_call("commit_final_answer", {"answers": []}, call_id="call_1")])
    answers = reference_answers(task)
    if answers is None:
        return scripted([assistant_call("commit_final_answer", {"answers": [str(v) for v in task["label"]]})])
    return scripted([assistant_call("execute_sql", {"query": task["sql"]["query"]}),
                     assistant_call("commit_final_answer", {"answers": answers}, call_id="call_1")])


def noop(task: Mapping[str, Any]) -> Policy:
    """Commits an empty answer without touching the table."""
    return lambda history: assistant_call("commit_final_answer", {"answers": []})


def generate(split: str, settings: EnvSettings) -> list[dict[str, Any]]:
    """The generated tier splits (db_tiers.py, imported here because it builds its tasks with this module)."""
    from env_workers.envs import db_tiers

    return db_tiers.generate(split, settings)


TIER_SPLITS = ("easy-train", "easy-dev", "two-table-train", "two-table-dev")  # db_tiers.split_names()

FAMILY = Family(
    name="db",
    make=make,
    load=load,
    splits={"dev": ("agentbench/dbbench/dev.jsonl",), "standard": ("agentbench/dbbench/standard.jsonl",),
            **{split: () for split in TIER_SPLITS}},
    golden=golden,
    noop=noop,
    generate=generate,
)
