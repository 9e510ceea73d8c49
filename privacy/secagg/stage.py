"""The stages of one secure-aggregation round.

The stage names follow Bonawitz et al., "Practical Secure Aggregation for
Privacy-Preserving Machine Learning", CCS 2017 (eprint 2017/281), Fig. 4:
AdvertiseKeys, ShareKeys, MaskedInputCollection, ConsistencyCheck (only
against an active adversary, ``threat_model = "malicious"``) and Unmasking. The string
values travel on the wire (the ``"stage"`` key of the ``"secagg"``
ConfigRecord) and are what fault injectors match on, so they never change.
"""

from __future__ import annotations

from enum import Enum

__all__ = ["STAGE_ORDER", "Stage"]


class Stage(Enum):
    """A protocol stage; the value is the wire name."""

    ADVERTISE_KEYS = "advertise_keys"
    SHARE_KEYS = "share_keys"
    MASKED_INPUT = "masked_input"
    CONSISTENCY_CHECK = "consistency_check"
    UNMASK = "unmask"


STAGE_ORDER: tuple[Stage, ...] = (
    Stage.ADVERTISE_KEYS,
    Stage.SHARE_KEYS,
    Stage.MASKED_INPUT,
    Stage.CONSISTENCY_CHECK,
    Stage.UNMASK,
)
