"""Run the ``quorum`` command line: ``python -m quorum``."""

from quorum.cli import main

main()
