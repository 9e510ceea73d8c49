"""Where a federation runs: in-process grids, Flower's Ray simulation, and in-cluster data parallelism.

:mod:`runtimes.simulation` runs a scenario in this process or on Ray,
:mod:`runtimes.flower_app` runs a stock Flower app under Quorum's ServerApp,
and :mod:`runtimes.parallel` trains one model over ``torch.distributed``.
"""
