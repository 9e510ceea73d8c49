"""Server strategies, one algorithm per file."""

from aggregator.strategies.buffered import BufferedStrategy
from aggregator.strategies.centered_clipping import CenteredClipping
from aggregator.strategies.fedavg import FedAvg
from aggregator.strategies.fedavgm import FedAvgM
from aggregator.strategies.fedopt import FedAdagrad, FedAdam, FedYogi
from aggregator.strategies.fedprox import FedProx
from aggregator.strategies.krum import Krum
from aggregator.strategies.median import FedMedian
from aggregator.strategies.scaffold import Scaffold
from aggregator.strategies.trimmed_mean import FedTrimmedMean
from core.strategy import ServerState, Strategy

__all__ = ["ServerState", "Strategy", "FedAvg", "FedAvgM", "FedAdam", "FedYogi", "FedAdagrad", "FedProx", "Scaffold",
           "BufferedStrategy", "CenteredClipping", "FedMedian", "FedTrimmedMean", "Krum"]
