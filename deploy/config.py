"""``federation.toml``: the aggregator host's settings, parsed once and validated.

Every key is optional; an unknown key or a bad value is an error naming both.
Relative paths are relative to the file's folder. Example::

    [aggregator]
    name = "hospitals"          # the federation's name (its CA is "hospitals federation CA")
    address = "fl.example.org"  # what devices dial: goes into the TLS certificate
    listen = "0.0.0.0"          # interface the device-facing port binds
    port = 9443                 # the device-facing port (nginx, TLS)
    internal_port = 9440        # the SuperLink itself, on 127.0.0.1 only
    state_dir = "federation"    # CA, keys, SuperLink database, logs, run store

    [dashboard]
    port = 8000                 # on 127.0.0.1 unless host says otherwise (then token is required)
"""

from __future__ import annotations

import ipaddress
import tomllib
from dataclasses import dataclass, field, fields, replace
from pathlib import Path
from typing import Any

from deploy.errors import ConfigError
from scenarios.bounds import MAX_WAIT_S

__all__ = ["AggregatorSpec", "DashboardSpec", "DeployConfig", "StatePaths", "load_config", "is_loopback",
           "APP_CONFIG", "MAX_RATE_LIMIT"]

#: The most Fleet requests per second per device address the front door may allow (nginx's own rates are
#: integers; a device polls a few times a second).
MAX_RATE_LIMIT = 1_000_000


def is_loopback(host: str) -> bool:
    """Return True for 127.0.0.0/8, ::1 and ``localhost``."""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


def _port(key: str, value: Any) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or not 1 <= value <= 65535:
        raise ConfigError(f"{key} = {value!r}: expected a port number 1-65535")


@dataclass(frozen=True)
class AggregatorSpec:
    """The ``[aggregator]`` table: the federation's name, addresses, ports, state folder and run store."""

    name: str = "quorum"
    address: str = "127.0.0.1"
    listen: str = "0.0.0.0"
    port: int = 9443
    internal_port: int = 9440
    extra_names: tuple[str, ...] = ()
    state_dir: str = "federation"
    insecure: bool = False
    database: str = ""          # the run store (SQLAlchemy URL); default: sqlite in state_dir
    wait_clients_s: float = 120.0
    rate_limit: int = 200       # Fleet requests per second per device address at the front door; 0: off

    def check(self) -> None:
        """Validate the values together.

        Raises
        ------
        ConfigError
            A port is out of range, the two ports are equal, the name has other
            than letters, digits, - and _, ``insecure`` is set off loopback, or
            ``rate_limit`` or ``wait_clients_s`` is negative or beyond its bound.
        """
        _port("aggregator.port", self.port)
        _port("aggregator.internal_port", self.internal_port)
        if self.port == self.internal_port:
            raise ConfigError(f"aggregator.internal_port = {self.internal_port}: must differ from port")
        if not self.name.replace("-", "").replace("_", "").isalnum():
            raise ConfigError(f"aggregator.name = {self.name!r}: letters, digits, - and _ only")
        if self.insecure and not (is_loopback(self.listen) and is_loopback(self.address)):
            raise ConfigError(f"aggregator.insecure = true with listen = {self.listen!r}: plain HTTP is only "
                              "allowed on loopback (127.0.0.1), for trying things out")
        if not 0 <= self.rate_limit <= MAX_RATE_LIMIT:
            raise ConfigError(f"aggregator.rate_limit = {self.rate_limit!r}: requests per second, in [0, "
                              f"{MAX_RATE_LIMIT:,}] (0: off)")
        if not 0 <= self.wait_clients_s <= MAX_WAIT_S:  # NaN fails both
            raise ConfigError(f"aggregator.wait_clients_s = {self.wait_clients_s!r}: must be seconds in [0, "
                              f"{MAX_WAIT_S:,.0f}] (a week)")


@dataclass(frozen=True)
class DashboardSpec:
    """The ``[dashboard]`` table: whether the aggregator serves the dashboard, where, and its token."""

    enabled: bool = True
    host: str = "127.0.0.1"
    port: int = 8000
    token: str = ""

    def check(self) -> None:
        """Validate the values together.

        Raises
        ------
        ConfigError
            The port is out of range, or an enabled dashboard binds beyond loopback without a token.
        """
        _port("dashboard.port", self.port)
        if self.enabled and not is_loopback(self.host) and not self.token:
            raise ConfigError(f"dashboard.host = {self.host!r} without dashboard.token: a dashboard "
                              "reachable beyond loopback needs a token")


@dataclass(frozen=True)
class StatePaths:
    """Everything the aggregator keeps, under one folder."""

    root: Path

    @property
    def tls(self) -> Path:
        """Return the folder of the federation's CA and server certificate."""
        return self.root / "tls"

    @property
    def keys(self) -> Path:
        """Return the folder of the enrolment registry and directory, and of device keys made here."""
        return self.root / "devices"

    @property
    def registry(self) -> Path:
        """Return the enrolment registry: the enrolled devices by name (JSON)."""
        return self.root / "devices" / "registry.json"

    @property
    def linkstate(self) -> Path:
        """Return the SuperLink's state database (node keys and ids)."""
        return self.root / "superlink" / "linkstate.db"

    @property
    def flwr_home(self) -> Path:
        """Return ``$FLWR_HOME`` for this host's Flower processes."""
        return self.root / "flwr-home"

    @property
    def app(self) -> Path:
        """Return the folder of the Flower App ``flwr run`` bundles."""
        return self.root / "app"

    @property
    def proxy(self) -> Path:
        """Return nginx's working folder (its configuration, pid, logs and temp files)."""
        return self.root / "proxy"

    @property
    def logs(self) -> Path:
        """Return the folder of the aggregator's children's logs."""
        return self.root / "logs"

    @property
    def pidfile(self) -> Path:
        """Return the running aggregator's pid file (JSON: its pid, addresses and children)."""
        return self.root / "aggregator.json"

    @property
    def runs_db(self) -> Path:
        """Return the default run store, a SQLite file."""
        return self.root / "runs" / "quorum.db"


@dataclass(frozen=True)
class DeployConfig:
    """A parsed ``federation.toml``; ``base`` is its folder, against which relative paths resolve."""

    aggregator: AggregatorSpec = field(default_factory=AggregatorSpec)
    dashboard: DashboardSpec = field(default_factory=DashboardSpec)
    base: Path = Path(".")

    @property
    def state(self) -> StatePaths:
        """Return the paths under ``state_dir`` (resolved against ``base`` when relative)."""
        path = Path(self.aggregator.state_dir).expanduser()
        return StatePaths(path if path.is_absolute() else (self.base / path).resolve())

    @property
    def db_url(self) -> str:
        """Return the run store's URL: ``database``, else SQLite in the state folder."""
        return self.aggregator.database or f"sqlite:///{self.state.runs_db}"

    @property
    def device_address(self) -> str:
        """Return the ``host:port`` devices dial (an IPv6 address in brackets)."""
        a = self.aggregator
        return f"[{a.address}]:{a.port}" if ":" in a.address else f"{a.address}:{a.port}"

    @property
    def control_address(self) -> str:
        """Return the SuperLink's address on 127.0.0.1 (``internal_port``)."""
        return f"127.0.0.1:{self.aggregator.internal_port}"

    @property
    def cert_hosts(self) -> list[str]:
        """SANs: the public address, extra names, and loopback for the aggregator's own processes."""
        return [self.aggregator.address, *self.aggregator.extra_names, "localhost", "127.0.0.1"]

    def with_overrides(self, **aggregator: Any) -> DeployConfig:
        """Return a copy with the given ``[aggregator]`` values replaced, checked again.

        Raises
        ------
        ConfigError
            The new values fail :meth:`AggregatorSpec.check`.
        """
        new = replace(self, aggregator=replace(self.aggregator, **aggregator))
        new.aggregator.check()
        return new


def _section(cls: type, name: str, raw: Any) -> Any:
    if not isinstance(raw, dict):
        raise ConfigError(f"[{name}] must be a table, got {raw!r}")
    known = {f.name: f for f in fields(cls)}
    values = {}
    for key, value in raw.items():
        if key not in known:
            raise ConfigError(f"{name}.{key}: unknown key (known: {', '.join(sorted(known))})")
        default = known[key].default
        if isinstance(default, tuple):
            if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
                raise ConfigError(f"{name}.{key} = {value!r}: expected a list of strings")
            value = tuple(value)
        elif isinstance(default, float) and isinstance(value, int) and not isinstance(value, bool):
            value = float(value)
        elif type(value) is not type(default):
            raise ConfigError(f"{name}.{key} = {value!r}: expected {type(default).__name__}")
        values[key] = value
    spec = cls(**values)
    spec.check()
    return spec


def load_config(path: Path | None) -> DeployConfig:
    """Read ``federation.toml`` (``None``: all defaults, state in ./federation)."""
    if path is None:
        return DeployConfig()
    try:
        raw = tomllib.loads(Path(path).read_text())
    except OSError as exc:
        raise ConfigError(f"{path}: cannot read ({exc.strerror or exc})") from None
    except tomllib.TOMLDecodeError as exc:
        raise ConfigError(f"{path}: not valid TOML ({exc})") from None
    unknown = set(raw) - {"aggregator", "dashboard"}
    if unknown:
        raise ConfigError(f"{path}: unknown section [{sorted(unknown)[0]}] (known: aggregator, dashboard)")
    return DeployConfig(aggregator=_section(AggregatorSpec, "aggregator", raw.get("aggregator", {})),
                        dashboard=_section(DashboardSpec, "dashboard", raw.get("dashboard", {})),
                        base=Path(path).resolve().parent)


# The run_config keys `quorum aggregator run` may pass (Flower rejects undeclared keys).
APP_CONFIG: dict[str, str | int | float] = {
    "engine": "deployment",  # aggregator.serverapp.main's deployment options (its docstring)
    "scenario": "", "scenario-json": "", "db": "", "resume": "", "overrides": "{}",
    "wait-clients-s": 120.0, "devices": "{}", "state-dir": "", "federation": "", "orgs": "{}",
    "submitted-by": "", "submitted-org": "", "submission": 0,  # a remote submission's (deploy/submissions.py)
    # an edge aggregator's own run (deploy/edge.py, aggregator.hierarchy.serve)
    "edge-channel": "", "edge-name": "", "edge-run": "",
}
