"""Check, before a deployed run is submitted, that enough devices are online for the scenario.

``quorum aggregator run`` asks the SuperLink which devices are online and
compares them with the scenario's ``[federation] min_clients`` (the least a
round starts with) and ``clients`` (what the run waits for first). Too few
online: it says so with a live count and waits up to ``[aggregator]
wait_clients_s``, then refuses with the numbers and what to do, instead of
submitting a run that can never start.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable
from dataclasses import dataclass

from deploy.config import DeployConfig
from deploy.enroll import device_names
from deploy.errors import DeployError
from deploy.flower import list_nodes
from scenarios.schema import Scenario

__all__ = ["Fleet", "fleet", "shortfall", "await_devices"]


@dataclass(frozen=True)
class Fleet:
    """The devices the aggregator knows: how many are enrolled, and which are online (by name)."""

    enrolled: int               # registered with the SuperLink (or in this host's registry, whichever is more)
    online: tuple[str, ...]


def fleet(config: DeployConfig) -> Fleet:
    """Return the SuperLink's view now: devices enrolled and online (one enrolled elsewhere shows as its node id)."""
    names, nodes = device_names(config), list_nodes(config)
    online = tuple(sorted(names.get(int(n["node-id"]), str(n["node-id"])) for n in nodes
                          if n.get("status") == "online"))
    return Fleet(max(len(names), len(nodes)), online)


def shortfall(scenario: Scenario, devices: Fleet, insecure: bool) -> str | None:
    """Why ``scenario`` cannot start on ``devices`` now, naming the numbers and the fix; ``None`` if it can.

    Under ``[hierarchy]`` this aggregator's devices are edge aggregators: one
    online is enough to submit (the run itself waits for ``min_clients``
    devices under them).
    """
    least, wanted = scenario.federation.min_clients, scenario.federation.clients
    if scenario.hierarchy.enabled:
        if devices.online:
            return None
        return (f"no edge aggregator is online for scenario {scenario.name!r} ([hierarchy]: this aggregator's "
                f"devices are edges, {devices.enrolled} enrolled): start them (quorum aggregator start --edge "
                "--upstream THIS-ADDRESS)")
    if not insecure and devices.enrolled < least:
        return (f"scenario {scenario.name!r} needs at least {least} clients (federation.min_clients) but only "
                f"{devices.enrolled} devices are enrolled: enroll more (quorum client enroll NAME) or lower "
                "federation.min_clients")
    if len(devices.online) < least:
        names = ", ".join(devices.online) or "none"
        return (f"{len(devices.online)} of the {least} devices scenario {scenario.name!r} needs are online "
                f"(federation.min_clients = {least}, federation.clients = {wanted}; online: {names}): start "
                "more client agents, or lower federation.min_clients")
    return None


def await_devices(config: DeployConfig, scenario: Scenario, say: Callable[[str], None],
                  poll_s: float = 0.5) -> Fleet:
    """Wait, with a count, until ``min_clients`` devices are online, up to ``wait_clients_s``.

    Raises
    ------
    DeployError
        Too few devices enrolled (at once), or too few online when the wait ends; the aggregator not reachable.
    """
    insecure = config.aggregator.insecure
    deadline = time.monotonic() + config.aggregator.wait_clients_s
    devices = fleet(config)
    why = shortfall(scenario, devices, insecure)
    if why is not None and not insecure and not scenario.hierarchy.enabled and \
            devices.enrolled < scenario.federation.min_clients:
        raise DeployError(why)
    shown = -1
    while why is not None:
        if time.monotonic() >= deadline:
            raise DeployError(f"{why} (waited {config.aggregator.wait_clients_s:g} s, aggregator.wait_clients_s)")
        if len(devices.online) != shown:
            shown = len(devices.online)
            say(f"{shown} of {scenario.federation.min_clients} devices online; waiting up to "
                f"{max(0.0, deadline - time.monotonic()):.0f} s more")
        time.sleep(poll_s)
        try:
            devices = fleet(config)
        except DeployError as exc:  # the SuperLink restarting: keep the last view and ask again
            say(f"cannot list devices right now ({exc}); asking again")
            continue
        why = shortfall(scenario, devices, insecure)
    if scenario.hierarchy.enabled:
        return _await_edges(config, scenario, devices, deadline, say, poll_s)
    if len(devices.online) < scenario.federation.clients:
        say(f"{len(devices.online)} of the {scenario.federation.clients} clients online "
            f"({', '.join(devices.online)}): the run waits up to {config.aggregator.wait_clients_s:g} s for the "
            "rest, then starts with those connected")
    return devices


def _await_edges(config: DeployConfig, scenario: Scenario, devices: Fleet, deadline: float,
                 say: Callable[[str], None], poll_s: float) -> Fleet:
    """Wait until ``[hierarchy] edges`` edge aggregators are online, or the wait ends: then go on with those."""
    wanted = scenario.hierarchy.edges
    while len(devices.online) < wanted and time.monotonic() < deadline:
        time.sleep(poll_s)
        with contextlib.suppress(DeployError):
            devices = fleet(config)
    if len(devices.online) < wanted:
        say(f"{len(devices.online)} of the {wanted} edge aggregators online ({', '.join(devices.online)}; "
            f"[hierarchy] edges = {wanted}): the run starts with the devices under those")
    return devices
