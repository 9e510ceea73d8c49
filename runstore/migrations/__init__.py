"""The run store's schema history: alembic revisions (``versions/``), applied on open (runstore/schema.py)."""
