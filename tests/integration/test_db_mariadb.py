"""db family on a real MariaDB server (EnvSettings.db_backend = "mysql"), started by infra/mariadb.sh.

Golden and no-op checks over all shipped DBBench data, measured here, against SQLite's (tests/unit/
test_env_db.py: dev 60/60, standard 199/200, no-op 0):

- dev 59/60: `dev-5` has a column with an empty name, which MySQL and MariaDB refuse ("1166 (42000):
  Incorrect column name ''"), so the task cannot be built on a MySQL server (upstream neither): both
  its sessions end as task errors (errors 2). SQLite accepts the name.
- standard 198/200: `standard-151` fails on both backends (its answer_md5 was hashed from another
  table). `standard-186`'s label `UPDATE ... WHERE No = 16` compares a TEXT column holding '?' with a
  number: under MariaDB's (and MySQL 8's) default STRICT_TRANS_TABLES that aborts the UPDATE ("1292
  (22007): Truncated incorrect DECIMAL value: '?'"); SQLite updates the row, and so did whatever
  produced the answer_md5.
- The two SQLite shims (MySQL string escapes, accent-insensitive collation) are native here:
  `standard-163` and `standard-139` pass.

SELECT-style golden answers are backend-independent (db.golden decides on SQLite whether to commit
the reference query's rows or the label), so the SELECT half of the golden check shows that sessions
run and grade on MariaDB; the INSERT/UPDATE half checks the table hash computed by the server.
How many SELECT reference queries reproduce their label differs (measured below): MariaDB rejects
double-quoted table names (no ANSI_QUOTES, as upstream's MySQL) and compares TEXT with numbers
numerically (SQLite compares them as text).
"""

from __future__ import annotations

import asyncio
import json
import subprocess
import time
from pathlib import Path
from typing import Any

import pymysql
import pytest
from typer.testing import CliRunner

from env_workers.envs import db, db_grading, registry
from env_workers.envs.base import EnvSettings, Status, TaskError, assistant_call
from env_workers.envs.check import check_family
from env_workers.envs.db_mysql import MysqlBackend
from pipeline.cli import env as env_cmd

pytestmark = pytest.mark.integration

REPO_ROOT = Path(__file__).resolve().parents[2]
SCRIPT = REPO_ROOT / "infra" / "mariadb.sh"
SQLITE = EnvSettings()


def _infra_variables() -> dict[str, str]:
    """The server's address and admin account as infra/env.sh defines them (one source of truth)."""
    names = ("MARIADB_HOST", "MARIADB_PORT", "MARIADB_USER", "MARIADB_PASSWORD")
    script = f"source {REPO_ROOT / 'infra' / 'env.sh'}; " + "; ".join(f'printf "%s\\n" "${n}"' for n in names)
    out = subprocess.run(["bash", "-c", script], check=True, capture_output=True, text=True).stdout.splitlines()
    return dict(zip(names, out, strict=True))


@pytest.fixture(scope="session")
def mariadb() -> EnvSettings:
    """MariaDB up (started once per test session, stopped after when this fixture started it); the
    settings of the mysql backend that reach it."""
    started = subprocess.run([str(SCRIPT), "status"], capture_output=True).returncode != 0
    subprocess.run([str(SCRIPT), "start"], check=True)
    v = _infra_variables()
    yield EnvSettings(db_backend="mysql", db_mysql_host=v["MARIADB_HOST"], db_mysql_port=int(v["MARIADB_PORT"]),
                      db_mysql_user=v["MARIADB_USER"], db_mysql_password=v["MARIADB_PASSWORD"])
    if started:
        subprocess.run([str(SCRIPT), "stop"], check=True)


def _admin_rows(settings: EnvSettings, query: str) -> list[tuple[Any, ...]]:
    connection = MysqlBackend.from_settings(settings)._admin()
    try:
        with connection.cursor() as cursor:
            cursor.execute(query)
            return list(cursor.fetchall())
    finally:
        connection.close()


def _session_names(settings: EnvSettings) -> set[str]:
    databases = _admin_rows(settings, r"SHOW DATABASES LIKE 'rs\_%'")
    users = _admin_rows(settings, r"SELECT User FROM mysql.user WHERE User LIKE 'rs\_%'")
    return {row[0] for row in databases + users}


def _task(split: str, task_id: str) -> dict[str, Any]:
    return next(t for t in registry.samples("db", split, SQLITE) if t["id"] == task_id)


def _check(settings: EnvSettings, split: str) -> dict[str, Any]:
    family = registry.family("db")
    return asyncio.run(check_family(family, family.make(settings), registry.samples("db", split, SQLITE)))


def _play(settings: EnvSettings, task: dict[str, Any], queries: list[str]) -> list[str]:
    """Runs the queries in one session; the tool results the policy sees."""
    async def go() -> list[str]:
        env = db.make(settings)
        session = await env.start(task)
        try:
            return [(await env.observation(session, assistant_call("execute_sql", {"query": q}))).messages[0]["content"]
                    for q in queries]
        finally:
            await env.end(session)

    return asyncio.run(go())


def test_golden_passes_59_of_60_dev_tasks_on_mariadb_and_noop_none(mariadb: EnvSettings) -> None:
    # dev-5: a column named '' cannot be created on a MySQL server: both sessions are task errors.
    assert _check(mariadb, "dev") == {"family": "db", "tasks": 60, "golden_pass": 59, "noop_pass": 0, "errors": 2,
                                      "failing_ids": ["dev-5"]}


def test_golden_passes_198_of_200_standard_tasks_on_mariadb_and_noop_none(mariadb: EnvSettings) -> None:
    # standard-151 as on SQLite; standard-186: strict mode aborts its label UPDATE (module docstring).
    assert _check(mariadb, "standard") == {"family": "db", "tasks": 200, "golden_pass": 198, "noop_pass": 0,
                                           "errors": 0, "failing_ids": ["standard-151", "standard-186"]}


@pytest.mark.parametrize("split", ["easy-dev", "two-table-dev"])
def test_golden_passes_every_generated_tier_task_on_mariadb_and_noop_none(mariadb: EnvSettings, split: str) -> None:
    # The tiers' answer_md5 come from SQLite: the server's own hash of the edited tables must agree.
    assert _check(mariadb, split) == {"family": "db", "tasks": 100, "golden_pass": 100, "noop_pass": 0, "errors": 0,
                                      "failing_ids": []}


def test_server_table_hash_equals_python_hash_of_the_same_rows(mariadb: EnvSettings) -> None:
    backend = MysqlBackend.from_settings(mariadb)
    tasks = [t for t in registry.samples("db", "dev", SQLITE) if db.is_modification(t)]
    for task in tasks:
        database = backend.create(task)
        try:
            on_server = db.combined_hash(task, backend.table_hash(database))
            assert on_server == db.tables_hash(db.create_database(task), task)
        finally:
            backend.drop(database)
    assert len(tasks) == 40


def test_select_reference_queries_reproduce_labels_as_measured_per_backend(mariadb: EnvSettings) -> None:
    backends = {"sqlite": db.SqliteBackend(60.0), "mariadb": MysqlBackend.from_settings(mariadb)}
    counts = {}
    for split in ("dev", "standard"):
        for name, backend in backends.items():
            reproduced = 0
            for task in registry.samples("db", split, SQLITE):
                if db.is_modification(task):
                    continue
                try:
                    database = backend.create(task)
                except pymysql.MySQLError:  # dev-5 on MariaDB (module docstring)
                    continue
                try:
                    result = backend.execute(database, task["sql"]["query"])
                finally:
                    backend.drop(database)
                reproduced += db_grading.compare_select(db.result_values(result), task["label"])
            counts[split, name] = reproduced
    # Of 20 dev and 66 standard SELECT-style tasks. MariaDB: double-quoted table names are syntax
    # errors (standard-0 ...), TEXT compares numerically with numbers (dev-10).
    assert counts == {("dev", "sqlite"): 3, ("dev", "mariadb"): 4, ("standard", "sqlite"): 28,
                      ("standard", "mariadb"): 21}


def test_results_and_errors_are_shown_as_upstream_shows_mysql_ones(mariadb: EnvSettings) -> None:
    table = {"table_name": "t", "table_info": {
        "columns": [{"name": "s", "type": "TEXT"}, {"name": "n", "type": "INT"}],
        "rows": [["x" * 100, i] for i in range(20)] + [["Montréal", None]]}}
    task = {"id": "t", "type": ["SELECT"], "label": ["x"], "description": "?", "table": table}
    count, long, error, update, accent, escaped, types = _play(mariadb, task, [
        "SELECT COUNT(*) FROM t", "SELECT s FROM t", "SELEC nothing", "UPDATE t SET s = 'y' WHERE n = '3'",
        "SELECT s, n FROM t WHERE s = 'montreal'", "SELECT 'Don\\'t'", "SELECT SUM(n), AVG(n), 1/4 FROM t"])
    assert count == "[(21,)]"
    assert len(long) == 800 + len("[TRUNCATED]") and long.endswith("[TRUNCATED]")
    assert error.startswith("1064 (42000): You have an error in your SQL syntax;")
    assert update == "[]"
    assert accent == "[('Montréal', 'None')]"  # all-TEXT columns, a null inserted as the text 'None'
    assert escaped == '[("Don\'t",)]'
    assert types == "[(190.0, 9.047619047619047, Decimal('0.2500'))]"  # the text 'None' counts as 0


def test_other_sessions_databases_are_out_of_reach(mariadb: EnvSettings) -> None:
    async def go() -> tuple[str, str, str]:
        env = db.make(mariadb)
        mine, theirs = await env.start(_task("dev", "dev-0")), await env.start(_task("dev", "dev-1"))
        try:
            table = db.table_contents(theirs.sample)[0][0]
            other = f"SELECT * FROM `{theirs.state.name}`.`{table}`"
            results = []
            for query in (other, "SHOW DATABASES", f"DROP DATABASE `{theirs.state.name}`"):
                obs = await env.observation(mine, assistant_call("execute_sql", {"query": query}))
                results.append(obs.messages[0]["content"])
            return results[0], results[1], results[2]
        finally:
            await env.end(mine)
            await env.end(theirs)

    read, listing, drop = asyncio.run(go())
    assert read.startswith("1142 (42000): SELECT command denied")
    assert listing.startswith("[('information_schema',), ('rs_") and listing.count("rs_") == 1
    assert drop.startswith("1044 (42000): Access denied")


def test_hostile_statements_are_refused_with_the_servers_error(mariadb: EnvSettings) -> None:
    load, outfile, drop, user, grant_all, global_var = _play(mariadb, _task("dev", "dev-0"), [
        "SELECT LOAD_FILE('/etc/passwd')", "SELECT 1 INTO OUTFILE '/tmp/rollstream-outfile'",
        "DROP DATABASE mysql", "CREATE USER evil IDENTIFIED BY 'x'", "GRANT ALL ON *.* TO CURRENT_USER",
        "SET GLOBAL max_connections = 1"])
    assert load == "[(None,)]"  # no FILE privilege: LOAD_FILE reads nothing
    assert outfile.startswith("1227 (42000): Access denied; you need (at least one of) the FILE privilege")
    assert drop.startswith("1044 (42000): Access denied")
    assert user.startswith("1227 (42000): Access denied; you need (at least one of) the CREATE USER privilege")
    assert grant_all.startswith("1045 (28000): Access denied") or grant_all.startswith("1044 (42000)")
    assert global_var.startswith("1227 (42000): Access denied; you need (at least one of) the SUPER")
    assert not Path("/tmp/rollstream-outfile").exists()
    assert _admin_rows(mariadb, "SELECT COUNT(*) FROM mysql.global_priv WHERE User = 'evil'") == [(0,)]
    assert _admin_rows(mariadb, "SELECT @@max_connections")[0][0] > 1


def test_endless_statements_stop_at_the_time_limit_even_when_the_session_lifts_it(mariadb: EnvSettings) -> None:
    settings = mariadb.model_copy(update={"db_query_timeout_s": 1.0})
    started = time.monotonic()
    sleep, lifted, watched, after = _play(settings, _task("dev", "dev-0"), [
        "SELECT SLEEP(100)", "SET max_statement_time = 0", "SELECT SLEEP(100)", "SELECT 1"])
    elapsed = time.monotonic() - started
    assert (sleep, lifted, watched, after) == (db.TIMED_OUT, "[]", db.TIMED_OUT, "[(1,)]")
    assert elapsed < 6  # 1 s by the server, 1 s + 1 s grace by the watchdog, plus set-up


def test_a_session_that_kills_its_own_connection_goes_on(mariadb: EnvSettings) -> None:
    killed, after = _play(mariadb, _task("dev", "dev-0"), ["KILL CONNECTION_ID()", "SELECT 2"])
    assert killed.startswith("1927") and after == "[(2,)]"


def test_session_user_may_hold_only_its_connection_limit(mariadb: EnvSettings) -> None:
    backend = MysqlBackend.from_settings(mariadb)
    database = backend.create(_task("dev", "dev-0"))
    try:
        extra = backend.connect(database.name, database.password, database.name)  # the limit is 2
        with pytest.raises(pymysql.OperationalError, match="max_user_connections"):
            backend.connect(database.name, database.password, database.name)
        extra.close()
    finally:
        backend.drop(database)


def test_dropping_the_graded_table_scores_zero_not_task_error(mariadb: EnvSettings) -> None:
    task = next(t for t in registry.samples("db", "dev", SQLITE) if db.is_modification(t))

    async def go() -> Any:
        env = db.make(mariadb)
        session = await env.start(task)
        try:
            drop = f"DROP DATABASE `{session.state.name}`"
            await env.observation(session, assistant_call("execute_sql", {"query": drop}))
            return await env.observation(session, assistant_call("commit_final_answer", {"answers": []}))
        finally:
            await env.end(session)

    obs = asyncio.run(go())
    assert (obs.status, obs.reward) == (Status.COMPLETED, 0.0)


def test_a_task_that_cannot_be_built_leaves_nothing_behind(mariadb: EnvSettings) -> None:
    before = _session_names(mariadb)
    with pytest.raises(TaskError, match="Incorrect column name"):
        asyncio.run(db.make(mariadb).start(_task("dev", "dev-5")))
    assert _session_names(mariadb) == before


def test_16_concurrent_sessions_leave_no_database_or_user_after_end(mariadb: EnvSettings) -> None:
    tasks = [t for t in registry.samples("db", "standard", SQLITE)][:16]

    async def one(env: db.DbEnvironment, task: dict[str, Any]) -> tuple[str, str]:
        session = await env.start(task)
        try:
            table = db.table_contents(task)[0][0]
            count = f"SELECT COUNT(*) FROM `{table}`"
            obs = await env.observation(session, assistant_call("execute_sql", {"query": count}))
            return session.state.name, obs.messages[0]["content"]
        finally:
            await env.end(session)
            await env.end(session)  # idempotent

    async def go() -> list[tuple[str, str]]:
        env = db.make(mariadb)
        return await asyncio.gather(*(one(env, t) for t in tasks))

    results = asyncio.run(go())
    names = {name for name, _ in results}
    assert len(names) == 16
    assert [count for _, count in results] == [f"[({len(db.table_contents(t)[0][2])},)]" for t in tasks]
    assert not names & _session_names(mariadb)


def test_env_check_cli_runs_on_the_configured_backend(mariadb: EnvSettings) -> None:
    data = SQLITE.data_root / "agentbench" / "dbbench" / "dev.jsonl"
    env = {"ROLLSTREAM_ENVS__DB_BACKEND": "mysql", "ROLLSTREAM_ENVS__DB_MYSQL_HOST": mariadb.db_mysql_host,
           "ROLLSTREAM_ENVS__DB_MYSQL_PORT": str(mariadb.db_mysql_port),
           "ROLLSTREAM_ENVS__DB_MYSQL_USER": mariadb.db_mysql_user,
           "ROLLSTREAM_ENVS__DB_MYSQL_PASSWORD": mariadb.db_mysql_password.get_secret_value()}
    result = CliRunner().invoke(env_cmd.app, ["check", "--family", "db", "--data", str(data), "--limit", "8",
                                              "--json"], env=env)
    assert result.exit_code == 0, result.output
    # dev-5 is the MySQL-only failure: this ran on MariaDB, not SQLite.
    assert json.loads(result.stdout) == {"family": "db", "tasks": 8, "golden_pass": 7, "noop_pass": 0, "errors": 2,
                                         "failing_ids": ["dev-5"]}
