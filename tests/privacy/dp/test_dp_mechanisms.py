"""Clipping, noise and the client side of DP-FedAvg."""

from __future__ import annotations

import numpy as np
import pytest

from core.instructions import DP_CLIP, TrainConfig
from privacy.dp.errors import DPConfigError
from privacy.dp.mechanisms import ClientDPConfig, client_payload, clip_update, gaussian_noise, l2_norm, privatize_update
from privacy.dp.rng import secure_rng


@pytest.mark.parametrize("scale", [1e-3, 0.5, 0.999999, 1.0, 1.000001, 3.0, 1e6])
def test_clipping_never_exceeds_clip(rng: np.random.Generator, scale: float) -> None:
    # Prepare: 200 random directions with norm exactly `scale` * C, C = 0.7
    clip = 0.7
    for _ in range(200):
        v = rng.standard_normal(1000).astype(np.float32)
        v *= np.float32(scale * clip / np.linalg.norm(v.astype(np.float64)))
        # Execute
        clipped, norm = clip_update(v, clip)
        # Assert: float64 norm of the float32 result is inside the ball
        assert np.linalg.norm(clipped.astype(np.float64)) <= clip
        assert norm == pytest.approx(scale * clip, rel=1e-5)


def test_clipping_keeps_short_updates_and_direction() -> None:
    short = np.array([0.3, 0.4], dtype=np.float32)  # norm 0.5
    long = np.array([3.0, 4.0], dtype=np.float32)  # norm 5
    kept, _ = clip_update(short, 1.0)
    cut, norm = clip_update(long, 1.0)
    np.testing.assert_array_equal(kept, short)
    assert norm == 5.0
    np.testing.assert_allclose(cut, [0.6, 0.8], rtol=1e-5)
    zero, zero_norm = clip_update(np.zeros(4, dtype=np.float32), 1.0)
    assert zero_norm == 0.0 and not zero.any()


def test_l2_norm_accumulates_in_float64() -> None:
    v = np.full(10_000_000, 0.1, dtype=np.float32)
    assert l2_norm(v) == pytest.approx(np.sqrt(1e7) * float(np.float32(0.1)), rel=1e-12)


def test_noise_std_matches_z_times_c(rng: np.random.Generator) -> None:
    # 100k draws: the sample std's relative standard error is 1/sqrt(2 * 1e5) = 0.22%,
    # so a 3% tolerance is more than 13 standard errors wide.
    z, clip = 1.3, 0.8
    noise = gaussian_noise(100_000, z * clip, rng)
    assert noise.dtype == np.float32
    assert float(noise.std()) == pytest.approx(z * clip, rel=0.03)
    assert abs(float(noise.mean())) < 5 * z * clip / np.sqrt(100_000)
    assert not gaussian_noise(10, 0.0, rng).any()


def test_privatize_update_clips_then_adds_noise(rng: np.random.Generator) -> None:
    delta = np.full(50_000, 1.0, dtype=np.float32)  # norm ~ 223.6
    private, norm, below = privatize_update(delta, 2.0, 0.01, rng)
    assert norm == pytest.approx(np.sqrt(50_000)) and not below
    residual = private - delta * np.float32(2.0 / np.sqrt(50_000))
    assert float(residual.std()) == pytest.approx(0.01, rel=0.03)
    assert delta[0] == 1.0  # the input is untouched


def test_client_payload_appends_centred_bit_when_adaptive(rng: np.random.Generator) -> None:
    delta = np.array([0.3, 0.4], dtype=np.float32)  # norm 0.5
    below = client_payload(delta, ClientDPConfig(clip=1.0, adaptive=True), rng)
    above = client_payload(delta, ClientDPConfig(clip=0.1, adaptive=True), rng)
    plain = client_payload(delta, ClientDPConfig(clip=1.0), rng)
    assert below.shape == (3,) and below[-1] == 0.5
    assert above[-1] == -0.5 and np.linalg.norm(above[:2]) <= 0.1
    assert plain.shape == (2,)
    assert client_payload(delta, None, rng) is delta


def test_client_config_roundtrips_through_config_keys() -> None:
    config = ClientDPConfig(clip=0.5, noise_std=0.1, adaptive=True, count_noise_std=0.2)
    base = TrainConfig(round=1, epochs=1, batch_size=1, lr=0.1, seed=0)
    assert ClientDPConfig.from_config(base.with_settings(config.to_settings())) == config
    assert ClientDPConfig.from_config(base) is None
    with pytest.raises(DPConfigError, match="dp-clip"):
        ClientDPConfig.from_config(base.with_settings({DP_CLIP: -1.0}))


def test_secure_rng_streams_are_independent() -> None:
    a, b = secure_rng(), secure_rng()
    assert isinstance(a.bit_generator, np.random.PCG64DXSM)
    assert not np.array_equal(a.integers(0, 2**63, 4), b.integers(0, 2**63, 4))
