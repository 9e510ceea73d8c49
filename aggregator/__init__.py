"""The aggregator: the round loop and FedBuff, training and evaluation, the strategies, and the one ServerApp."""
