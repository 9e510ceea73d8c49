"""Real deployment: the aggregator host, device enrollment, and the submission of runs.

The aggregator host runs the SuperLink behind nginx, the run store and the
dashboard.

The edge side is :mod:`deploy.agent`. Commands: ``quorum aggregator ...``
(:mod:`deploy.cli`) and ``quorum client ...`` (:mod:`deploy.agent_cli`);
``python -m deploy`` offers both without the rest of the CLI.
"""

__all__: list[str] = []
