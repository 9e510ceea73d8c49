"""Alembic's environment for the run store.

The store upgrades itself when it is opened (``runstore.schema.upgrade``),
handing its connection in, inside the transaction that holds the migration
lock. From alembic's command line (``alembic -c runstore/alembic.ini -x
db=URL ...``: a new revision, a look at the history) it opens ``db``, or the
default store.
"""

from __future__ import annotations

from alembic import context
from sqlalchemy.engine import Connection

import runstore.store  # noqa: F401  (maps the run tables on Base: its metadata then holds every table)
from runstore.base import Base
from runstore.schema import make_engine
from runstore.store_url import default_db_url


def _run(connection: Connection) -> None:
    context.configure(connection=connection, target_metadata=Base.metadata,
                      render_as_batch=connection.dialect.name == "sqlite")  # SQLite alters a table by copying it
    with context.begin_transaction():
        context.run_migrations()


handed = context.config.attributes.get("connection")
if handed is not None:
    _run(handed)
else:
    with make_engine(context.get_x_argument(as_dictionary=True).get("db") or default_db_url()).begin() as opened:
        _run(opened)
