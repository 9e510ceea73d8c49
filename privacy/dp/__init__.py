"""Client-level differential privacy for federated learning.

DP-FedAvg (McMahan et al., ICLR 2018) as a strategy wrapper, adaptive
clipping (Andrew et al., NeurIPS 2021), central or distributed noise, an RDP
accountant from Google's ``dp-accounting`` with a budget that stops a run,
and sample-level DP-SGD for clients (Abadi et al., CCS 2016).
See ``docs/privacy.md``.

Names are imported lazily, so ``quorum privacy`` and the ClientApp load only
what they use (the accountant library and torch cost seconds to import).
"""

from __future__ import annotations

import importlib
from typing import Any

_HOME = {
    "privacy.dp.accountant": ("RoundEvent", "Sampling", "epsilon_of", "noise_for_epsilon", "plan_epsilon"),
    "privacy.dp.adaptive": ("AdaptiveClipConfig", "update_noise_multiplier"),
    "privacy.dp.build": ("make_dp_strategy",),
    "privacy.dp.dpsgd": ("DP_SGD_METRIC", "dp_sgd_epsilon", "train_client", "train_dp_sgd"),
    "privacy.dp.errors": ("DPConfigError", "DPError", "DPStateError"),
    "privacy.dp.mechanisms": ("ClientDPConfig", "clip_update", "client_payload", "gaussian_noise",
                              "privatize_update"),
    "privacy.dp.rng": ("secure_rng",),
    "privacy.dp.sampling": ("sample_clients",),
    "privacy.dp.state": ("DPState",),
    "privacy.dp.strategy": ("DPFedAvg",),
}
_WHERE = {name: module for module, names in _HOME.items() for name in names}

__all__ = sorted(_WHERE)


def __getattr__(name: str) -> Any:
    module = _WHERE.get(name)
    if module is None:
        raise AttributeError(f"module 'privacy.dp' has no attribute {name!r}")
    return getattr(importlib.import_module(module), name)
