"""Real deployment: the aggregator host (SuperLink behind nginx, run store,
dashboard), device enrollment, and the submission of runs.

The edge side is :mod:`deploy.agent`. Commands: ``quorum aggregator ...``
(:mod:`deploy.cli`) and ``quorum client ...`` (:mod:`deploy.agent_cli`);
``python -m deploy`` offers both without the rest of the CLI.
"""

__all__: list[str] = []
