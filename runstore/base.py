"""The declarative base every table of the run store is mapped on (one metadata for alembic)."""

from __future__ import annotations

from sqlalchemy.orm import DeclarativeBase

__all__ = ["Base"]


class Base(DeclarativeBase):
    """The run store's tables: ``runstore.store``'s, ``checkpoints``' chunks, ``devices``, ``accounts``."""
