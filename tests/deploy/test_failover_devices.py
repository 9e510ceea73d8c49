"""The enrolled devices through the run store: enrolled on one host, restored on another that never saw them.

Flower's own link state runs in process (``flwr.superlink.config_loader``, the
SuperLink's SQLite state class) on each "host": enrolment registers keys in the
first one as the Control API would, publishes to the shared store; a second
host's state folder and a fresh link state are rebuilt from the store only, and
Flower's own queries there (a node by its public key, a heartbeat) must treat
the devices as the first did.
"""

from __future__ import annotations

import json
import warnings
from pathlib import Path
from typing import Any

import pytest
from flwr.common.constant import NOOP_ACCOUNT_NAME, NOOP_FLWR_AID
from flwr.supercore.constant import NodeStatus

from deploy import enroll as enrolling
from deploy.config import AggregatorSpec, DeployConfig
from deploy.enroll import directory_path, load_registry, revoked_devices
from deploy.failover import restore_devices, restore_nodes
from deploy.pki import load_public_key
from runstore.devices import stored_devices
from runstore.store import RunStore


def _link_state(path: Path) -> Any:
    from flwr.superlink.config_loader import get_objectstore_linkstate_factories
    from flwr.superlink.federation import NoOpFederationManager

    with warnings.catch_warnings():  # Flower's own alembic set-up warns of alembic's deprecations: not ours
        warnings.simplefilter("ignore", DeprecationWarning)
        return get_objectstore_linkstate_factories(str(path), NoOpFederationManager())[1].state()


def _key_bytes(public: Path) -> bytes:
    from flwr.cli.supernode.register import try_load_public_key

    return bytes(try_load_public_key(public))


@pytest.fixture
def first_host(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> tuple[DeployConfig, Any]:
    """A host whose SuperLink is Flower's link state in process, on a run store shared with other hosts."""
    state = _link_state(tmp_path / "host-a-linkstate.db")

    def register(_config: DeployConfig, public: Path, name: str) -> int:
        return int(state.create_node(NOOP_FLWR_AID, NOOP_ACCOUNT_NAME, _key_bytes(public), 30.0, name=name))

    monkeypatch.setattr(enrolling, "register_key", register)
    monkeypatch.setattr(enrolling, "unregister_node", lambda _c, node: state.delete_node(NOOP_FLWR_AID, node))
    monkeypatch.setattr(enrolling, "node_infos", lambda _c: list(state.get_node_info()))
    store = f"sqlite:///{tmp_path / 'shared.db'}"
    return DeployConfig(aggregator=AggregatorSpec(state_dir=str(tmp_path / "host-a"), database=store)), state


def test_a_second_host_rebuilds_the_enrolment_and_its_superlink_lets_the_same_keys_in(
        first_host: tuple[DeployConfig, Any], tmp_path: Path) -> None:
    # Prepare: three devices enrolled on the first host, one of them revoked there
    config, _ = first_host
    made = {n: enrolling.enroll(config, n) for n in ("ward-1", "ward-2", "ward-3")}
    enrolling.revoke(config, "ward-3")
    second = DeployConfig(aggregator=AggregatorSpec(state_dir=str(tmp_path / "host-b"),
                                                    database=config.aggregator.database))
    second.state.linkstate.parent.mkdir(parents=True)
    link_b = _link_state(second.state.linkstate)  # its SuperLink's state, made at its start

    # Execute: the second host restores from the store alone
    with RunStore(config.db_url) as store:
        rows = stored_devices(store)
        devices, inserted = restore_devices(second, store, say=lambda _m: None)

    # Assert: the store holds each device with the SuperLink's record of it, revoked ones marked
    assert {r.name: r.revoked_at is not None for r in rows} == {"ward-1": False, "ward-2": False, "ward-3": True}
    assert devices == 2 and inserted == 3
    # ... the second host's files say what the first's say
    assert load_registry(second) == load_registry(config)
    assert json.loads(directory_path(second).read_text()) == json.loads(directory_path(config).read_text())
    assert revoked_devices(second) == {made["ward-3"].device.node_id: "ward-3"}
    # ... and its SuperLink knows each enrolled key under the node id the first host gave it, online, while
    # the revoked key is refused there too
    for name in ("ward-1", "ward-2"):
        device = made[name].device
        public = config.state.keys / f"{name}.key.pub"
        load_public_key(public.read_text())
        assert link_b.get_node_id_by_public_key(_key_bytes(public)) == device.node_id
        (info,) = link_b.get_node_info(node_ids=[device.node_id])
        assert info.status == NodeStatus.ONLINE and info.name == name
        assert link_b.acknowledge_node_heartbeat(device.node_id, 30.0)
    revoked_id = made["ward-3"].device.node_id
    (gone,) = link_b.get_node_info(node_ids=[revoked_id])
    assert gone.status == NodeStatus.UNREGISTERED
    assert not link_b.acknowledge_node_heartbeat(revoked_id, 30.0)


def test_restoring_twice_adds_nothing_and_keeps_what_the_superlink_learned(
        first_host: tuple[DeployConfig, Any], tmp_path: Path) -> None:
    # Prepare: one device restored into a fresh link state, which then sees it go offline
    config, _ = first_host
    device = enrolling.enroll(config, "ward-1").device
    target = tmp_path / "host-b-linkstate.db"
    link_b = _link_state(target)
    with RunStore(config.db_url) as store:
        assert restore_nodes(target, stored_devices(store)) == 1
        link_b.deactivate_node(device.node_id)

        # Execute
        again = restore_nodes(target, stored_devices(store))

    # Assert: nothing inserted, the node's own state left as the SuperLink wrote it
    assert again == 0
    (info,) = link_b.get_node_info(node_ids=[device.node_id])
    assert info.status == NodeStatus.OFFLINE


def test_an_empty_store_restores_nothing_and_leaves_the_hosts_files_alone(tmp_path: Path) -> None:
    config = DeployConfig(aggregator=AggregatorSpec(state_dir=str(tmp_path / "host")))
    config.state.registry.parent.mkdir(parents=True)
    config.state.registry.write_text("{}")
    with RunStore(config.db_url) as store:
        assert restore_devices(config, store, say=lambda _m: None) == (0, 0)
    assert config.state.registry.read_text() == "{}"
