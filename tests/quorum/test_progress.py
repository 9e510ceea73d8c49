"""``quorum simulate``'s per-round line: a round, or an asynchronous step with its virtual time."""

from __future__ import annotations

import pytest

from core.headline import Headline
from core.records import ClientRecord, RoundRecord
from quorum.progress import RoundDisplay
from tests.conftest import tiny_scenario


@pytest.mark.parametrize(("metrics", "start", "extra"), [
    ({"status": "ok"}, "round   3", None),
    ({"status": "ok", "virtual-time-s": 12.34, "staleness-max": 4}, "step    3", "virtual 12.3s, staleness max 4"),
])
def test_a_line_names_a_round_or_a_step(metrics: dict, start: str, extra: str | None,
                                        capsys: pytest.CaptureFixture[str]) -> None:
    # Prepare
    record = RoundRecord(round=3, started_at=0.0, duration_s=1.5, sampled=2, server_accuracy=0.5, server_loss=1.0,
                         clients=[ClientRecord("1", "ok"), ClientRecord("2", "dropped")], metrics=metrics)

    # Execute
    with RoundDisplay(tiny_scenario(rounds=5)) as display:
        display.update(record)

    # Assert (rich wraps at the console width: compare with the whitespace folded)
    text = " ".join(capsys.readouterr().err.split())
    assert " ".join(start.split()) + " loss 1.0000" in text and "acc 50.00%" in text
    assert "clients 1/2 answered, 1 dropped (client 2)" in text
    assert (extra in text) if extra else ("virtual" not in text)


def test_a_line_names_each_failed_and_rejected_client_with_its_reason(capsys: pytest.CaptureFixture[str]) -> None:
    # Prepare: one client answered, one's task raised, one's reply was refused, one never answered
    clients = [ClientRecord("1", "ok"), ClientRecord("3", "failed", reason="DataError: no label column 'label'"),
               ClientRecord("2", "rejected", reason="update holds NaN or Inf values [x]"),
               ClientRecord("4", "dropped", reason="no reply within 60 s")]
    record = RoundRecord(round=1, started_at=0.0, duration_s=1.0, sampled=4, clients=clients, metrics={})

    # Execute
    with RoundDisplay(tiny_scenario(rounds=1)) as display:
        display.update(record)

    # Assert: every count that is not zero, each with its clients; a reason's brackets are no rich markup
    text = " ".join(capsys.readouterr().err.split())
    assert ("clients 1/4 answered, 1 dropped (client 4), 1 rejected: client 2 update holds NaN or Inf values [x], "
            "1 failed: client 3 DataError: no label column 'label'") in text


def test_a_line_leads_with_the_tasks_headline_then_its_other_scores(capsys: pytest.CaptureFixture[str]) -> None:
    # Prepare: a regression round scored on the server (mae, rmse, r2) and on the clients (mae only)
    record = RoundRecord(round=2, started_at=0.0, duration_s=1.0, sampled=1, server_loss=0.25, fed_loss=0.5,
                         clients=[ClientRecord("1", "ok")],
                         metrics={"server-mae": 12.5, "server-rmse": 15.25, "server-r2": 0.4, "fed-mae": 14.0,
                                  "server-epsilon": 2.0, "eval-bytes-in": 10})

    # Execute
    with RoundDisplay(tiny_scenario(rounds=2), headline=Headline("mae", "down")) as display:
        display.update(record)

    # Assert: the server's scores (its split comes first), no accuracy, nothing that is no task score
    text = " ".join(capsys.readouterr().err.split())
    assert "round 2 loss 0.2500 mae 12.50 (fed 14.00) r2 0.4000 rmse 15.25 train-loss" in text
    assert "acc" not in text and "epsilon" not in text


def test_a_line_shows_the_federated_headline_beside_the_servers(capsys: pytest.CaptureFixture[str]) -> None:
    # Prepare: a round scored on the server (91.2 %) and by the clients (89.75 %)
    record = RoundRecord(round=1, started_at=0.0, duration_s=1.0, sampled=1, server_accuracy=0.912, server_loss=0.3,
                         fed_accuracy=0.8975, fed_loss=0.35, clients=[ClientRecord("1", "ok")], metrics={})

    # Execute
    with RoundDisplay(tiny_scenario(rounds=1)) as display:
        display.update(record)

    # Assert
    assert "acc 91.20% (fed 89.75%)" in " ".join(capsys.readouterr().err.split())


@pytest.mark.parametrize(("value", "shown"), [
    (0.73, "0.7300"), (12.5, "12.50"), (1000.0, "1000"), (1234.5, "1234"), (12345.0, "1.234e+04"),
    (0.000123456, "0.0001235"), (-2.0, "-2.000"), (0.0, "0.000"), (float("nan"), "-"), (None, "-"),
])
def test_a_score_keeps_its_four_significant_digits(value: float | None, shown: str) -> None:
    from core.headline import format_value

    assert format_value("mae", value) == shown
    assert format_value("accuracy", 0.5) == "50.00%"
