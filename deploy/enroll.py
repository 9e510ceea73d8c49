"""Enrolling and revoking devices: keys registered with the SuperLink, and who is who.

A device is known by a name and an ECDSA P-384 public key. Enrolling
registers the key with the SuperLink (``flwr supernode register``, over the
loopback Control API), which assigns the device's node id and keeps both in
its database; Quorum keeps ``devices/registry.json`` beside it so that runs
and the dashboard can say ``hospital-a`` rather than ``1448...``.

Best practice is for the device to make its own key (``ssh-keygen -t ecdsa
-b 384 -f device.key`` or ``quorum client keygen``) and send only the public
half; ``enroll NAME`` without ``--public-key`` makes the pair here instead,
for a trial or a device that cannot.

Enrolling also registers the device's secure-aggregation identity (an
Ed25519 key, separate from the SuperNode key Flower uses for node
authentication): best made on the device (``quorum client keygen --secagg``)
and enrolled with ``--secagg-public-key``; without it the pair is made here,
and the aggregator host then holds a key that can sign for that device
until it is deleted. It republishes the enrolment directory ``devices/secagg-directory.json``
(``node id -> public key``) that every device checks its neighbours'
signatures against (``quorum client start --secagg-directory``). Whoever can
write that file can add Sybil clients: hand it to the devices out of band
(docs/secagg.md).
"""

from __future__ import annotations

import json
import os
import re
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from deploy.config import DeployConfig
from deploy.errors import EnrollError
from deploy.flower import node_infos, register_key, unregister_node
from deploy.pki import load_public_key, make_node_key, public_key_fingerprint
from privacy.secagg.identity import IdentityDirectory, write_identity
from runstore.devices import DeviceRow, save_devices
from runstore.store import RunStore

__all__ = ["write_atomically", "Device", "Enrolled", "enroll", "revoke", "load_registry", "save_registry",
           "device_names", "device_orgs", "directory_path", "revoked_entries", "write_revoked", "revoked_devices",
           "publish_devices"]

_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]{0,62}")  # whole names only (fullmatch: no trailing newline)


@dataclass(frozen=True)
class Device:
    """One enrolled device as the registry records it: its name, node id, public keys and when it enrolled."""

    name: str
    node_id: int
    fingerprint: str
    public_key: str
    enrolled_at: float
    key_made_here: bool
    secagg_public_key: str = ""  # hex of its Ed25519 secure-aggregation identity ("" in older registries)
    org: str = ""  # the organisation (site) that owns it: its accounts see its per-client rows ("": admins only)


@dataclass(frozen=True)
class Enrolled:
    """What an enrolment made: the device's record and the private key files made here, if any."""

    device: Device
    private_key: Path | None   # only when the pair was made here: copy it to the device, then delete it
    secagg_identity: Path | None = None  # likewise, the secure-aggregation identity made here (hex, 0600)


def directory_path(config: DeployConfig) -> Path:
    """Return the path of the published secure-aggregation enrolment directory (``node id -> hex public key``)."""
    return config.state.registry.parent / "secagg-directory.json"


def _revoked_path(config: DeployConfig) -> Path:
    return config.state.registry.parent / "revoked.json"


def revoked_entries(config: DeployConfig) -> dict[int, dict[str, Any]]:
    """Node id -> ``{"name", "revoked_at"}`` of each device revoked here (``devices/revoked.json``)."""
    path = _revoked_path(config)
    if not path.exists():
        return {}
    return {int(node): dict(entry) for node, entry in json.loads(path.read_text()).items()}


def write_revoked(config: DeployConfig, entries: dict[int, dict[str, Any]]) -> None:
    """Write ``devices/revoked.json`` (atomically) with ``entries`` (:func:`revoked_entries`' form)."""
    write_atomically(_revoked_path(config), json.dumps({str(k): v for k, v in sorted(entries.items())}, indent=2))


def revoked_devices(config: DeployConfig) -> dict[int, str]:
    """Node id -> name of each device revoked here (the SuperLink lists their nodes as ``unregistered``)."""
    return {node: str(entry["name"]) for node, entry in revoked_entries(config).items()}


def load_registry(config: DeployConfig) -> dict[str, Device]:
    """Return the enrolled devices by name (empty when the registry file does not exist yet)."""
    path = config.state.registry
    if not path.exists():
        return {}
    return {name: Device(**entry) for name, entry in json.loads(path.read_text()).items()}


def save_registry(config: DeployConfig, devices: dict[str, Device]) -> None:
    """Write the registry, then the directory of the devices' secure-aggregation identities, each atomically."""
    path = config.state.registry
    path.parent.mkdir(parents=True, exist_ok=True)
    write_atomically(path, json.dumps({n: asdict(d) for n, d in sorted(devices.items())}, indent=2))
    keys = {d.node_id: bytes.fromhex(d.secagg_public_key) for d in devices.values() if d.secagg_public_key}
    write_atomically(directory_path(config), IdentityDirectory(keys).to_json() + "\n")


def write_atomically(path: Path, text: str) -> None:
    """Write ``text`` to ``path`` so that a reader sees the old file or the new one, never a half-written one."""
    tmp = path.with_suffix(".tmp")
    tmp.write_text(text)
    os.replace(tmp, path)


def _secagg_identity(config: DeployConfig, name: str, public: Path | None) -> tuple[str, Path | None]:
    """(hex public key, private key file made here or None) of ``name``'s secure-aggregation identity."""
    if public is not None:
        try:
            text = Path(public).read_text().strip()
        except (OSError, UnicodeDecodeError) as exc:
            raise EnrollError(f"{public}: cannot read the secure-aggregation public key ({exc})") from None
        try:
            raw = bytes.fromhex(text)
        except ValueError:
            raw = b""
        if len(raw) != 32:
            raise EnrollError(f"{public}: a secure-aggregation public key is 64 hex digits (32 bytes), "
                              f"got {text[:80]!r}")
        return raw.hex(), None
    path = config.state.keys / f"{name}.secagg.key"
    public_path = write_identity(path)
    text = public_path.read_text().strip()
    public_path.unlink()  # the registry and the directory hold the public half
    return text, path


def device_names(config: DeployConfig) -> dict[int, str]:
    """Node id -> device name, for the round loop's records and the dashboard."""
    return {d.node_id: d.name for d in load_registry(config).values()}


def device_orgs(config: DeployConfig) -> dict[str, str]:
    """Device name -> its organisation, for the devices enrolled with one (``dashboard.access`` scopes by it)."""
    return {d.name: d.org for d in load_registry(config).values() if d.org}


def enroll(config: DeployConfig, name: str, public_key: Path | None = None,
           secagg_public_key: Path | None = None, org: str = "") -> Enrolled:
    """Register ``name``'s key with the SuperLink and its secure-aggregation identity in the directory.

    Either key pair is made here when its public half is not given. ``org`` is
    the organisation that owns the device: the accounts of that organisation see
    its per-client rows on the dashboard (no organisation: admins only).
    """
    if not _NAME.fullmatch(name):
        raise EnrollError(f"device name {name!r}: use letters, digits, '.', '_' and '-' (at most 63)")
    if org and not _NAME.fullmatch(org):
        raise EnrollError(f"organisation {org!r}: use letters, digits, '.', '_' and '-' (at most 63)")
    devices = load_registry(config)
    if name in devices:
        raise EnrollError(f"{name!r} is already enrolled (node {devices[name].node_id}); "
                          f"`quorum client revoke {name}` first to replace its key")
    private = None
    if public_key is None:
        made = make_node_key(config.state.keys / f"{name}.key", comment=f"quorum-{name}")
        private, public_key = made.private, made.public
    text = Path(public_key).read_text().strip()
    try:
        load_public_key(text)
    except ValueError as exc:
        raise EnrollError(f"{public_key}: {exc}") from None
    secagg_public, secagg_private = _secagg_identity(config, name, secagg_public_key)
    node_id = register_key(config, Path(public_key), name)
    device = Device(name=name, node_id=node_id, fingerprint=public_key_fingerprint(text), public_key=text,
                    enrolled_at=time.time(), key_made_here=private is not None, secagg_public_key=secagg_public,
                    org=org)
    devices[name] = device
    save_registry(config, devices)
    publish_devices(config)
    return Enrolled(device, private, secagg_private)


def revoke(config: DeployConfig, name: str) -> Device:
    """Unregister ``name``'s key: the SuperLink refuses it from now on."""
    devices = load_registry(config)
    device = devices.get(name)
    if device is None:
        known = ", ".join(sorted(devices)) or "none"
        raise EnrollError(f"no enrolled device {name!r} (enrolled: {known})")
    unregister_node(config, device.node_id)
    del devices[name]
    save_registry(config, devices)
    revoked = revoked_entries(config)
    revoked[device.node_id] = {"name": name, "revoked_at": time.time()}
    write_revoked(config, revoked)
    publish_devices(config)
    for path in (config.state.keys / f"{name}.key", config.state.keys / f"{name}.key.pub",
                 config.state.keys / f"{name}.secagg.key"):
        path.unlink(missing_ok=True)
    return device


_NODE_FIELDS = ("node_id", "owner_aid", "owner_name", "status", "registered_at", "last_activated_at",
                "last_deactivated_at", "unregistered_at", "heartbeat_interval", "location", "name")


def publish_devices(config: DeployConfig) -> int:
    """Copy this host's enrolled and revoked devices into the run store (``runstore/devices.py``); return how many.

    Each row carries the registry's record and the SuperLink's node record
    (Control API ``ListNodes``, the public key in hex), which is what a standby
    aggregator needs to let the device in without a new enrolment
    (``deploy/failover.py``). Needs the SuperLink running; a device it does not
    list is written without a node record.
    """
    nodes = {}
    for info in node_infos(config):
        record = {f: getattr(info, f) for f in _NODE_FIELDS}
        nodes[int(info.node_id)] = {**record, "public_key": bytes(info.public_key).hex()}
    rows = [DeviceRow(node_id=str(d.node_id), name=d.name, record=asdict(d), node=nodes.get(d.node_id, {}),
                      revoked_at=None) for d in load_registry(config).values()]
    rows += [DeviceRow(node_id=str(node), name=str(entry["name"]), record={"name": entry["name"]},
                       node=nodes.get(node, {}), revoked_at=float(entry.get("revoked_at") or time.time()))
             for node, entry in revoked_entries(config).items()]
    with RunStore(config.db_url) as store:
        save_devices(store, rows, replace=True)
    return len(rows)
