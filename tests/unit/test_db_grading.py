"""DBBench's grader against hand-worked cases (AgentBench result_processor.py semantics)."""

from __future__ import annotations

import hashlib
import sqlite3

import pytest

from env_workers.envs import db_grading
from env_workers.envs.db_grading import clean_answer, compare_modification, compare_select, normalize_value


def _md5(text: str) -> str:
    return hashlib.md5(text.encode("utf-8")).hexdigest()


@pytest.mark.parametrize(
    ("raw", "normalized"),
    [
        (None, "0"),
        ("null", "0"),
        ("NaN", "0"),
        ("  None ", "0"),
        ("", "0"),
        ("-Infinity", "0"),
        ("45%", "45"),
        ("1,234%", "1,234"),  # upstream returns at the percent sign: separators stay
        ("1,234,567", "1234567"),
        ("[1,2]", "[1,2]"),
        ("Paris", "Paris"),
    ],
)
def test_values_normalize_as_agentbench(raw: str | None, normalized: str) -> None:
    assert normalize_value(raw) == normalized


@pytest.mark.parametrize(
    ("answer", "label", "expected"),
    [
        (["1,234.5"], ["1234.5"], True),  # thousands separator
        (["3.004"], ["3"], True),  # float tolerance 1e-2
        (["3.011"], ["3"], False),
        (["12%"], ["12.0"], True),  # percent sign
        (["none"], ["0"], True),  # null-like -> "0"
        ([], ["none"], False),
        (['"House of Cards"'], ["House of Cards"], True),  # quotes stripped
        (["paris"], ["Paris"], False),  # strings compare exactly
        (["b", "a"], ["a", "b"], True),  # several values: a set
        (["a", "a", "b"], ["a", "b"], True),
        (["a", "c"], ["a", "b"], False),
        (["1", "2"], ["2.001", "1"], True),  # several numbers: one-to-one within tolerance
        (["1", "1"], ["1", "2"], False),
        (["1", "2", "3"], ["1", "2"], False),
        ("[('293.0',)]", ["293"], True),  # a raw MySQL result
        ("[(5,), (6,)]", ["6", "5"], True),
        ("['x', 'y']", ["y", "x"], True),
    ],
)
def test_select_answers_compare_as_agentbench(answer: object, label: list[str], expected: bool) -> None:
    assert compare_select(answer, label) is expected


def test_unparsable_bracketed_answer_is_split_outside_quotes_as_upstream() -> None:
    # The apostrophe opens a "quote", so the comma after it does not split; commas are then dropped.
    assert clean_answer("[Checco D'Angelo, 7]") == ["Checco DAngelo 7"]
    assert clean_answer("[a b, 'c, d']") == ["a b", "c d"]


def test_clean_answer_unpacks_one_column_mysql_rows_only() -> None:
    assert clean_answer("[('a',), ('b', 'c')]") == ["a"]
    assert clean_answer(None) == ["0"]


def test_row_hash_is_md5_prefix_of_comma_joined_columns_skipping_nulls() -> None:
    assert db_grading.row_hash(["a", "b"]) == _md5("a,b")[:5]
    assert db_grading.row_hash(["a", None, "b"]) == _md5("a,b")[:5]  # CONCAT_WS skips NULL
    assert db_grading.row_hash([None, None]) == _md5("")[:5]


def test_table_hash_is_md5_of_sorted_row_hashes_joined_by_commas() -> None:
    rows = [["x", "1"], ["y", "2"], ["z", "3"]]
    prefixes = sorted(_md5(",".join(r))[:5] for r in rows)
    assert db_grading.rows_hash(rows) == _md5(",".join(prefixes))
    assert db_grading.rows_hash(list(reversed(rows))) == db_grading.rows_hash(rows)


def test_table_hash_of_empty_table_is_null_as_in_mysql() -> None:
    assert db_grading.rows_hash([]) is None
    assert compare_modification(None, "[(None,)]")


def test_table_hash_keeps_mysql_group_concat_limit_of_1024_bytes() -> None:
    rows = [[str(i)] for i in range(300)]  # 300 * 6 - 1 bytes > 1024
    joined = ",".join(sorted(_md5(str(i))[:5] for i in range(300)))
    assert db_grading.rows_hash(rows) == _md5(joined[:1024])
    assert db_grading.rows_hash(rows) != _md5(joined)


def test_table_hash_reads_sqlite_rows_with_quoted_names() -> None:
    connection = sqlite3.connect(":memory:")
    connection.execute("CREATE TABLE `my table` (`a col` TEXT, `b` TEXT)")
    connection.executemany("INSERT INTO `my table` VALUES (?, ?)", [("1", "x"), ("2", None)])
    expected = _md5(",".join(sorted([_md5("1,x")[:5], _md5("2")[:5]])))
    assert db_grading.table_hash(connection, "my table", ["a col", "b"]) == expected


def test_modification_compares_hash_with_mysql_result_repr() -> None:
    assert compare_modification("09aa8fbf72f39362970f95a1276b957c", "[('09aa8fbf72f39362970f95a1276b957c',)]")
    assert not compare_modification("09aa8fbf72f39362970f95a1276b957d", "[('09aa8fbf72f39362970f95a1276b957c',)]")
