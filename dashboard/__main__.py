"""``python -m dashboard``: the same command as ``quorum dashboard``, without the rest of the CLI."""

from __future__ import annotations

import typer

from dashboard.cli import app

typer.run(app)
