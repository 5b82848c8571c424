"""db: AgentBench's DBBench (src/server/tasks/dbbench/task.py) as function calls over SQLite.

Each session gets a fresh in-memory SQLite database holding the task's table, created as AgentBench
creates it on MySQL: every column TEXT, every value inserted as `str(value)` (so a JSON null
becomes the text 'None', as upstream). Tools `execute_sql(query)` and
`commit_final_answer(answers)`; 15 rounds. Query results are shown as upstream shows MySQL's:
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
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

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
    for table in _tables(task):
        name = db_grading.quote_identifier(table["table_name"])
        columns = [db_grading.quote_identifier(c["name"]) for c in table["table_info"]["columns"]]
        definitions = ", ".join(c + " TEXT COLLATE mysql" for c in columns)
        connection.execute(f"CREATE TABLE IF NOT EXISTS {name} ({definitions})")
        rows = [tuple(str(value) for value in row) for row in table["table_info"]["rows"]]
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
    if len(text) > RESULT_LIMIT:
        text = text[:RESULT_LIMIT] + "[TRUNCATED]"
    return text


def tables_hash(connection: sqlite3.Connection, task: Mapping[str, Any]) -> str | None:
    """AgentBench's calculate_tables_hash: per-table hashes, sorted and joined with '_'."""
    hashes = []
    for table in _tables(task):
        columns = [c["name"] for c in table["table_info"]["columns"]]
        hashes.append(db_grading.table_hash(connection, table["table_name"], columns))
    if len(hashes) == 1:
        return hashes[0]
    return "_".join(sorted(str(h) for h in hashes))


def grade(connection: sqlite3.Connection, task: Mapping[str, Any], answers: Sequence[str]) -> bool:
    if is_modification(task):
        return db_grading.compare_modification(tables_hash(connection, task), str(task["answer_md5"]))
    return db_grading.compare_select(list(answers), task["label"])


def prompt(task: Mapping[str, Any]) -> str:
    text = ""
    if task.get("evidence"):
        text += "Evidence about the question: " + task["evidence"] + "\n"
    if task.get("add_description"):
        text += "Additional table information about the question: " + task["add_description"] + "\n"
    return text + "Question: " + task["description"] + "\n"


class DbEnvironment(Environment):
    family = "db"

    def __init__(self, max_rounds: int, query_timeout_s: float) -> None:
        super().__init__(max_rounds)
        self.query_timeout_s = query_timeout_s

    async def open(self, sample: Mapping[str, Any]) -> Opened:
        messages = [{"role": "system", "content": SYSTEM_PROMPT}, {"role": "user", "content": prompt(sample)}]
        return Opened(messages, TOOLS, create_database(sample))

    async def call_tool(self, session: Session, call: ToolCall) -> Outcome:
        connection: sqlite3.Connection = session.state
        if call.name == "execute_sql":
            # A thread keeps a slow statement from stalling every other session of this event loop.
            result = await asyncio.to_thread(execute, connection, call.arguments["query"], self.query_timeout_s)
            return Outcome(result or "No response from database.")
        if call.name == "commit_final_answer":
            correct = grade(connection, session.sample, call.arguments["answers"])
            return Outcome("Answer committed.", Status.COMPLETED, float(correct), {"score": float(correct)})
        raise ActionError(f"no tool {call.name}")

    async def close(self, session: Session) -> None:
        if session.state is not None:
            session.state.close()


def make(settings: EnvSettings) -> DbEnvironment:
    return DbEnvironment(max_rounds=settings.db_rounds, query_timeout_s=settings.db_query_timeout_s)


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


FAMILY = Family(
    name="db",
    make=make,
    load=load,
    splits={"dev": ("agentbench/dbbench/dev.jsonl",), "standard": ("agentbench/dbbench/standard.jsonl",)},
    golden=golden,
    noop=noop,
)
