"""Client sampling for DP rounds and the ``quorum privacy`` commands."""

from __future__ import annotations

import json
import warnings

import numpy as np
import pytest

from privacy.dp.accountant import plan_epsilon
from privacy.dp.errors import DPConfigError
from privacy.dp.sampling import sample_clients


def test_poisson_sampling_includes_each_client_with_rate_q(rng: np.random.Generator) -> None:
    # 2000 rounds x 1000 clients at q = 0.05: mean size 50, per-client rate 0.05 +- 5 s.e.
    counts = np.zeros(1000)
    sizes = []
    for _ in range(2000):
        chosen = sample_clients(range(1000), 50, 1000, "poisson", rng)
        counts[chosen] += 1
        sizes.append(len(chosen))
    assert np.mean(sizes) == pytest.approx(50, rel=0.01)
    assert np.std(sizes) > 5  # not a fixed size
    assert abs(counts.mean() / 2000 - 0.05) < 5 * np.sqrt(0.05 * 0.95 / 2e6)


def test_fixed_sampling_needs_the_whole_population(rng: np.random.Generator) -> None:
    chosen = sample_clients([5, 3, 9, 1], 2, 4, "fixed", rng)
    assert len(chosen) == 2 and set(chosen) <= {1, 3, 5, 9} and chosen == sorted(chosen)
    with pytest.raises(DPConfigError, match="poisson"):
        sample_clients([1, 2, 3], 2, 4, "fixed", rng)
    with pytest.raises(DPConfigError, match="population"):
        sample_clients(range(5), 2, 4, "poisson", rng)


def _app():  # typer 0.20 imports a click helper that click 8.5 deprecates
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        from typer.testing import CliRunner

        from privacy.dp.cli import app
    return CliRunner(), app


def test_cli_epsilon_prints_the_planned_spend() -> None:
    runner, app = _app()
    result = runner.invoke(app, ["epsilon", "--rate", "0.1", "--rounds", "100", "--noise", "1.0",
                                 "--delta", "1e-5", "--json"])
    assert result.exit_code == 0, result.output
    figures = json.loads(result.output)
    assert figures["epsilon"] == pytest.approx(plan_epsilon(0.1, 100, 1.0, 1e-5))
    table = runner.invoke(app, ["epsilon", "-q", "0.01", "-t", "500", "-z", "1.0"])
    assert table.exit_code == 0 and "1.653" in table.output


def test_cli_noise_derives_z_and_rejects_bad_input() -> None:
    runner, app = _app()
    result = runner.invoke(app, ["noise", "--epsilon", "2", "--rate", "0.1", "--rounds", "100", "--json"])
    assert result.exit_code == 0, result.output
    figures = json.loads(result.output)
    assert figures["epsilon"] <= 2.0 and figures["noise_multiplier"] == pytest.approx(2.4224, rel=1e-3)
    bad = runner.invoke(app, ["epsilon", "--rate", "1.5", "--rounds", "10", "--noise", "1"])
    assert bad.exit_code == 2 and "rate = 1.5" in bad.output
