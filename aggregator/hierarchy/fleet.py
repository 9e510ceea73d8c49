"""The aggregator's view of a deployed tree: its nodes are edge aggregators, its devices are theirs.

Under ``[hierarchy]`` in a deployment the aggregator's SuperLink connects
edge aggregators, not devices (``quorum aggregator start --edge``). A round
still samples devices as a flat round does: :class:`EdgeFleet` wraps the
SuperLink's grid and shows the devices under its edges as its nodes, asking
each edge which are connected (:func:`core.partials.devices_query`, at most
every ``refresh_s``). A device is known by its enrolled name
(:func:`device_id`), whichever edge it connects under: one that moves to
another edge keeps its id, rows and sampling; each message down and answer
up is renamed between the aggregator's ids and the edge's node ids
(:func:`core.partials.renamed_devices`). Device names are the federation's
identities: two edges that report one name are a conflict, and neither
claim is believed (the device is left out until one edge has it), with the
problem kept in :attr:`EdgeFleet.problems` and said in the ServerApp's log.
An edge is named by the name it was enrolled under at the aggregator
(``enrolled``), not the one it gives itself.

What reaches a device goes through its edge: :meth:`EdgeFleet.ask_edges`
sends the edges their messages at once and collects their answers, which
:class:`~aggregator.hierarchy.tree.TreeTrain` and
:class:`~aggregator.hierarchy.evaluate.TreeEvaluate` check as in simulation.
A message addressed to a device directly is refused: there is no such node here.
"""

from __future__ import annotations

import hashlib
import time
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field

from flwr.app import Message, RecordDict
from flwr.serverapp import Grid
from flwr.supercore.run import Run

from aggregator.collect import collect, push
from core.errors import EdgeUnavailable, UpdateRejected
from core.outcomes import error_outcome
from core.partials import EDGE_QUERY, EdgeDevices, devices_query, parse_devices_reply, renamed_devices
from core.status import ClientStatus
from scenarios.schema import Scenario

__all__ = ["EdgeFleet", "FleetTopology", "deployed_tree_problem", "device_id"]


def deployed_tree_problem(scenario: Scenario) -> str | None:
    """Why ``scenario``'s tree cannot run deployed, naming the key and the fix; ``None`` when it can."""
    if scenario.hierarchy.secure_across_edges:
        return (f"{scenario.name}: hierarchy.secure_across_edges = true runs in simulation only; in a deployment "
                "secure aggregation runs inside each edge ([secagg] enabled): set it false")
    if scenario.data.standardize != "none":
        return (f"{scenario.name}: data.standardize = {scenario.data.standardize!r} does not run through edge "
                "aggregators yet: set it \"none\" under [hierarchy] in a deployment")
    return None


def device_id(name: str) -> int:
    """Return the aggregator's id of the device enrolled as ``name``: the same under whichever edge it connects.

    63 bits of the name's SHA-256; a device its edge names no name for keeps its node id there.
    """
    return int.from_bytes(hashlib.sha256(name.encode()).digest()[:8], "big") >> 1


#: The problems the log remembers having said, and says at most at once (:meth:`EdgeFleet.refresh`).
MAX_SAID = 10_000
MAX_SAID_AT_ONCE = 20


@dataclass(frozen=True)
class FleetTopology:
    """Which edge each device is under, as the edges last said: edges by name, devices by the aggregator's id."""

    names: tuple[str, ...]  # edge i's name, in name order
    nodes: tuple[int, ...]  # edge i's node id on the aggregator's SuperLink
    under: dict[int, int]  # device -> edge index
    local: dict[int, int] = field(default_factory=dict)  # device -> its node id on its edge's SuperLink

    @property
    def edges(self) -> int:
        """Return how many edges answered."""
        return len(self.names)

    def edge_of(self, device: int) -> int:
        """Return the edge ``device`` is under (``KeyError``: under none)."""
        return self.under[device]

    def groups(self, sampled: Sequence[int]) -> list[tuple[int, list[int]]]:
        """Group the sampled devices by edge: ``(edge, its devices in the order given)``, edges in order."""
        by_edge: dict[int, list[int]] = {}
        for device in sampled:
            by_edge.setdefault(self.under[device], []).append(device)
        return sorted(by_edge.items())


class EdgeFleet(Grid):
    """A grid whose nodes are the devices under the edge aggregators connected to ``grid``.

    Parameters
    ----------
    grid : Grid
        The aggregator's SuperLink, whose nodes are edges.
    refresh_s : float
        Ask the edges for their devices at most this often.
    query_s : float
        How long an edge has to answer which devices it has (an edge whose
        ServerApp is starting takes seconds; one that is silent longer is
        left out of the tree until it answers again).
    """

    #: The tree's edges are reached by :meth:`ask_edges`, all at once: there are no threads to share it with.
    thread_safe = False

    def __init__(self, grid: Grid, refresh_s: float = 5.0, query_s: float = 15.0,
                 enrolled: Mapping[int, str] | None = None) -> None:
        self.inner, self.refresh_s, self.query_s = grid, refresh_s, query_s
        self.enrolled = dict(enrolled or {})  # edge node id -> the name it was enrolled under here
        self._topology = FleetTopology((), (), {})
        self._names: dict[int, str] = {}
        self._asked_at = -float("inf")
        self.problems: dict[str, str] = {}  # edge node id (or device) -> why it was left out at the last refresh
        self._said: dict[str, str] = {}

    # -- the tree ------------------------------------------------------------------------------------------

    def topology(self) -> FleetTopology:
        """Return the tree as the edges last described it (asking them first when none did yet)."""
        if not self._topology.names:
            self.refresh(force=True)
        return self._topology

    def device_names(self) -> dict[int, str]:
        """Return each device's name as ``edge/device`` (its enrolled name, else its node id, with its edge now)."""
        topo = self._topology
        return {d: f"{topo.names[e]}/{self._names.get(d) or d}" for d, e in topo.under.items()}

    def refresh(self, force: bool = False) -> None:
        """Ask every edge which devices it has (unless asked within ``refresh_s``); rebuild the tree."""
        if not force and time.monotonic() - self._asked_at < self.refresh_s:
            return
        self._asked_at = time.monotonic()
        self.problems = {}
        said = self._edges_say()
        claims: dict[int, list[tuple[int, int, str]]] = {}  # device -> (edge index, node id there, name)
        for index, (_, _, reply) in enumerate(said):
            for node, name in reply.devices.items():
                claims.setdefault(device_id(name) if name else node, []).append((index, node, name))
        under: dict[int, int] = {}
        names: dict[int, str] = {}
        local: dict[int, int] = {}
        for device, claimed in claims.items():
            if len(claimed) > 1:  # two edges claim one device: neither is believed
                edges_named = ", ".join(said[i][0] for i, _, _ in claimed)
                self.problems[f"device {claimed[0][2] or device}"] = (f"claimed by edges {edges_named}; left out "
                                                                      "until one edge has it (names are unique)")
                continue
            (index, node, name), = claimed
            under[device], names[device], local[device] = index, name, node
        self._topology = FleetTopology(tuple(s[0] for s in said), tuple(s[1] for s in said), under, local)
        self._names = names
        self._say_problems()

    def _edges_say(self) -> list[tuple[str, int, EdgeDevices]]:
        """Ask every edge which devices it has; ``(its name, its node id, its answer)`` in name order.

        An edge that does not answer, or answers what cannot be read, is left out, with why in :attr:`problems`.
        """
        edges = sorted(self.inner.get_node_ids())
        answers = self._send(EDGE_QUERY, {node: devices_query() for node in edges}, self.query_s)
        said: list[tuple[str, int, EdgeDevices]] = []
        for node in edges:
            answer = answers.get(node)
            if not isinstance(answer, RecordDict):
                self.problems[str(node)] = str(answer) if answer is not None else "no answer"
                continue
            try:
                reply = parse_devices_reply(answer)
            except UpdateRejected as exc:
                self.problems[str(node)] = str(exc)
                continue
            # the name it was enrolled under here, not the one it calls itself
            said.append((self.enrolled.get(node) or reply.edge, node, reply))
        return sorted(said, key=lambda t: (t[0], t[1]))

    def _say_problems(self) -> None:
        """Say each new problem once in the ServerApp's log (at most :data:`MAX_SAID_AT_ONCE` at a time)."""
        fresh = [(k, why) for k, why in self.problems.items() if self._said.get(k) != why]
        if len(self._said) + len(fresh) > MAX_SAID:  # an edge could report a million conflicting names
            self._said.clear()
        for key, why in fresh[:MAX_SAID_AT_ONCE]:
            self._said[key] = why
            print(f"edges: {key}: {why}", flush=True)
        if len(fresh) > MAX_SAID_AT_ONCE:
            print(f"edges: and {len(fresh) - MAX_SAID_AT_ONCE:,} more problems", flush=True)

    def ask_edges(self, kind: str, orders: Sequence[tuple[int, RecordDict]], timeout_s: float,
                  server_round: int = 0) -> list[RecordDict | Exception]:
        """Send each edge its message (``(edge, content)``) of type ``kind`` at once; return their answers in order.

        An edge that did not answer within ``timeout_s``, or whose node or
        message the SuperLink says is gone, gets an
        :class:`~core.errors.EdgeUnavailable` in its place (its devices are
        dropped); one whose ClientApp raised, a ``RuntimeError`` naming it.
        """
        topo = self._topology
        # per edge: the aggregator's ids of its devices -> their node ids on its SuperLink, and back
        down = [{d: n for d, n in topo.local.items() if topo.under[d] == edge and d != n} for edge, _ in orders]
        nodes = [topo.nodes[edge] for edge, _ in orders]
        contents = [renamed_devices(content, m) if m else content for (_, content), m in zip(orders, down, strict=True)]
        answers = self._send(kind, dict(zip(nodes, contents, strict=True)), timeout_s, server_round)
        silent = EdgeUnavailable(f"no answer within {timeout_s:g} s")
        out: list[RecordDict | Exception] = []
        for node, m in zip(nodes, down, strict=True):
            answer = answers.get(node, silent)
            out.append(renamed_devices(answer, {n: d for d, n in m.items()}) if isinstance(answer, RecordDict) and m
                       else answer)
        return out

    def _send(self, kind: str, contents: dict[int, RecordDict], timeout_s: float,
              server_round: int = 0) -> dict[int, RecordDict | Exception]:
        if not contents:
            return {}
        answers: dict[int, RecordDict | Exception] = {}

        def on_reply(node: int, reply: Message) -> None:
            if not reply.has_error():
                answers[node] = reply.content
                return
            outcome, reason = error_outcome(reply.error)  # as a device's error reply is read
            if outcome == ClientStatus.DROPPED:  # its node or message is gone: the edge died, or its link did
                answers[node] = EdgeUnavailable(reason)
            else:
                answers[node] = RuntimeError(f"its ClientApp answered with an error: {reason}")

        owed = push(self.inner, contents, kind, server_round, ttl=timeout_s)
        collect(self.inner, owed, timeout_s, on_reply)
        return answers

    # -- the Grid a round loop sees ----------------------------------------------------------------------------

    def get_node_ids(self) -> Iterable[int]:
        """Return the devices under the connected edges (asking the edges at most every ``refresh_s``)."""
        self.refresh()
        return sorted(self._topology.under)

    @property
    def run(self) -> Run:
        """Return the aggregator's run."""
        return self.inner.run

    def set_run(self, run: Run) -> None:
        """Set the aggregator's run."""
        self.inner.set_run(run)

    def create_message(self, content: RecordDict, message_type: str, dst_node_id: int, group_id: str,  # noqa: ARG002
                       ttl: float | None = None) -> Message:  # noqa: ARG002
        """Refused: a device under an edge is reached only through its edge."""
        raise _direct(dst_node_id)

    def push_messages(self, messages: Iterable[Message]) -> Iterable[str]:
        """Refused: a device under an edge is reached only through its edge."""
        raise _direct(_first_node(messages))

    def pull_messages(self, message_ids: Iterable[str]) -> Iterable[Message]:  # noqa: ARG002
        """Refused: nothing was pushed to a device here."""
        raise _direct(0)

    def send_and_receive(self, messages: Iterable[Message], *,
                         timeout: float | None = None) -> Iterable[Message]:  # noqa: ARG002
        """Refused: a device under an edge is reached only through its edge."""
        raise _direct(_first_node(messages))


def _first_node(messages: Iterable[Message]) -> int:
    return next((m.metadata.dst_node_id for m in messages), 0)


def _direct(node: int) -> RuntimeError:
    return RuntimeError(f"device {node or '?'} is under an edge aggregator: under [hierarchy] in a deployment a "
                        "message reaches a device only through its edge (this feature does not run through edges yet)")

