"""The db family on a MySQL-compatible server (MariaDB), as AgentBench runs DBBench on MySQL.

Each session gets its own database and its own user, both named `rs_<random hex>`, made by the
configured admin account: the database (utf8mb4, case- and accent-insensitive collation like
MySQL 8's default) holds the task's tables built from db.table_contents (every column TEXT, every
value `str(value)`, as AgentBench's `_build_init_sql`); the user may read and change that database
only (no FILE, no SUPER, no CREATE USER, no other database). Model SQL is hostile input:

- MariaDB's per-user `MAX_STATEMENT_TIME` stops a statement after `db_query_timeout_s`; as the
  session may `SET max_statement_time = 0`, a watchdog thread also kills the statement
  (`KILL QUERY` from the admin account) a grace period later. Both show AgentBench's timeout text.
- `MAX_USER_CONNECTIONS` bounds the user's connections; the server's own limits are in
  infra/mariadb.sh (local_infile off, secure_file_priv on an empty folder, loopback only).

Results are `str(list of row tuples)` and errors `str(error)` in mysql.connector's form
("1064 (42000): You have an error ..."), both cut at 800 characters, as upstream's
interaction.py shows them. The table hash is upstream's own query, run on the session's
connection as upstream runs it. `drop` removes the database and the user, also of a session
whose creation failed halfway. Needs MariaDB (MAX_STATEMENT_TIME is MariaDB's): PyMySQL speaks to it.
"""

from __future__ import annotations

import logging
import secrets
import threading
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pymysql

from env_workers.envs import db
from env_workers.envs.base import EnvSettings
from env_workers.envs.db_grading import quote_identifier

log = logging.getLogger(__name__)

# What a session's user may do inside its own database: AgentBench's tasks need reads, writes and
# DDL on their tables; routines, events and triggers would outlive or escape the statement limit.
SESSION_PRIVILEGES = ("SELECT, INSERT, UPDATE, DELETE, CREATE, DROP, ALTER, INDEX, REFERENCES, "
                      "CREATE TEMPORARY TABLES, CREATE VIEW, SHOW VIEW, LOCK TABLES")
# Close to MySQL 8's utf8mb4_0900_ai_ci (AgentBench's server): 'Montréal' = 'montreal'.
COLLATION = "utf8mb4_unicode_520_ci"
KILL_GRACE_S = 1.0  # the watchdog's delay past the server's own limit
CONNECT_TIMEOUT_S = 10
# Server errors that say the policy removed what the hash reads (database, table or column): no match.
GONE = {1046, 1049, 1051, 1054, 1146}
STATEMENT_TIMED_OUT = {1969}  # max_statement_time exceeded
INTERRUPTED = {1317, 1927}  # query or connection killed (by the watchdog, or by the session itself)


def show_error(error: pymysql.MySQLError) -> str:
    """An error as mysql.connector's str() gives it to AgentBench's policy: "errno (sqlstate): message"."""
    if len(error.args) < 2 or not isinstance(error.args[0], int):
        return str(error)
    errno, message = error.args[0], error.args[1]
    sqlstate = getattr(error, "sqlstate", None)
    return f"{errno} ({sqlstate}): {message}" if sqlstate else f"{errno}: {message}"


@dataclass
class MysqlSession:
    """One session's database: its name (also its user's), the user's password and open connection."""

    name: str
    password: str
    connection: pymysql.connections.Connection | None = None


@dataclass(frozen=True)
class MysqlBackend:
    """Per-session databases and users on one server, reached as the admin account."""

    host: str
    port: int
    socket: Path | None
    admin_user: str
    admin_password: str
    query_timeout_s: float
    user_connections: int

    @classmethod
    def from_settings(cls, settings: EnvSettings) -> MysqlBackend:
        return cls(settings.db_mysql_host, settings.db_mysql_port, settings.db_mysql_socket,
                   settings.db_mysql_user, settings.db_mysql_password.get_secret_value(),
                   settings.db_query_timeout_s, settings.db_mysql_user_connections)

    def connect(self, user: str, password: str, database: str | None = None,
                read_timeout: float | None = None) -> pymysql.connections.Connection:
        where: dict[str, Any] = {"unix_socket": str(self.socket)} if self.socket else {"host": self.host,
                                                                                       "port": self.port}
        # No TLS: the server is on loopback (infra/mariadb.sh), and PyMySQL's default TLS context
        # costs ~25 ms per connection (it loads the CA bundle), more than the rest of a session's set-up.
        return pymysql.connect(user=user, password=password, database=database, charset="utf8mb4",
                               autocommit=True, connect_timeout=CONNECT_TIMEOUT_S, read_timeout=read_timeout,
                               ssl_disabled=True, **where)

    def _admin(self, database: str | None = None) -> pymysql.connections.Connection:
        return self.connect(self.admin_user, self.admin_password, database)

    # --- db.Backend -------------------------------------------------------------------------

    def create(self, task: Mapping[str, Any]) -> MysqlSession:
        session = MysqlSession(name="rs_" + secrets.token_hex(12), password=secrets.token_hex(16))
        try:
            self._build(session, task)
            session.connection = self._session_connection(session)
        except BaseException:
            try:
                self.drop(session)
            except pymysql.MySQLError:  # keep the first failure; this one is only logged
                log.exception("could not drop the half-built database %s", session.name)
            raise
        return session

    def execute(self, database: MysqlSession, query: str) -> str:
        connection = self._live_connection(database)
        fired = threading.Event()

        def kill() -> None:  # the statement outlived the server's limit (the session turned it off)
            fired.set()
            self._kill_query(connection.thread_id())

        watchdog = threading.Timer(self.query_timeout_s + KILL_GRACE_S, kill)
        watchdog.daemon = True
        watchdog.start()
        try:
            with connection.cursor() as cursor:
                cursor.execute(query)  # no arguments: PyMySQL leaves '%' in the text alone
                text = str(list(cursor.fetchall())) if cursor.description is not None else "[]"
        except pymysql.MySQLError as error:
            errno = error.args[0] if error.args else None
            if errno in STATEMENT_TIMED_OUT or (fired.is_set() and errno in INTERRUPTED | {2013}):
                return db.TIMED_OUT
            text = show_error(error)
        finally:
            watchdog.cancel()
        return db.cut(text)

    def table_hash(self, database: MysqlSession) -> db.TableHash:
        def table_hash(table_name: str, columns: Sequence[str]) -> str | None:
            # AgentBench's _get_table_hash_async, on the session's connection as upstream.
            column_list = ",".join(quote_identifier(c) for c in columns)
            query = ("SELECT md5(group_concat(rowhash ORDER BY rowhash)) AS hash FROM "
                     f"(SELECT substring(MD5(CONCAT_WS(',', {column_list})), 1, 5) AS rowhash "
                     f"FROM {quote_identifier(table_name)}) AS sub")
            try:
                with self._live_connection(database).cursor() as cursor:
                    cursor.execute(query)
                    value = cursor.fetchone()[0]
            except pymysql.MySQLError as error:
                if error.args and error.args[0] in GONE:
                    return show_error(error)
                raise
            return None if value is None else str(value)

        return table_hash

    def drop(self, database: MysqlSession) -> None:
        if database.connection is not None:
            try:
                database.connection.close()
            except pymysql.MySQLError:
                pass  # already gone (killed by the session itself)
            database.connection = None
        admin = self._admin()
        try:
            with admin.cursor() as cursor:
                # The user first: nothing new can connect while its database goes.
                cursor.execute(f"DROP USER IF EXISTS '{database.name}'@'%'")
                cursor.execute(f"DROP DATABASE IF EXISTS {quote_identifier(database.name)}")
        finally:
            admin.close()

    # --- internals --------------------------------------------------------------------------

    def _build(self, session: MysqlSession, task: Mapping[str, Any]) -> None:
        admin = self._admin()
        try:
            with admin.cursor() as cursor:
                name = quote_identifier(session.name)
                cursor.execute(f"CREATE DATABASE {name} CHARACTER SET utf8mb4 COLLATE {COLLATION}")
                cursor.execute(f"USE {name}")
                for table_name, columns, rows in db.table_contents(task):
                    column_list = ",".join(quote_identifier(c) for c in columns)
                    definitions = ",".join(f"{quote_identifier(c)} TEXT" for c in columns)
                    cursor.execute(f"CREATE TABLE IF NOT EXISTS {quote_identifier(table_name)} ({definitions})")
                    if rows:
                        # PyMySQL formats the statement with %: a '%' in a name ('Win%') is doubled.
                        insert = f"INSERT INTO {quote_identifier(table_name)} ({column_list})".replace("%", "%%")
                        cursor.executemany(f"{insert} VALUES ({','.join(['%s'] * len(columns))})", rows)
                # Name and password are hex made here: nothing to escape.
                cursor.execute(f"CREATE USER '{session.name}'@'%' IDENTIFIED BY '{session.password}' WITH "
                               f"MAX_USER_CONNECTIONS {int(self.user_connections)} "
                               f"MAX_STATEMENT_TIME {float(self.query_timeout_s)}")
                cursor.execute(f"GRANT {SESSION_PRIVILEGES} ON {name}.* TO '{session.name}'@'%'")
        finally:
            admin.close()

    def _session_connection(self, session: MysqlSession) -> pymysql.connections.Connection:
        # The socket read time-out is the last resort, past the server limit and the watchdog.
        return self.connect(session.name, session.password, session.name,
                            read_timeout=self.query_timeout_s + 4 * KILL_GRACE_S)

    def _live_connection(self, session: MysqlSession) -> pymysql.connections.Connection:
        """The session's connection, reopened when the session killed it or a time-out closed it."""
        if session.connection is None:
            raise RuntimeError(f"session database {session.name} is closed")
        try:
            session.connection.ping(reconnect=False)
        except pymysql.MySQLError:  # the dead connection's socket is closed by the failed ping
            session.connection = self._session_connection(session)
        return session.connection

    def _kill_query(self, thread_id: int) -> None:
        try:
            admin = self._admin()
            try:
                with admin.cursor() as cursor:
                    cursor.execute(f"KILL QUERY {int(thread_id)}")
            finally:
                admin.close()
        except pymysql.MySQLError:
            log.exception("could not kill statement %s", thread_id)
