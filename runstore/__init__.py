"""A run's record: the run store (SQLAlchemy models and queries), a run's lease, and its report.

Low in the layers (only ``core`` below): every driver of a run (the round
loop, FedBuff, the data-parallel mode, the deployment's ServerApp), the
dashboard and the command line read and write runs through this package.
Nothing is imported here: ``quorum --help`` reads ``runstore.store_url`` without
loading SQLAlchemy. (Not ``runs/``: that is the run store's default data
folder, ``runs/quorum.db``, beside the checkout's packages.)
"""
