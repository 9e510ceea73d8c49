"""Real deployment: the aggregator host (SuperLink behind nginx, run store,
dashboard), device enrollment, and the submission of runs.

The edge side is :mod:`clients.agent`. Commands: ``quorum aggregator ...``
(:mod:`aggregator.deploy.cli`) and ``quorum client ...`` (:mod:`clients.agent_cli`);
``python -m aggregator.deploy`` offers both without the rest of the CLI.
"""

__all__: list[str] = []
