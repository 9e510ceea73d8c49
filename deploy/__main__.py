"""``python -m deploy aggregator|client ...``: the deployment commands alone."""

from __future__ import annotations

import typer

from deploy.agent_cli import app as client_app
from deploy.cli import app as aggregator_app

app = typer.Typer(no_args_is_help=True, add_completion=False, pretty_exceptions_show_locals=False)
app.add_typer(aggregator_app, name="aggregator")
app.add_typer(client_app, name="client")

if __name__ == "__main__":
    app()
