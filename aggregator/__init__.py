"""The aggregator: the round loop and FedBuff, fit and evaluation, the strategies, and the one ServerApp."""
