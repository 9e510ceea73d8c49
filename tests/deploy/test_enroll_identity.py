"""``quorum client enroll`` issues the secure-aggregation identity and publishes the enrolment directory.

The SuperLink registration is stubbed (``register_key`` answers a node id as
Flower would); what is checked is Quorum's half: the identity key made here
(0600, hex), the device's own public half taken instead, the directory a
device loads with ``--secagg-directory`` (keyed by node id), and revocation
taking the identity out of it.
"""

from __future__ import annotations

import itertools
import stat
from pathlib import Path

import pytest

from deploy import enroll as enrolling
from deploy.config import AggregatorSpec, DeployConfig
from deploy.errors import EnrollError
from privacy.secagg.identity import DIRECTORY_KEY, IDENTITY_FILE_KEY, policy_from_node_config, public_identity, sign


@pytest.fixture
def config(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> DeployConfig:
    ids = itertools.count(1001)
    monkeypatch.setattr(enrolling, "register_key", lambda config, key, name: next(ids))
    monkeypatch.setattr(enrolling, "unregister_node", lambda config, node: None)
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


def test_a_devices_own_public_identity_is_enrolled_and_a_malformed_one_refused(
        config: DeployConfig, tmp_path: Path) -> None:
    # Prepare
    own = bytes(range(32))
    good, bad = tmp_path / "own.pub", tmp_path / "bad.pub"
    good.write_text(public_identity(own).hex() + "\n")
    bad.write_text("not hex at all")

    # Execute
    done = enrolling.enroll(config, "phone-1", secagg_public_key=good)

    # Assert: nothing private was made here; the directory holds the device's key
    assert done.secagg_identity is None
    policy = policy_from_node_config({DIRECTORY_KEY: str(enrolling.directory_path(config))})
    assert policy.directory is not None and policy.directory.verify(done.device.node_id, sign(own, b"m"), b"m")
    with pytest.raises(EnrollError, match="64 hex digits"):
        enrolling.enroll(config, "phone-2", secagg_public_key=bad)
    assert "phone-2" not in enrolling.load_registry(config)  # refused before anything was registered


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
