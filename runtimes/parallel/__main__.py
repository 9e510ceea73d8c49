"""``python -m runtimes.parallel SCENARIO --nproc N``: the ``quorum parallel`` command on its own."""

import typer

from runtimes.parallel.cli import parallel

typer.run(parallel)
