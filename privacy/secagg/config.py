"""Configuration of secure aggregation: one frozen, validated dataclass.

The defaults follow the two papers the protocol comes from: a majority
threshold ``t = floor(m/2) + 1`` of each neighbourhood of size ``m``
(Bonawitz et al., CCS 2017), and for the sparse variant a random Harary graph
of degree ``k = ceil(3 log2 n)`` (Bell et al., "Secure Single-Server
Aggregation with (Poly)Logarithmic Overhead", CCS 2020, eprint 2020/704).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TypeGuard

from privacy.secagg.errors import SecAggConfigError
from privacy.secagg.prg import RING_BITS

__all__ = ["GRAPH_KINDS", "THREAT_MODELS", "SecAggConfig", "is_majority", "majority_threshold"]

GRAPH_KINDS = ("complete", "kregular")
THREAT_MODELS = ("semi-honest", "malicious")


def majority_threshold(size: int) -> int:
    """Return the smallest strict majority ``floor(m/2) + 1`` of a neighbourhood of ``size`` clients."""
    return size // 2 + 1


def is_majority(threshold: int, size: int) -> bool:
    """``2t > m``: the one rule the server (config) and every client (setup check) apply.

    Below it a server that tells half a neighbourhood that ``u`` survived and
    the other half that ``u`` dropped collects ``t`` shares of both of ``u``'s
    secrets and unmasks ``u``'s input (Bell et al., CCS 2020, require
    ``t > k/2`` against a malicious server).
    """
    return 2 * threshold > size


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_real(value: object) -> TypeGuard[int | float]:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


@dataclass(frozen=True)
class SecAggConfig:
    """Parameters of secure aggregation, fixed for a run.

    Parameters
    ----------
    threshold : int | float | None
        Shamir threshold ``t``: how many shares rebuild a secret. An ``int``
        is used as is; a ``float`` in (0, 1] is a fraction of the
        neighbourhood size (``t = max(2, ceil(f * m))``); ``None`` means a
        strict majority ``floor(m/2) + 1``. ``m`` is ``n`` for the complete
        graph and ``degree + 1`` for the k-regular one. A ``t`` with
        ``2t <= m`` is refused unless ``threat_model = "semi-honest"``.
    graph : {"complete", "kregular"}
        Who shares secrets and masks with whom: everyone (Bonawitz et al.) or
        a random k-regular Harary graph (Bell et al., SecAgg+).
    degree : int | None
        Neighbours per client for ``"kregular"``; ``None`` picks
        ``ceil(3 log2 n)``. Clamped to ``n - 1`` (the complete graph) and
        raised by one where ``n * k`` would be odd.
    clip_range : float
        Each coordinate is clipped to ``[-clip_range, clip_range]`` before
        quantisation.
    bits : {16, 32, 64}
        Width of the ring ``Z_{2^bits}`` the masked vectors live in (16
        halves the bytes of 32, with ``2^15 / n`` quantisation steps per
        client over the clip range instead of ``2^31 / n``).
    max_weight : float
        Weight cap: a client's weight ``w`` (e.g. its example count) is sent
        as ``min(w / max_weight, 1)``; results are scaled back. The default
        follows Flower's SecAgg+; the error bound grows with it, so set it
        near the largest weight expected (1.0 for unit weights).
    stage_timeout_s : float
        Deadline of each stage in the Flower workflow.
    client_metrics : bool
        Whether clients send their training metrics (example count, loss,
        duration) in clear next to the masked vector. ``False``: the server
        learns the weighted sum, the sum of weights and who took part, and
        nothing per client.
    threat_model : {"malicious", "semi-honest"}
        ``"malicious"`` (default): signed key advertisements checked against
        an enrolment directory, and a consistency-check round before any
        share is revealed (Bonawitz et al., CCS 2017, Sec. 6); thresholds
        must be a strict majority. ``"semi-honest"``: neither, and any
        threshold ``>= 2`` is allowed.
    """

    threshold: int | float | None = None
    graph: str = "complete"
    degree: int | None = None
    clip_range: float = 1.0
    bits: int = 32
    max_weight: float = 1000.0
    stage_timeout_s: float = 60.0
    client_metrics: bool = True
    threat_model: str = "malicious"

    def __post_init__(self) -> None:
        """Refuse an invalid setting, naming it (:class:`SecAggConfigError`)."""
        self._check_threshold()
        if self.graph not in GRAPH_KINDS:
            raise SecAggConfigError("graph", self.graph, f"must be one of {GRAPH_KINDS}")
        if self.degree is not None and not (_is_int(self.degree) and self.degree >= 2):
            raise SecAggConfigError("degree", self.degree, "must be None or an int >= 2")
        self._check_positive("clip_range", self.clip_range)
        if self.bits not in RING_BITS or not _is_int(self.bits):
            raise SecAggConfigError("bits", self.bits, "must be 16, 32 or 64")
        self._check_positive("max_weight", self.max_weight)
        self._check_positive("stage_timeout_s", self.stage_timeout_s)
        if not isinstance(self.client_metrics, bool):
            raise SecAggConfigError("client_metrics", self.client_metrics, "must be true or false")
        if self.threat_model not in THREAT_MODELS:
            raise SecAggConfigError("threat_model", self.threat_model, f"must be one of {THREAT_MODELS}")
        if isinstance(self.threshold, float) and self.threshold <= 0.5 and self.threat_model != "semi-honest":
            raise SecAggConfigError("threshold", self.threshold,
                                    "a fraction <= 0.5 is no strict majority; needs threat_model='semi-honest'")

    def _check_threshold(self) -> None:
        value = self.threshold
        if value is None:
            return
        if _is_int(value):
            if value < 2:
                raise SecAggConfigError("threshold", value, "an int threshold must be >= 2")
            return
        if isinstance(value, float) and 0.0 < value <= 1.0:
            return
        raise SecAggConfigError("threshold", value, "must be None, an int >= 2 or a float in (0, 1]")

    @staticmethod
    def _check_positive(name: str, value: object) -> None:
        if not (_is_real(value) and math.isfinite(float(value)) and float(value) > 0):
            raise SecAggConfigError(name, value, "must be a finite number > 0")

    def degree_for(self, participants: int) -> int:
        """Resolve the number of neighbours per client for ``participants`` clients."""
        if participants < 2:
            raise SecAggConfigError("participants", participants, "need at least 2 clients")
        full = participants - 1
        if self.graph == "complete":
            return full
        wanted = self.degree if self.degree is not None else math.ceil(3 * math.log2(participants))
        degree = min(wanted, full)
        if (degree * participants) % 2:
            degree = degree + 1 if degree < full else degree - 1
        return degree

    def threshold_for(self, participants: int) -> int:
        """Resolve the Shamir threshold ``t`` for ``participants`` clients."""
        size = self.degree_for(participants) + 1
        value = self.threshold
        if value is None:
            t = majority_threshold(size)
        elif isinstance(value, float):
            t = max(2, math.ceil(value * size))
        else:
            t = value
        if t > size:
            raise SecAggConfigError(
                "threshold", value,
                f"t={t} exceeds the neighbourhood size {size} for {participants} participants",
            )
        if not is_majority(t, size) and self.threat_model != "semi-honest":
            raise SecAggConfigError(
                "threshold", value,
                f"t={t} is not a strict majority of the neighbourhood size {size} "
                f"({participants} participants); a lower threshold needs threat_model='semi-honest'",
            )
        return t
