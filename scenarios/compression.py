"""``[compression]``: compressed updates on the way up and a lighter model on the way down.

The encoders themselves are :mod:`core.compress`; this is the section a
scenario file writes and the combinations it refuses, each naming both keys.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal

from scenarios.parse import Bad, at_least, fraction

__all__ = ["CompressionSpec", "check_compression"]


@dataclass(frozen=True)
class CompressionSpec:
    """``[compression]``: the uplink encoder chain (a sparsifier, then ``bits`` per value) and the downlink.

    ``bits`` (1 to 16, or 32 for float32) quantises each sent value with
    unbiased stochastic rounding; ``topk`` keeps that fraction of the update's
    largest magnitudes (their indices travel); ``randomk`` keeps that fraction
    at coordinates drawn from the round's shared seed (nothing about them
    travels; works under secure aggregation and DP). ``error_feedback`` keeps
    what was not sent on the client for its next update; unset, it is on for
    top-k (biased without it) and off otherwise (random-k, rescaled by
    ``d / k``, and stochastic rounding are unbiased, and measured on the
    quickstart the residual only delays their coordinates). ``downlink_bits``
    sends the global model in float16 (16) or per-tensor 8-bit codes (8;
    Quorum's client only).
    """

    bits: int = 32
    topk: float = 0.0
    randomk: float = 0.0
    error_feedback: bool | None = None  # None: on for top-k, off otherwise
    downlink_bits: Literal[8, 16, 32] = 32

    def _check(self) -> None:
        at_least("bits", self.bits, 1)
        if self.bits > 16 and self.bits != 32:
            raise Bad("bits", self.bits, "must be 1 to 16 (quantised values), or 32 (float32, no quantisation)")
        fraction("topk", self.topk, allow_zero=True)
        fraction("randomk", self.randomk, allow_zero=True)
        if self.topk and self.randomk:
            raise Bad("topk", self.topk, f"and randomk = {self.randomk:g} are two sparsifiers: set one to 0")

    @property
    def uplink(self) -> bool:
        """Whether updates travel compressed."""
        return self.bits != 32 or self.topk > 0 or self.randomk > 0

    @property
    def feedback(self) -> bool:
        """Whether clients keep a residual: ``error_feedback``, else on for top-k only."""
        return bool(self.topk) if self.error_feedback is None else self.error_feedback


def check_compression(scenario: Any) -> None:
    """Refuse what compression does not compose with, naming both keys (``scenario``: a Scenario)."""
    spec = scenario.compression
    if scenario.secagg.enabled and spec.topk:
        raise Bad("compression.topk", spec.topk, "[secagg] enabled = true: top-k keeps different coordinates on "
                   "every client, and masks cancel only over the same ones; use compression.randomk")
    if scenario.secagg.enabled and spec.bits != 32:
        raise Bad("compression.bits", spec.bits, "[secagg] enabled = true quantises on its own grid: set "
                   "secagg.bits (16 halves the masked vector) and leave compression.bits = 32")
    if scenario.dp.enabled and spec.uplink and spec.feedback:
        raise Bad("compression.error_feedback", spec.error_feedback, "[dp] enabled = true: the residual (on by "
                   "default for top-k) would carry a client's past updates past the clip, outside what the "
                   "accountant covers; set it to false")
    if scenario.dp.enabled and scenario.dp.adaptive_clipping and (spec.topk or spec.randomk):
        raise Bad("compression.topk" if spec.topk else "compression.randomk", spec.topk or spec.randomk,
                   "dp.adaptive_clipping = true sends its clip bit as one more coordinate, which a sparsifier "
                   "may drop; use a fixed clip_norm")
