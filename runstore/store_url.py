"""Where the run store lives by default, apart from the store itself.

Every command names the default store in its ``--help``; importing
:mod:`runstore.store` for that (SQLAlchemy, numpy, Flower's records) cost
each ``quorum`` process about 0.7 s of start-up before it did anything.
"""

from __future__ import annotations

from pathlib import Path

__all__ = ["default_db_url"]


def default_db_url(directory: str | Path = "runs") -> str:
    """Return the default store's URL: ``quorum.db`` in ``directory`` (``runs/`` under the working directory)."""
    return f"sqlite:///{Path(directory) / 'quorum.db'}"
