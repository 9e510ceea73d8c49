"""Privacy for federated learning: secure aggregation (``secagg``) and differential privacy (``dp``)."""
