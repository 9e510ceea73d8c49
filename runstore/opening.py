"""Opening a run store: every way it can fail, as one line that names the store and the fix.

:class:`runstore.store.RunStore` opens its database here, so every command,
the dashboard and every driver of a run say the same thing about a URL that
is not one, a file that is not a database, a folder, a server that does not
answer, or a store that cannot be written or upgraded.
"""

from __future__ import annotations

from pathlib import Path

from sqlalchemy import MetaData
from sqlalchemy.engine import Engine, make_url
from sqlalchemy.exc import ArgumentError, SQLAlchemyError

from core.errors import StoreError
from runstore.schema import make_engine, upgrade

__all__ = ["open_engine", "shown_url"]

_EXAMPLE = "e.g. sqlite:///runs/quorum.db or postgresql+psycopg://USER@HOST/DB"


def shown_url(url: str) -> str:
    """``url`` as it may be printed: its password hidden (only its scheme when it does not parse)."""
    try:
        return make_url(url).render_as_string(hide_password=True)
    except (ArgumentError, ValueError):  # a port that is no number is a ValueError
        scheme, sep, _ = url.partition("://")
        return f"{scheme[:40]}://***" if sep else url[:80] if "@" not in url else "***"


def open_engine(url: str, metadata: MetaData) -> Engine:
    """Return an engine on the store at ``url``, its schema brought to this version's (``runstore/schema.py``).

    Raises
    ------
    StoreError
        One line naming the store (password hidden) and what to do: a URL
        that is not an SQLAlchemy URL or names a driver that is not
        installed, a file that is not an SQLite database, a folder, a path
        that cannot be created or opened, a server that cannot be reached, a
        store written by a newer Quorum or that cannot be upgraded.
    """
    shown = shown_url(url)
    engine = None
    try:
        engine = make_engine(url)
        upgrade(engine, metadata)
    except StoreError:
        _dispose(engine)
        raise
    except (ArgumentError, ValueError) as exc:  # no URL at all, a bad port, a dialect/driver not installed
        _dispose(engine)
        raise StoreError(f"the run store {shown!r} cannot be opened: {_first_line(exc)}; give an SQLAlchemy URL "
                         f"({_EXAMPLE}) with --db or QUORUM_DB") from None
    except (SQLAlchemyError, OSError, ImportError) as exc:
        _dispose(engine)
        raise StoreError(f"the run store {shown} cannot be opened: {_reason(url, exc)}") from None
    return engine


def _reason(url: str, exc: BaseException) -> str:
    """Say what went wrong and the fix, for a store URL that parses."""
    said = _first_line(getattr(exc, "orig", None) or exc)
    path = _sqlite_path(url)
    if path is not None:
        if path.is_dir():
            return f"{path} is a folder, not a database file; name a file in it (sqlite:///{path}/quorum.db)"
        if "not a database" in said:
            return (f"{path} is not an SQLite database ({said}); point --db at the run store, or move that "
                    "file away to start a new one")
        if isinstance(exc, OSError) or "unable to open" in said or "readonly" in said or "read-only" in said:
            return (f"{said}; check that {path.parent} exists and is writable by this user (a new store is "
                    "created there; an existing one is upgraded once, which needs write access)")
        return f"{said}; check the file {path}"
    if isinstance(exc, ImportError):
        return f"{said}; install the database's driver (for PostgreSQL: pip install 'psycopg[binary]')"
    return f"{said}; check that the database server is running and reachable, and the user and password"


def _sqlite_path(url: str) -> Path | None:
    if not url.startswith("sqlite:///") or url == "sqlite:///:memory:":
        return None
    return Path(url.removeprefix("sqlite:///"))


def _first_line(exc: BaseException | object) -> str:
    text = str(exc).strip()
    return (text.splitlines()[0] if text else type(exc).__name__)[:300]


def _dispose(engine: Engine | None) -> None:
    if engine is not None:
        engine.dispose()
