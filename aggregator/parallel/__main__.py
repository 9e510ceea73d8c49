"""``python -m aggregator.parallel SCENARIO --nproc N``: the ``quorum parallel`` command on its own."""

import typer

from aggregator.parallel.cli import parallel

typer.run(parallel)
