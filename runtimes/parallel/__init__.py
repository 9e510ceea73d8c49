"""In-cluster data-parallel mode: the federated machinery on ``torch.distributed``.

Inside one organisation's cluster there is no privacy boundary between
workers, so the same scenario, model, data and aggregation core train one
model over many processes or machines (``torchrun``; gloo on CPU). Two modes:

- **sync**: every step, each rank's gradient sum and batch size (the core's
  :class:`~core.aggregate.MeanState`) are all-reduced as one flat buffer and
  finalized into the weighted mean gradient (:mod:`.sync`);
- **localsgd**: the federated round itself, with the ranks as its transport:
  local epochs or steps per client, updates folded and merged through the
  core, the scenario's strategy applied (:mod:`.localsgd`).

Rank 0 commits rounds to the run store (``engine = "parallel"``). See
``docs/parallel.md``. Import each name from its module (``.launch``'s
``launch``, ``.mode``'s ``Mode``, ...): the package itself loads nothing, so
the CLI starts without torch.
"""
