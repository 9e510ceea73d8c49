"""The aggregation core: the aggregation monoid, robust-rule buffers, the wire format and the ``Strategy`` interface.

The lowest layer: it imports none of Quorum's other packages (docs/architecture.md).
"""
