"""DBBench grading, reproduced from AgentBench (src/server/tasks/dbbench/result_processor.py).

SELECT-style answers: both sides are cleaned into lists of strings (MySQL result reprs such as
"[('293.0',)]" unpacked, null-like values -> "0", a trailing percent sign dropped, thousands
separators removed), then one value is compared as a float within 1e-2 or as a string, and several
values as a float multiset (each within 1e-2) or as a set.

INSERT/UPDATE answers: AgentBench's table hash, computed here in Python over SQLite rows exactly as
MySQL computes `SELECT md5(group_concat(rowhash ORDER BY rowhash)) FROM (SELECT
substring(MD5(CONCAT_WS(',', <columns>)), 1, 5) AS rowhash FROM <table>)`, and compared with the
task's `answer_md5` (the repr of that MySQL result).

One deliberate difference: upstream parses bracketed answers with `eval`; we use
`ast.literal_eval`, which accepts the same literals and runs no code.
"""

from __future__ import annotations

import ast
import hashlib
import sqlite3
from collections.abc import Sequence
from typing import Any

FLOAT_TOLERANCE = 1e-2  # AgentBench's _float_equal tol
# MySQL's default group_concat_max_len: the concatenated row hashes are cut to this many bytes.
GROUP_CONCAT_MAX_LEN = 1024
MODIFICATION_TYPES = ("INSERT", "DELETE", "UPDATE")

_NULL_LIKE = {"none", "null", "undefined", "nan", "inf", "infinity", "-inf", "-infinity", ""}


def normalize_value(value: Any) -> str:
    """AgentBench's _normalize_special_values: one answer value as a comparable string."""
    if value is None:
        return "0"
    text = str(value).strip()
    if text.endswith("%"):
        # Upstream returns here: a percentage keeps its thousands separators and is not null-mapped.
        return text[:-1].strip()
    if "," in text and not text.startswith("[") and not text.endswith("]"):
        text = text.replace(",", "")
    return "0" if text.lower() in _NULL_LIKE else text


def _unquote(value: Any) -> str:
    return str(value).strip().strip("'\"")


def _mysql_result_values(result: str) -> list[str] | None:
    """AgentBench's _clean_mysql_result: the single-column values of a "[(v,), ...]" repr, else None."""
    if not (result.startswith("[") and result.endswith("]")):
        return None
    try:
        parsed = ast.literal_eval(result)
    except (ValueError, SyntaxError, MemoryError, RecursionError):
        parsed = None
    if isinstance(parsed, list) and all(isinstance(item, tuple) for item in parsed):
        # Upstream keeps one-column rows only; wider rows are silently dropped.
        return [_unquote(item[0]) for item in parsed if len(item) == 1]
    inner = result.strip("[]")
    if inner.count("(") == 1 and inner.startswith("(") and inner.endswith(",)"):
        return [inner[1:-2].strip().strip("'\"")]
    return None


def _split_bracketed(text: str) -> list[str]:
    """Upstream's fallback for a bracketed list that does not parse: split on commas outside quotes."""
    items: list[str] = []
    current = ""
    in_quotes = False
    for char in text[1:-1]:
        if char in "\"'":
            in_quotes = not in_quotes
        elif char == "," and not in_quotes:
            if current:
                items.append(normalize_value(_unquote(current)))
                current = ""
        else:
            current += char
    if current:
        items.append(normalize_value(_unquote(current)))
    return items


def _item_value(item: Any) -> str:
    if isinstance(item, tuple) and len(item) == 1:
        item = item[0]
    return normalize_value(_unquote(item))


def clean_answer(answer: Any) -> list[str]:
    """AgentBench's _clean_answer: an answer (string, list, MySQL result repr, None) as a list of strings."""
    if answer is None:
        return ["0"]
    if isinstance(answer, str):
        mysql_values = _mysql_result_values(answer)
        if mysql_values is not None:
            return [normalize_value(value) for value in mysql_values]
        text = answer.strip()
        if text.startswith("[") and text.endswith("]"):
            try:
                parsed = ast.literal_eval(text)
            except (ValueError, SyntaxError, MemoryError, RecursionError):
                return _split_bracketed(text)
            if isinstance(parsed, list):
                return [_item_value(item) for item in parsed]
            # Upstream falls through to None here (an eval'd non-list); no value matches it.
            return []
        return [normalize_value(_unquote(text))]
    if isinstance(answer, (list, tuple)):
        return [_item_value(item) for item in answer]
    return [normalize_value(_unquote(answer))]


def _is_float(value: str) -> bool:
    try:
        float(value)
    except (TypeError, ValueError):
        return False
    return True


def _float_equal(a: str, b: str) -> bool:
    return abs(float(a) - float(b)) <= FLOAT_TOLERANCE


def compare_select(answer: Any, label: Any) -> bool:
    """AgentBench's compare_results for SELECT-style tasks."""
    got, expected = clean_answer(answer), clean_answer(label)
    if len(got) == 1 and len(expected) == 1:
        a, b = got[0], expected[0]
        if a == "0" and b == "0":
            return True
        if _is_float(a) and _is_float(b):
            return _float_equal(a, b)
        return a == b
    if all(_is_float(x) for x in got) and all(_is_float(x) for x in expected):
        if len(got) != len(expected):
            return False
        # Greedy one-to-one matching within the tolerance, in answer order (as upstream).
        matched = [False] * len(expected)
        for a in got:
            for i, b in enumerate(expected):
                if not matched[i] and _float_equal(a, b):
                    matched[i] = True
                    break
            else:
                return False
        return all(matched)
    return set(got) == set(expected)


def _concat_ws(values: Sequence[Any]) -> str:
    """MySQL CONCAT_WS(',', ...): NULLs are skipped, everything else joined as text."""
    return ",".join(_mysql_text(value) for value in values if value is not None)


def _mysql_text(value: Any) -> str:
    if isinstance(value, bytes):
        return value.decode("utf-8", errors="replace")
    return str(value)


def row_hash(values: Sequence[Any]) -> str:
    """substring(MD5(CONCAT_WS(',', columns)), 1, 5)."""
    return hashlib.md5(_concat_ws(values).encode("utf-8")).hexdigest()[:5]


def rows_hash(rows: Sequence[Sequence[Any]]) -> str | None:
    """md5(group_concat(rowhash ORDER BY rowhash)); None (SQL NULL) for an empty table, as in MySQL."""
    if not rows:
        return None
    # Row hashes are lowercase hex, so MySQL's collation orders them as Python does.
    joined = ",".join(sorted(row_hash(row) for row in rows)).encode("utf-8")[:GROUP_CONCAT_MAX_LEN]
    return hashlib.md5(joined).hexdigest()


def quote_identifier(name: str) -> str:
    return "`" + name.replace("`", "``") + "`"


def table_hash(connection: sqlite3.Connection, table_name: str, columns: Sequence[str]) -> str | None:
    """AgentBench's table hash of one table, read from SQLite."""
    column_list = ", ".join(quote_identifier(c) for c in columns)
    rows = connection.execute(f"SELECT {column_list} FROM {quote_identifier(table_name)}").fetchall()
    return rows_hash(rows)


def compare_modification(hash_value: str | None, answer_md5: str) -> bool:
    """The table hash against the task's answer_md5 (the repr of MySQL's result, e.g. "[('ab12…',)]")."""
    return clean_answer(hash_value) == clean_answer(answer_md5)
