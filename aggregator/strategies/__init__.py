"""Server strategies, one algorithm per file."""

from aggregator.strategies.fedavg import FedAvg
from aggregator.strategies.fedavgm import FedAvgM
from aggregator.strategies.fedopt import FedAdam, FedYogi
from aggregator.strategies.fedprox import FedProx
from core.strategy import ServerState, Strategy

__all__ = ["ServerState", "Strategy", "FedAvg", "FedAvgM", "FedAdam", "FedYogi", "FedProx"]
