"""A device's site policy: the rules its data owner sets, enforced on the device before any data is read.

``policy.toml`` (:mod:`clients.policy.spec`) is written by the data owner and
read by the device alone; nothing the aggregator sends changes it. Before a
message touches the node's data, the ClientApp mod
(:func:`clients.policy.mod.policy_mod`) reads what the round asks from what the
device itself received and will do (:mod:`clients.policy.rules`), and answers a
round that breaks a rule with a refusal naming it (``core.replies.refusal``),
which the aggregator records as the client status ``refused``. The rounds a
device trained are counted in a file of its own (:mod:`clients.policy.ledger`).
See docs/security.md, "Site policy".

Import each name from its module; the package itself loads nothing.
"""
