"""Private keys are 0600 whenever written, also when a reissue overwrites a file with a loose mode."""

from __future__ import annotations

import os
import stat
from pathlib import Path

from deploy.pki import ensure_tls, make_node_key


def _mode(path: Path) -> int:
    return stat.S_IMODE(path.stat().st_mode)


def test_new_keys_are_owner_only(tmp_path: Path) -> None:
    files = ensure_tls(tmp_path, ["127.0.0.1"])
    assert _mode(files.ca_key) == 0o600 and _mode(files.server_key) == 0o600


def test_a_reissued_server_key_loses_a_loose_mode(tmp_path: Path) -> None:
    # Prepare: a server.key someone made world-readable, and a new host that forces a reissue
    files = ensure_tls(tmp_path, ["127.0.0.1"])
    os.chmod(files.server_key, 0o644)
    before = files.server_key.read_bytes()
    # Execute
    ensure_tls(tmp_path, ["127.0.0.1", "fl.example.org"])
    # Assert: a new key, written 0600
    assert files.server_key.read_bytes() != before
    assert _mode(files.server_key) == 0o600


def test_an_overwritten_node_key_is_owner_only(tmp_path: Path) -> None:
    path = tmp_path / "node"
    path.write_bytes(b"old")
    os.chmod(path, 0o666)
    make_node_key(path, "device-1")
    assert _mode(path) == 0o600
