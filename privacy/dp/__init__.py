"""Client-level differential privacy for federated learning.

DP-FedAvg (McMahan et al., ICLR 2018) as a strategy wrapper, adaptive
clipping (Andrew et al., NeurIPS 2021), central or distributed noise, an RDP
accountant from Google's ``dp-accounting`` with a budget that stops a run,
and sample-level DP-SGD for clients (Abadi et al., CCS 2016).
See ``docs/privacy.md``.

Import each name from its module (``privacy.dp.strategy``'s ``DPFedAvg``,
``privacy.dp.accountant``'s ``plan_epsilon``, ...): the package itself loads
nothing, so ``quorum privacy`` and the ClientApp load only what they use (the
accountant library and torch cost seconds to import).
"""
