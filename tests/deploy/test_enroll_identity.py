"""``quorum client enroll`` issues the secure-aggregation identity and publishes the enrolment directory.

The SuperLink registration is stubbed (``register_key`` answers a node id as
Flower would); what is checked is Quorum's half: the identity key made here
(0600, hex), the device's own public half taken instead, the directory a
device loads with ``--secagg-directory`` (keyed by node id), and revocation
taking the identity out of it.
"""

from __future__ import annotations

import itertools
import json
import os
import stat
from pathlib import Path

import pytest
from typer.testing import CliRunner

from deploy import enroll as enrolling
from deploy.agent_cli import app as client_cli
from deploy.config import AggregatorSpec, DeployConfig
from deploy.errors import EnrollError
from privacy.secagg.identity import DIRECTORY_KEY, IDENTITY_FILE_KEY, policy_from_node_config, public_identity, sign


@pytest.fixture
def config(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> DeployConfig:
    ids = itertools.count(1001)
    monkeypatch.setattr(enrolling, "register_key", lambda _config, _key, _name: next(ids))
    monkeypatch.setattr(enrolling, "unregister_node", lambda _config, _node: None)
    monkeypatch.setattr(enrolling, "node_infos", lambda _config: [])  # the SuperLink's records: none here
    return DeployConfig(aggregator=AggregatorSpec(state_dir=str(tmp_path / "federation")))


def test_enrolling_issues_an_identity_the_published_directory_verifies(config: DeployConfig) -> None:
    # Execute
    a = enrolling.enroll(config, "hospital-a")
    b = enrolling.enroll(config, "hospital-b")

    # Assert: each identity key made here is 0600 hex; the device's node config built from the two
    # files the enrol step prints signs with it, and the directory verifies it under its node id
    directory_file = enrolling.directory_path(config)
    for done in (a, b):
        assert done.secagg_identity is not None
        assert stat.S_IMODE(done.secagg_identity.stat().st_mode) == 0o600
        policy = policy_from_node_config({IDENTITY_FILE_KEY: str(done.secagg_identity),
                                          DIRECTORY_KEY: str(directory_file)})
        assert policy.identity is not None and policy.directory is not None
        assert public_identity(policy.identity).hex() == done.device.secagg_public_key
        message = b"advertisement"
        assert policy.directory.verify(done.device.node_id, sign(policy.identity, message), message)
        other = b if done is a else a
        assert not policy.directory.verify(other.device.node_id, sign(policy.identity, message), message)
    assert len(policy.directory) == 2


def test_a_device_made_identity_is_enrolled_and_a_malformed_or_missing_one_refused(
        config: DeployConfig, tmp_path: Path) -> None:
    # Prepare: the device makes its identity (`quorum client keygen --secagg`); only the .pub travels
    keygen = CliRunner().invoke(client_cli, ["keygen", "--secagg", str(tmp_path / "dev.secagg.key")])
    private = tmp_path / "dev.secagg.key"
    bad = tmp_path / "bad.pub"
    bad.write_text("not hex at all")

    # Execute
    done = enrolling.enroll(config, "phone-1", secagg_public_key=tmp_path / "dev.secagg.key.pub")

    # Assert: nothing private was made on the aggregator; the directory verifies the device's own key
    assert keygen.exit_code == 0, keygen.output
    assert stat.S_IMODE(private.stat().st_mode) == 0o600
    assert done.secagg_identity is None and not list(config.state.keys.glob("phone-1.secagg*"))
    identity = bytes.fromhex(private.read_text().strip())
    policy = policy_from_node_config({DIRECTORY_KEY: str(enrolling.directory_path(config))})
    assert policy.directory is not None
    assert policy.directory.verify(done.device.node_id, sign(identity, b"m"), b"m")
    with pytest.raises(EnrollError, match="64 hex digits"):
        enrolling.enroll(config, "phone-2", secagg_public_key=bad)
    with pytest.raises(EnrollError, match="cannot read"):
        enrolling.enroll(config, "phone-3", secagg_public_key=tmp_path / "missing.pub")
    assert set(enrolling.load_registry(config)) == {"phone-1"}  # refused before anything was registered


def test_revoking_a_device_takes_its_identity_out_of_the_directory(config: DeployConfig) -> None:
    # Prepare
    a = enrolling.enroll(config, "hospital-a")
    enrolling.enroll(config, "hospital-b")

    # Execute
    enrolling.revoke(config, "hospital-b")

    # Assert
    policy = policy_from_node_config({DIRECTORY_KEY: str(enrolling.directory_path(config))})
    assert policy.directory is not None and len(policy.directory) == 1 and a.device.node_id in policy.directory
    assert not (config.state.keys / "hospital-b.secagg.key").exists()


def test_a_revoked_device_is_listed_as_revoked_under_its_name(config: DeployConfig,
                                                              monkeypatch: pytest.MonkeyPatch,
                                                              capsys: pytest.CaptureFixture[str]) -> None:
    # Prepare: two devices, one revoked; the SuperLink lists the revoked one's node as "unregistered"
    from deploy import status

    a = enrolling.enroll(config, "hospital-a")
    b = enrolling.enroll(config, "hospital-b")
    enrolling.revoke(config, "hospital-b")
    config.state.pidfile.parent.mkdir(parents=True, exist_ok=True)
    config.state.pidfile.write_text(json.dumps({"pid": os.getpid(), "device_address": "127.0.0.1:9092"}))
    monkeypatch.setattr(status, "list_nodes", lambda _c: [
        {"node-id": a.device.node_id, "status": "online"}, {"node-id": b.device.node_id, "status": "unregistered"},
        {"node-id": 77, "status": "online"}])

    # Execute
    info = status.collect_status(config)
    status.render_status(info)

    # Assert: revoked, by name; a node enrolled elsewhere is still "(not enrolled here)"
    assert {(n["name"], n["status"]) for n in info["clients"]} == {
        ("hospital-a", "online"), ("hospital-b", "revoked"), ("", "online")}
    table = capsys.readouterr().out
    assert "hospital-b" in table and "revoked" in table and "unregistered" not in table


def test_a_device_enrolled_for_an_organisation_is_recorded_for_the_runs_it_serves(
        config: DeployConfig, monkeypatch: pytest.MonkeyPatch) -> None:
    # Execute: two sites' devices (one through the command line), and one enrolled without an organisation
    monkeypatch.setattr("deploy.config.load_config", lambda _path: config)
    result = CliRunner().invoke(client_cli, ["enroll", "scanner-1", "--org", "north-hospital"])
    enrolling.enroll(config, "scanner-2", org="south-clinic")
    enrolling.enroll(config, "kiosk")

    # Assert: what a submitted run records (deploy.submit's "orgs"), read back from the registry file
    assert result.exit_code == 0, result.output
    assert enrolling.device_orgs(config) == {"scanner-1": "north-hospital", "scanner-2": "south-clinic"}
    assert enrolling.load_registry(config)["kiosk"].org == ""


@pytest.mark.parametrize("org", ["a b", "x\n", "-lead", "é", "o" * 64],
                         ids=["space", "newline", "dash", "accent", "long"])
def test_a_bad_organisation_is_refused_by_name_and_enrols_nothing(config: DeployConfig, org: str) -> None:
    with pytest.raises(EnrollError, match="organisation"):
        enrolling.enroll(config, "scanner-9", org=org)
    assert enrolling.load_registry(config) == {}
