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
    assert "round 2 loss 0.2500 mae 12.5 r2 0.4 rmse 15.25 train-loss" in text
    assert "acc" not in text and "epsilon" not in text
