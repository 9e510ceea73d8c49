"""The run store's schema: alembic revisions under ``runstore/migrations``, applied when a store is opened.

A store at the newest revision costs one query to open (alembic is not even
imported). One that is behind, empty, or written before the store had
migrations (tables but no ``alembic_version``: stamped at the baseline first)
is upgraded inside one transaction that holds a lock, so two processes opening
the same new store at once (an aggregator and its dashboard) migrate it once:
``BEGIN IMMEDIATE`` on SQLite, whose DDL is transactional, and a transaction
advisory lock on PostgreSQL. The second reads the revision again under the
lock and finds nothing to do.

A new revision: change the models in ``runstore/store.py``, then run
``alembic -c runstore/alembic.ini -x db=URL revision --autogenerate --rev-id
0003 -m "what changed"`` against a store at the head (``runstore/alembic.ini``),
and add its id to ``REVISIONS``.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from sqlalchemy import Column, MetaData, PrimaryKeyConstraint, String, Table, create_engine, event, inspect, text
from sqlalchemy.engine import Connection, Engine
from sqlalchemy.exc import DBAPIError

from core.errors import StoreError

__all__ = ["REVISIONS", "HEAD", "BASELINE", "MIGRATIONS", "revision", "upgrade", "alembic_config", "make_engine"]

#: Every revision, oldest first (``tests/runstore/test_migrations.py`` checks this against alembic's own walk).
REVISIONS = ("0001", "0002", "0003", "0004", "0005", "0006", "0007", "0008", "0009")
HEAD, BASELINE = REVISIONS[-1], REVISIONS[0]
MIGRATIONS = Path(__file__).resolve().parent / "migrations"
_PG_LOCK = 0x51_75_6F_72  # "Quor": the advisory lock key of a migration


def revision(connection: Connection) -> str | None:
    """Read the store's schema revision; ``None`` for an empty store or one written before migrations."""
    if not inspect(connection).has_table("alembic_version"):
        return None
    return connection.execute(text("SELECT version_num FROM alembic_version")).scalar()


def alembic_config(connection: Connection | None = None) -> Any:
    """Alembic's configuration for the run store, with ``connection`` handed to ``migrations/env.py``."""
    from alembic.config import Config

    config = Config()
    config.set_main_option("script_location", str(MIGRATIONS))
    config.attributes["connection"] = connection
    return config


def upgrade(engine: Engine, metadata: MetaData) -> None:
    """Bring the store at ``engine`` to ``HEAD``; ``metadata`` is the models' (``runstore.store.Base``).

    An empty store is created from the models and stamped at ``HEAD`` (alembic's
    recipe for a new database; ``tests/runstore/test_migrations.py`` checks that the
    revisions build the same schema), without importing alembic.

    Raises
    ------
    StoreError
        The store was written by a newer Quorum, or it is behind and cannot be altered (a read-only user).
    """
    with engine.connect() as connection:
        found = revision(connection)
    if found == HEAD:
        return
    _check_known(found, engine)
    locked = _locking_engine(engine)
    try:
        with locked.begin() as connection:
            if connection.dialect.name == "postgresql":
                connection.execute(text("SELECT pg_advisory_xact_lock(:key)"), {"key": _PG_LOCK})
            found = revision(connection)  # again, under the lock: another process may have migrated it
            if found == HEAD:
                return
            _check_known(found, engine)
            if found is None and not inspect(connection).has_table("runs"):
                metadata.create_all(connection)
                _stamp_head(connection)
            else:
                _migrate(connection, legacy=found is None)
    except DBAPIError as exc:
        with engine.connect() as connection:
            if revision(connection) == HEAD:  # another process got there first (a dialect without a lock)
                return
        raise StoreError(f"the run store {engine.url.render_as_string(hide_password=True)} is at schema revision "
                         f"{found or 'none'}, this Quorum needs {HEAD}, and it cannot be upgraded: {exc.orig}; "
                         "open it once with write access") from None
    finally:
        if locked is not engine:
            locked.dispose()


def _migrate(connection: Connection, legacy: bool) -> None:
    from alembic import command

    config = alembic_config(connection)
    if legacy:  # written before the store had migrations: it has the baseline, and maybe some of 0002
        command.stamp(config, BASELINE)
    command.upgrade(config, HEAD)


def _stamp_head(connection: Connection) -> None:
    """Write what ``alembic stamp head`` writes into a store that has no revision yet: its version table."""
    version = Table("alembic_version", MetaData(), Column("version_num", String(32), nullable=False),
                    PrimaryKeyConstraint("version_num", name="alembic_version_pkc"))
    version.create(connection)
    connection.execute(version.insert().values(version_num=HEAD))


def _check_known(found: str | None, engine: Engine) -> None:
    if found is not None and found not in REVISIONS:
        raise StoreError(f"the run store {engine.url.render_as_string(hide_password=True)} is at schema revision "
                         f"{found}, newer than this Quorum knows (up to {HEAD}): it was written by a newer "
                         "Quorum; upgrade this one (pip install -U quorum) to read it")


def _sqlite_pragmas(dbapi_connection: Any, _record: Any) -> None:
    cursor = dbapi_connection.cursor()
    cursor.execute("PRAGMA busy_timeout=10000")  # first: turning a store to WAL waits for other connections too
    cursor.execute("PRAGMA journal_mode=WAL")
    cursor.execute("PRAGMA synchronous=NORMAL")
    cursor.close()


def make_engine(url: str) -> Engine:
    """Create an engine; SQLite files get WAL mode and their folder created."""
    if url.startswith("sqlite:///") and url != "sqlite:///:memory:":
        Path(url.removeprefix("sqlite:///")).parent.mkdir(parents=True, exist_ok=True)
    engine = create_engine(url)
    if engine.dialect.name == "sqlite":
        event.listen(engine, "connect", _sqlite_pragmas)
    return engine


def _locking_engine(engine: Engine) -> Engine:
    """``engine`` itself, or for an SQLite file a second engine whose transactions begin ``IMMEDIATE``.

    Python's sqlite3 driver would commit before each DDL statement; with its own
    transaction handling off, the migration is one transaction holding SQLite's
    write lock from its first statement (the other process waits its busy timeout).
    """
    if engine.dialect.name != "sqlite" or engine.url.database in (None, "", ":memory:"):
        return engine
    locked = make_engine(engine.url.render_as_string(hide_password=False))

    @event.listens_for(locked, "connect")
    def _driver_autocommit(dbapi_connection: Any, _record: Any) -> None:
        dbapi_connection.isolation_level = None

    @event.listens_for(locked, "begin")
    def _begin_immediate(connection: Connection) -> None:
        connection.exec_driver_sql("BEGIN IMMEDIATE")

    return locked
