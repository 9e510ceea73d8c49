"""Adaptive clipping: the clip norm follows a quantile of the clients' update norms.

Andrew, Thakkar, McMahan and Ramaswamy, "Differentially Private Learning with
Adaptive Clipping", NeurIPS 2021. Each round every sampled client reports
``b_i = 1[||delta_i|| <= C]``; the server privately estimates the fraction
of clients below ``C``,

    b_bar = (sum_i (b_i - 1/2) + N(0, sigma_b^2)) / m + 1/2,

with ``m`` the expected number of clients per round (a fixed denominator, so
the number who answered is not revealed), and takes a geometric step toward
the target quantile ``gamma``:

    C <- C * exp(-eta * (b_bar - gamma)).

Centring the bits makes the count's sensitivity 1/2, so releasing it and the
update sum together is one Gaussian mechanism with noise multiplier ``z``
when the update noise is raised to ``z_delta = (z^-2 - (2 sigma_b)^-2)^-1/2``
(the paper's Theorem 1): the accountant keeps seeing ``z``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from privacy.dp.errors import DPConfigError

__all__ = ["AdaptiveClipConfig", "update_noise_multiplier", "next_clip", "below_fraction"]


@dataclass(frozen=True)
class AdaptiveClipConfig:
    """Settings of adaptive clipping (Andrew et al. 2021, Algorithm 1).

    Attributes
    ----------
    target_quantile : float
        ``gamma`` in (0, 1): the fraction of updates that should fall under ``C``.
    learning_rate : float
        ``eta_C`` of the geometric update; the paper uses 0.2.
    count_noise_std : float | None
        ``sigma_b``, the std of the noise on the count of clients below ``C``;
        ``None`` picks the paper's default ``m / 20`` (std 0.05 on the fraction).
    """

    target_quantile: float = 0.5
    learning_rate: float = 0.2
    count_noise_std: float | None = None

    def __post_init__(self) -> None:
        """Refuse a target quantile outside (0, 1), a learning rate not positive and finite, or ``sigma_b <= 0``."""
        if not 0 < self.target_quantile < 1:
            raise DPConfigError("target_quantile", self.target_quantile, "must be in (0, 1)")
        if not self.learning_rate > 0 or not math.isfinite(self.learning_rate):
            raise DPConfigError("clip_lr", self.learning_rate, "must be a positive number")
        if self.count_noise_std is not None and not self.count_noise_std > 0:
            raise DPConfigError("count_noise_multiplier", self.count_noise_std, "must be > 0")

    def sigma_b(self, expected_clients: int) -> float:
        """``sigma_b`` for ``expected_clients`` per round."""
        return self.count_noise_std if self.count_noise_std is not None else expected_clients / 20.0


def update_noise_multiplier(z: float, sigma_b: float) -> float:
    """Noise multiplier of the update sum that leaves the pair at effective ``z``.

    Parameters
    ----------
    z : float
        The effective noise multiplier the accountant is given.
    sigma_b : float
        Std of the noise on the centred count (sensitivity 1/2).

    Returns
    -------
    float
        ``(z^-2 - (2 sigma_b)^-2)^(-1/2)``; 0 when ``z`` is 0 (no privacy).

    Raises
    ------
    DPConfigError
        When ``2 sigma_b <= z``: the count alone would spend the whole budget.
    """
    if z == 0:
        return 0.0
    rest = z**-2 - (2.0 * sigma_b) ** -2
    if rest <= 0:
        raise DPConfigError("count_noise_multiplier", sigma_b,
                            f"must exceed noise_multiplier / 2 = {z / 2:g} (Andrew et al. 2021, Theorem 1)")
    return float(rest**-0.5)


def below_fraction(noised_centred_count: float, expected_clients: int) -> float:
    """``b_bar`` from the noised sum of centred bits, with the fixed denominator ``m``."""
    return noised_centred_count / expected_clients + 0.5


def next_clip(clip: float, b_bar: float, config: AdaptiveClipConfig) -> float:
    """One geometric step ``C * exp(-eta * (b_bar - gamma))``."""
    return clip * math.exp(-config.learning_rate * (b_bar - config.target_quantile))
