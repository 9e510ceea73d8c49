"""What a standby aggregator needs to take over: the enrolled devices, from the shared run store.

``deploy.enroll.publish_devices`` copies this host's enrolment (``devices/registry.json``,
the revoked list, and each device's node record as its SuperLink's Control
API lists it) into the run store's ``devices`` table (``runstore/devices.py``):
after each enrolment and revocation, and when an aggregator starts.
``restore_devices`` does the reverse on the host that takes over: it rewrites
the registry, the secure-aggregation directory and the revoked list from the
rows, and inserts each missing node into its own SuperLink's link state with
the same node id and SuperNode public key (revoked ones as ``unregistered``).
The SuperNodes keep the node id they were given when they connected, so they
carry on with the new SuperLink as soon as the front door answers again:
heartbeats, signed requests (``--enable-supernode-auth`` looks the key up)
and the secure-aggregation directory (node id -> identity key) all still hold.

Flower 1.42 keeps its link state in SQLite only, and its Control API assigns
a random node id at registration, with no way to choose one: the rows are
written through Flower's own table model (``flwr.supercore.state.schema``),
between the SuperLink's health check and the start of the front door, while
no device can reach it.
"""

from __future__ import annotations

from collections.abc import Callable
from datetime import UTC, datetime
from pathlib import Path

from deploy.config import DeployConfig
from deploy.enroll import Device, save_registry, write_revoked
from deploy.errors import DeployError
from runstore.devices import DeviceRow, stored_devices
from runstore.store import RunStore

__all__ = ["restore_devices", "restore_nodes"]


def restore_devices(config: DeployConfig, store: RunStore, say: Callable[[str], None] = print) -> tuple[int, int]:
    """Rebuild this host's enrolment from the store's rows; return (devices restored, nodes inserted).

    Nothing happens when the store has no device rows (a store from before
    this revision, or a federation with no device yet): the host's own files
    are published instead (``deploy.enroll.publish_devices``).
    """
    rows = stored_devices(store)
    if not rows:
        return 0, 0
    devices = {r.name: Device(**r.record) for r in rows if r.revoked_at is None}
    save_registry(config, devices)
    write_revoked(config, {int(r.node_id): {"name": r.name, "revoked_at": r.revoked_at}
                           for r in rows if r.revoked_at is not None})
    missing = [r.name for r in rows if not r.node]
    if missing:
        say(f"no SuperLink record of {', '.join(missing)} in the run store: enroll again to let them in here")
    inserted = restore_nodes(config.state.linkstate, [r for r in rows if r.node])
    return len(devices), inserted


def restore_nodes(linkstate: Path, rows: list[DeviceRow]) -> int:
    """Insert the nodes of ``rows`` that the link state at ``linkstate`` lacks; return how many.

    Enrolled nodes go in ``online`` for one heartbeat interval from now, as
    they were when the leader died: the devices reconnect within seconds, but
    a SuperNode whose heartbeats failed during the outage backs off before the
    next one (13 s measured), and the resumed run waits for its devices to be
    online. A device that died with the leader turns ``offline`` once that
    interval passes without its heartbeat (Flower's own rule). Revoked nodes
    go in ``unregistered``; a node the link state knows already is left as it is.

    Raises
    ------
    DeployError
        The link state cannot be written (no SuperLink made it yet, or another schema).
    """
    from flwr.common.constant import HEARTBEAT_DEFAULT_INTERVAL
    from flwr.supercore.constant import NodeStatus
    from flwr.supercore.state.schema.linkstate_models import Node
    from flwr.supercore.utils import uint64_to_int64
    from sqlalchemy import create_engine, select
    from sqlalchemy.exc import SQLAlchemyError
    from sqlalchemy.orm import Session

    engine = create_engine(f"sqlite:///{linkstate}")
    now = datetime.now(UTC)
    try:
        with Session(engine) as s, s.begin():
            known = set(s.scalars(select(Node.node_id)))
            new = []
            for row in rows:
                node_id = uint64_to_int64(int(row.node_id))
                if node_id in known:
                    continue
                n, revoked = row.node, row.revoked_at is not None
                interval = float(n.get("heartbeat_interval") or HEARTBEAT_DEFAULT_INTERVAL)
                new.append(Node(
                    node_id=node_id, owner_aid=n.get("owner_aid"), owner_name=n.get("owner_name"),
                    status=NodeStatus.UNREGISTERED if revoked else NodeStatus.ONLINE,
                    registered_at=n.get("registered_at"), last_activated_at=None if revoked else now.isoformat(),
                    last_deactivated_at=None, unregistered_at=n.get("unregistered_at") or None,
                    online_until=None if revoked else now.timestamp() + interval, heartbeat_interval=interval,
                    public_key=bytes.fromhex(str(n.get("public_key", ""))), location=n.get("location") or None,
                    name=n.get("name") or row.name))
            s.add_all(new)
    except SQLAlchemyError as exc:
        raise DeployError(f"cannot restore the devices' nodes into the SuperLink's state {linkstate}: "
                          f"{getattr(exc, 'orig', exc)}") from None
    finally:
        engine.dispose()
    return len(new)
