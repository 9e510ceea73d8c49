"""``quorum aggregator start --edge``: an edge aggregator's host, between its devices and the aggregator.

An edge host is an aggregator host (its own SuperLink behind its own TLS
front door, its own enrolled devices, ``quorum client enroll -c edge.toml``)
with two more things, both watched by the same supervisor:

* the **upstream agent**: ``quorum client start --server UPSTREAM`` with the
  edge's key enrolled at the aggregator (``quorum client enroll EDGE`` there),
  a SuperNode of the aggregator's whose ClientApp trains nothing: it hands the
  aggregator's messages to the edge through a folder (``clients.edge``);
* the **bridge** (:class:`EdgeBridge`): once a message of an aggregator's run
  waits in that folder and no ServerApp of this edge serves the run, it
  submits one to the edge's own SuperLink, with the aggregator's run config
  (its scenario: the devices' ClientApps train with it) and the edge's keys.
  That ServerApp (``aggregator.hierarchy.serve``) answers the run's messages
  over the edge's devices, and ends after a quiet spell; the bridge starts
  another when the run speaks again.

``docs/hierarchy.md`` ("Deploy an edge") walks through it.
"""

from __future__ import annotations

import contextlib
import json
import os
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from core.channel import Channel
from deploy.config import DeployConfig
from deploy.enroll import device_names
from deploy.errors import DeployError

__all__ = ["EdgeSpec", "EdgeBridge", "upstream_agent_argv", "START_GRACE_S"]

#: How long a submitted edge run may take to show its ServerApp before the bridge submits it again.
START_GRACE_S = 90.0
#: How often the bridge sweeps the hand-off folder of what nobody will read (``core.channel.Channel.sweep``).
SWEEP_S = 600.0


@dataclass(frozen=True)
class EdgeSpec:
    """How this edge reaches the aggregator: its address, and the key and CA of its enrolment there."""

    upstream: str                   # HOST:PORT of the aggregator's device-facing port
    name: str                       # the name the edge was enrolled under at the aggregator
    key: Path | None = None         # the edge's private key, from `quorum client enroll NAME` at the aggregator
    ca: Path | None = None          # the aggregator's CA certificate
    insecure: bool = False          # a loopback trial: no TLS upstream
    poll_s: float = 0.2             # how often the idle upstream SuperNode asks for work
    policy: Path | None = None      # the edge operator's site policy (policy.toml): which runs this edge serves

    def check(self) -> None:
        """Refuse an edge that cannot reach its aggregator, naming the option.

        Raises
        ------
        DeployError
            No ``HOST:PORT``, or TLS without both ``--upstream-key`` and ``--upstream-ca`` files.
        """
        host, _, port = self.upstream.rpartition(":")
        if not host or not port.isdigit() or not 0 < int(port) < 65536:
            raise DeployError(f"--upstream {self.upstream!r}: expected HOST:PORT, the aggregator's device address")
        if self.policy is not None:
            from clients.policy.errors import PolicyError
            from clients.policy.spec import load_policy

            try:
                load_policy(self.policy)
            except (PolicyError, OSError) as exc:
                raise DeployError(f"--edge-policy {self.policy}: {exc}") from None
        if self.insecure:
            if host not in ("127.0.0.1", "localhost", "::1", "[::1]"):
                raise DeployError(f"--upstream {self.upstream!r} with --insecure: an edge without TLS reaches a "
                                  "loopback aggregator only; give --upstream-key and --upstream-ca instead")
            return
        for flag, path in (("--upstream-key", self.key), ("--upstream-ca", self.ca)):
            if path is None:
                raise DeployError(f"{flag} is required for an edge over TLS: the edge's key and the aggregator's "
                                  "CA, from `quorum client enroll EDGE` on the aggregator (or --insecure, loopback)")
            if not path.is_file():
                raise DeployError(f"{flag} {path}: no such file")


def channel_of(config: DeployConfig) -> Channel:
    """Return the edge's hand-off folder (in its state folder)."""
    return Channel(config.state.root / "edge-channel")


def upstream_agent_argv(config: DeployConfig, spec: EdgeSpec) -> list[str]:
    """Return the command of the edge's upstream agent: a data-less client agent of the aggregator's."""
    argv = [sys.executable, "-m", "deploy", "client", "start", "--server", spec.upstream, "--name", spec.name,
            "--edge-channel", str(channel_of(config).root), "--workdir", str(config.state.root / "upstream"),
            "--poll", str(spec.poll_s)]
    if spec.insecure:
        return [*argv, "--insecure"]
    assert spec.key is not None and spec.ca is not None  # EdgeSpec.check
    return [*argv, "--key", str(spec.key.resolve()), "--ca", str(spec.ca.resolve())]


@dataclass
class EdgeBridge:
    """Start an edge ServerApp for each aggregator's run that has a message waiting and none serving it.

    ``submit`` submits a run config to the edge's SuperLink and returns the
    Flower run id (``deploy.flower.submit_run``).
    """

    config: DeployConfig
    spec: EdgeSpec
    submit: Callable[[DeployConfig, dict[str, Any]], int]
    say: Callable[[str], None] = print
    serving: dict[int, tuple[int, float]] = field(default_factory=dict)  # aggregator's run -> (edge run, when)
    swept: float = -float("inf")  # when the hand-off folder was last swept
    refused: dict[int, str] = field(default_factory=dict)  # aggregator's run -> why the edge's policy refused it

    @property
    def channel(self) -> Channel:
        """Return the edge's hand-off folder."""
        return channel_of(self.config)

    def poll(self) -> list[int]:
        """Serve every aggregator's run that waits; return the edge runs submitted now.

        Also keeps the edge's device names current for its ServerApps, and sweeps
        the hand-off folder now and then. Never raises: the supervisor's watch
        loop calls it, and a failure here is said and tried again.
        """
        try:
            return self._poll()
        except Exception as exc:  # a folder or registry unreadable for a moment must not stop the edge
            self.say(f"edge {self.spec.name}: {type(exc).__name__}: {exc} (trying again)")
            return []

    def _poll(self) -> list[int]:
        self.channel.publish_names(device_names(self.config))
        if time.monotonic() - self.swept >= SWEEP_S:
            self.swept = time.monotonic()
            self.channel.sweep()
        started = []
        for run in self.channel.waiting_runs():
            if run in self.refused:  # the edge's site policy refused the run: each of its messages says why
                self._refuse(run)
                continue
            if self._served(run):
                continue
            upstream = self.channel.run_config(run)
            if upstream is None:
                continue  # its asker writes the run config first: a request without one is not ours
            why = self._policy_refusal(run, upstream)
            if why is not None:
                self.refused[run] = why
                self.say(f"edge {self.spec.name}: the aggregator's run {run} is refused: {why}")
                self._refuse(run)
                continue
            try:
                edge_run = self.submit(self.config, self.run_config(run, upstream))
            except Exception as exc:  # the SuperLink restarting, a bad run config: said, tried again later
                self.serving[run] = (-1, time.monotonic())
                self.say(f"edge {self.spec.name}: could not start serving the aggregator's run {run} (trying again "
                         f"in {START_GRACE_S:g} s): {type(exc).__name__}: {exc}")
                continue
            self.serving[run] = (edge_run, time.monotonic())
            self.say(f"edge {self.spec.name}: serving the aggregator's run {run} as Flower run {edge_run} "
                     "on this edge's SuperLink")
            started.append(edge_run)
        return started

    def _policy_refusal(self, run: int, upstream: dict[str, Any]) -> str | None:
        """Why the edge's site policy refuses the aggregator's run (``None``: it serves it, or there is no policy).

        The run is judged as a device judges it (``deploy.policy_check.judge``):
        secure aggregation required, the privacy budget, the cohort, the task allowed.
        """
        if self.spec.policy is None:
            return None
        from clients.policy.spec import load_policy
        from deploy.policy_check import judge
        from scenarios.runconfig import scenario_from_run_config

        verdict = judge(load_policy(self.spec.policy), scenario_from_run_config(upstream), f"run {run}")
        if verdict.accepted:
            return None
        return "site policy: " + "; ".join(verdict.reasons or (verdict.error or "cannot tell",))

    def _refuse(self, run: int) -> None:
        """Answer each waiting message of ``run`` with the refusal: the aggregator records it for the edge's devices."""
        while (request := self.channel.take(run)) is not None:
            self.channel.fail(request, f"edge {self.spec.name} refused the run: {self.refused[run]}")

    def run_config(self, run: int, upstream: dict[str, Any]) -> dict[str, Any]:
        """Return the edge run's config: the aggregator's (its scenario), the edge's own keys over it."""
        keep = {k: v for k, v in upstream.items() if k in ("scenario-json", "overrides")}  # never a path of its
        return {**keep, "edge-channel": str(self.channel.root), "edge-name": self.spec.name,
                "edge-run": str(run),  # a Flower run id is a uint64; run config integers are int64
                "state-dir": str(self.config.state.root)}  # device names: the folder's names.json, kept current

    def _served(self, run: int) -> bool:
        """Whether a ServerApp of this edge serves ``run``: submitted just now, or its process is alive."""
        if run not in self.serving:
            return False
        edge_run, when = self.serving[run]
        if time.monotonic() - when < START_GRACE_S:
            return True
        return edge_run in _live_serverapps(self.config.state.root)


def _live_serverapps(state_root: Path) -> set[int]:
    """Return the Flower runs whose ServerApps on this host are alive (their pid files, ``serverapps/``)."""
    live = set()
    for entry in (state_root / "serverapps").glob("*.json"):
        with contextlib.suppress(OSError, ValueError, KeyError):
            info = json.loads(entry.read_text())
            os.kill(int(info["pid"]), 0)
            live.add(int(info["flower_run"]))
    return live
