"""FedProx (Li et al., "Federated Optimization in Heterogeneous Networks", MLSys 2020).

The server side is FedAvg; the difference is the proximal term
``mu/2 * ||w - w_global||^2`` that each client adds to its local objective
(``learning.training``). The strategy's part is to send ``mu`` to the clients.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from aggregator.strategies.fedavg import FedAvg
from core.instructions import TrainConfig

__all__ = ["FedProx"]


@dataclass(frozen=True)
class FedProx(FedAvg):
    """FedAvg on the server, the proximal term ``mu`` on the clients."""

    mu: float = 0.01
    name: str = "fedprox"

    def configure_train(self, config: TrainConfig) -> TrainConfig:
        """Clients add the proximal term ``mu/2 ||w - w_t||^2`` (Li et al., MLSys 2020)."""
        return replace(config, proximal_mu=float(self.mu))
