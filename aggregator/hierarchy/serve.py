"""An edge aggregator's ServerApp in a deployment: the aggregator's messages, run over the edge's own devices.

The edge's upstream ClientApp (``clients.edge``) hands each message the
aggregator sends it over the edge's hand-off folder (:class:`core.channel.Channel`);
:class:`EdgeServer` takes them and answers each as a simulated edge would:

* ``train.edge``: the round's sub-round over the devices the aggregator
  sampled under this edge (:func:`aggregator.hierarchy.edge.edge_round`),
  answered with one partial sum;
* ``evaluate.edge``: their evaluation, each device's row as its reply had it
  (:func:`aggregator.hierarchy.edge.edge_evaluate`);
* ``query.edge``: which devices are connected here, by node id and enrolled
  name (:func:`core.partials.devices_reply`); the aggregator samples among them.

Devices are named to the aggregator by their node ids on this edge's SuperLink.
A message that fails here is answered with the reason
(:meth:`core.channel.Channel.fail`), which the aggregator records for the
edge's devices; it never stops the server.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

from flwr.app import RecordDict
from flwr.serverapp import Grid

from aggregator.hierarchy.edge import edge_evaluate, edge_round
from aggregator.hierarchy.robust import edge_strategy
from core.boundary import one_line
from core.channel import Channel, Request
from core.instructions import read_instruction
from core.layouts import ParamLayout
from core.partials import EDGE_EVALUATE, EDGE_QUERY, EDGE_TRAIN, devices_reply, edge_secured
from core.strategy import ServerState, Strategy
from core.train import TrainRequest, TrainWorkflow
from privacy.dp.strategy import DPFedAvg

__all__ = ["EdgeServer", "EDGE_CHANNEL", "EDGE_NAME", "EDGE_RUN", "EDGE_IDLE_S"]

#: The run config keys of an edge's own run (``quorum aggregator start --edge`` submits it): its hand-off
#: folder, its name, and the aggregator's Flower run it answers for.
EDGE_CHANNEL = "edge-channel"
EDGE_NAME = "edge-name"
EDGE_RUN = "edge-run"
#: How long an edge's run waits for the aggregator's next message before it ends (the edge starts another).
EDGE_IDLE_S = 900.0


@dataclass
class EdgeServer:
    """Answer the aggregator's run ``run`` from ``channel``, over ``grid`` (the edge's SuperLink).

    Parameters
    ----------
    grid : Grid
        The edge's own devices.
    channel : Channel
        The edge's hand-off folder.
    run : int
        The aggregator's Flower run this server answers for.
    name : str
        The edge's name, as the aggregator enrolled it.
    train : TrainWorkflow
        What the edge runs over its devices (plain, or secure aggregation inside its cohort).
    strategy : Strategy
        The scenario's strategy: what the edge folds its devices' updates with.
    deadline_s, max_update_bytes
        A sub-round's deadline and a device reply's largest size (the scenario's ``[federation]``).
    layout : ParamLayout | None
        The model's tensors, as the devices' instruction names them.
    names : Callable[[], Mapping[int, str]]
        The enrolled names of this edge's devices, by node id (read on every query: devices come and go).
    """

    grid: Grid
    channel: Channel
    run: int
    name: str
    train: TrainWorkflow
    strategy: Strategy[Any]
    deadline_s: float
    max_update_bytes: int
    layout: ParamLayout | None = None
    names: Callable[[], Mapping[int, str]] = field(default=lambda: {})
    served: int = 0

    def serve(self, idle_s: float, stop: Callable[[], bool] = lambda: False, poll_s: float = 0.05) -> int:
        """Answer requests until ``stop()`` or ``idle_s`` seconds pass without one; return how many were answered."""
        last = time.monotonic()
        while not stop() and time.monotonic() - last < idle_s:
            try:
                request = self.channel.take(self.run)
            except OSError as exc:  # the folder itself unreadable for a moment: said, and tried again
                print(f"edge {self.name}: cannot read the hand-off folder: {exc}", flush=True)
                request = None
            if request is None:
                time.sleep(poll_s)
                continue
            self.answer(request)
            last = time.monotonic()
        return self.served

    def answer(self, request: Request) -> None:
        """Answer one request: its reply, or the reason it failed."""
        try:
            try:
                reply = self.handle(request)
            except Exception as exc:  # one bad message never stops the edge: the aggregator records why
                self.channel.fail(request, f"edge {self.name}: {one_line(exc)}")
            else:
                self.channel.answer(request, reply)
        except OSError as exc:  # the answer could not be written: its asker times out, the server goes on
            print(f"edge {self.name}: could not answer a {request.kind} message: {exc}", flush=True)
        self.served += 1

    def handle(self, request: Request) -> RecordDict:
        """Run ``request`` over the edge's devices and return the reply.

        Raises
        ------
        ValueError
            An unknown kind, an instruction no device could read, or a secure sum across the
            edges (run by the aggregator's own protocol in simulation only).
        """
        deadline = min(self.deadline_s, max(1.0, request.deadline - time.time() - 1.0))  # answer before it expires
        if request.kind == EDGE_QUERY:
            names = self.names()
            return devices_reply(self.name, {d: names.get(d, "") for d in self.grid.get_node_ids()})
        if request.kind not in (EDGE_TRAIN, EDGE_EVALUATE):
            raise ValueError(f"no edge message of type {request.kind!r} (one of {EDGE_TRAIN}, {EDGE_EVALUATE}, "
                             f"{EDGE_QUERY})")
        instruction = read_instruction(request.content)
        if request.kind == EDGE_EVALUATE:
            return edge_evaluate(self.grid, request.content, instruction.params, instruction.config, deadline,
                                 self.layout)
        if edge_secured(request.content):
            raise ValueError("a secure sum across the edges runs in simulation only ([hierarchy] "
                             "secure_across_edges); this edge would have to send its sum in clear")
        state = ServerState(params=instruction.params)
        train = TrainRequest(server_round=instruction.config.round, nodes=[], state=state, config=instruction.config,
                             deadline_s=deadline, max_update_bytes=self.max_update_bytes, layout=self.layout)
        strategy = edge_strategy(self.strategy)
        # a DP run's edge folds with the round's clip norm and cohort, as the instruction carries them
        bound = strategy.for_edge(instruction.config) if isinstance(strategy, DPFedAvg) else strategy.for_round(state)
        return edge_round(self.grid, request.content, train, self.train, bound).reply
