"""A tree of aggregators: edges train their own devices and send the aggregator one partial sum each.

``topology.py`` says which edge each device is under, ``edge.py`` is an
edge's part of a round (its devices' sub-round, answered with a partial sum;
its devices' evaluation, answered with their rows), ``tree.py`` the
aggregator's (the train workflow that hands each edge its sampled devices and
merges the edges' sums), ``secure.py`` the secure sum across the edges,
``evaluate.py`` federated evaluation through them. ``docs/hierarchy.md``.
"""
