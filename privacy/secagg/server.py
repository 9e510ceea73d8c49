"""The server side of the protocol as a small state machine driven by any transport.

A driver repeats, for each stage: send :meth:`ServerRound.requests`, feed
every reply that arrives before the deadline to :meth:`ServerRound.accept`
(a reply it rejects is that client dropping out), then :meth:`close` the
stage. Masked inputs are folded into one running sum as they arrive, so
memory is O(model), not O(clients x model). Liveness follows Bonawitz et al.
(CCS 2017) on the graph of Bell et al. (CCS 2020): before any input is
committed, a client whose live closed neighbourhood falls below ``t`` is
excluded (it could never be unmasked); afterwards too few share holders
ends the round with :class:`SecAggAborted`. In a ``"malicious"`` round the
server relays signed key advertisements and runs the consistency check
(Bonawitz et al., Sec. 6); given the enrolment directory it also drops
clients whose signatures do not verify, so one bad client cannot make every
honest one abort.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Sequence

import numpy as np

from privacy.secagg.codec import setup_digest
from privacy.secagg.config import SecAggConfig
from privacy.secagg.errors import SecAggAborted, SecAggCryptoError, SecAggProtocolError
from privacy.secagg.graph import build_graph, closed
from privacy.secagg.identity import (
    MALICIOUS,
    SIGNATURE_BYTES,
    IdentityDirectory,
    advertisement_message,
    survivors_message,
)
from privacy.secagg.keys import KEY_BYTES, PublicKeys, session_digest
from privacy.secagg.messages import (
    ConsistencyReply,
    ConsistencyRequest,
    EncryptedShare,
    KeyAdvertisement,
    KeyDirectory,
    MaskedInput,
    MaskedInputRequest,
    Reply,
    Request,
    RoundSetup,
    ShareKeysReply,
    SignedSurvivors,
    UnmaskReply,
    UnmaskRequest,
)
from privacy.secagg.prg import dtype_for
from privacy.secagg.quantize import Quantizer
from privacy.secagg.shamir import PRIME
from privacy.secagg.stage import STAGE_ORDER, Stage
from privacy.secagg.unmask import UnmaskPlan, collect_shares, remove_masks

__all__ = ["ServerRound"]

_CIPHERTEXT_BYTES = 2 * 66 + 16


class ServerRound:
    """One round of secure aggregation, seen from the server.

    Parameters
    ----------
    participants : Sequence[int]
        The sampled client ids (distinct, < 2^64).
    config : SecAggConfig
        Run-wide parameters.
    round_id : int
        The FL round; bound into every derived key.
    entropy : Callable[[int], bytes]
        Source of the graph seed.
    vector_length : int | None
        Expected length of a masked input (update length + 1), if known.
    directory : IdentityDirectory | None
        The enrolment directory, if the server has it: then signatures that
        do not verify are that client dropping out (clients check anyway).
    """

    def __init__(self, participants: Sequence[int], config: SecAggConfig, *, round_id: int,
                 entropy: Callable[[int], bytes] = os.urandom, vector_length: int | None = None,
                 directory: IdentityDirectory | None = None) -> None:
        ids = tuple(sorted(set(participants)))
        if len(ids) != len(participants):
            raise ValueError("participant ids must be distinct")
        n = len(ids)
        self.setup = RoundSetup(round_id, ids, config.threshold_for(n), config.graph,
                                config.degree_for(n), entropy(32), config.clip_range,
                                config.bits, config.max_weight, config.threat_model)
        self.malicious = config.threat_model == MALICIOUS
        self._order = STAGE_ORDER if self.malicious else tuple(
            s for s in STAGE_ORDER if s is not Stage.CONSISTENCY_CHECK)
        self._directory = directory
        self._advert_sigs: dict[int, bytes] = {}
        self._survivor_sigs: dict[int, bytes] = {}
        self.graph = build_graph(config.graph, ids, self.setup.degree, self.setup.graph_seed)
        self.quantizer = Quantizer(config.bits, config.clip_range, n)
        self.stage: Stage | None = Stage.ADVERTISE_KEYS
        self.live: frozenset[int] = frozenset(ids)
        self.completed: dict[Stage, tuple[int, ...]] = {}
        self._answered: set[int] = set()
        self._keys: dict[int, PublicKeys] = {}
        self._seen_keys: set[bytes] = set()
        self._shares: dict[int, ShareKeysReply] = {}
        self._session = b""
        self._length = vector_length
        self._acc: np.ndarray | None = None
        self._inputs: frozenset[int] = frozenset()
        self._dropped: frozenset[int] = frozenset()
        self._requests: dict[int, UnmaskRequest] = {}
        self._revealed: dict[int, UnmaskReply] = {}
        self._result: tuple[np.ndarray, float] | None = None

    @property
    def threshold(self) -> int:
        """The Shamir threshold ``t`` of this round."""
        return self.setup.threshold

    # -- the driver's interface -------------------------------------------
    def requests(self) -> dict[int, Request]:
        """Return the message for each live client at the current stage."""
        stage = self._require_stage()
        if stage is Stage.ADVERTISE_KEYS:
            return {u: self.setup for u in self.live}
        if stage is Stage.SHARE_KEYS:
            ids = sorted(self.live)
            sigs = tuple(self._advert_sigs[u] for u in ids) if self.malicious else ()
            directory = KeyDirectory(tuple(self._keys[u] for u in ids), sigs)
            return {u: directory for u in self.live}
        if stage is Stage.MASKED_INPUT:
            return self._forward_shares()
        if stage is Stage.CONSISTENCY_CHECK:
            announced = ConsistencyRequest(tuple(sorted(self._inputs)))
            return {u: announced for u in self.live}
        self._requests = {u: self._unmask_request(u) for u in self.live}
        return dict(self._requests)

    def accept(self, node: int, reply: Reply) -> None:
        """Take one client's reply; raises :class:`SecAggProtocolError` if it is rejected."""
        stage = self._require_stage()
        if node not in self.live or node in self._answered:
            raise SecAggProtocolError(f"unexpected or duplicate reply from client {node}")
        check = {Stage.ADVERTISE_KEYS: self._check_keys, Stage.SHARE_KEYS: self._check_shares,
                 Stage.MASKED_INPUT: self._fold_input, Stage.CONSISTENCY_CHECK: self._check_signed,
                 Stage.UNMASK: self._check_unmask}[stage]
        check(node, reply)
        self._answered.add(node)

    def close(self) -> None:
        """End the current stage: the clients that answered go on; others dropped."""
        stage = self._require_stage()
        answered = frozenset(self._answered)
        {Stage.ADVERTISE_KEYS: self._close_keys, Stage.SHARE_KEYS: self._close_shares,
         Stage.MASKED_INPUT: self._close_inputs, Stage.CONSISTENCY_CHECK: self._close_signed,
         Stage.UNMASK: self._close_unmask}[stage](answered)
        self.completed[stage] = tuple(sorted(answered))
        self._answered = set()
        index = self._order.index(stage)
        self.stage = self._order[index + 1] if index + 1 < len(self._order) else None

    def result(self) -> tuple[np.ndarray, float]:
        """``(sum_i w_i x_i, sum_i w_i)`` over :attr:`survivors`, in the caller's weight units."""
        if self._result is None:
            raise SecAggProtocolError("the round has not finished")
        return self._result

    @property
    def survivors(self) -> tuple[int, ...]:
        """Clients whose inputs are in the sum (they completed MASKED_INPUT)."""
        return tuple(sorted(self._inputs))

    def error_bound(self) -> float:
        """Worst-case quantisation error per coordinate of the result's total."""
        return self.quantizer.error_bound(len(self._inputs)) * self.setup.max_weight

    # -- stage internals ----------------------------------------------------
    def _require_stage(self) -> Stage:
        if self.stage is None:
            raise SecAggProtocolError("the round is over")
        return self.stage

    def _check_keys(self, node: int, reply: Reply) -> None:
        if not isinstance(reply, KeyAdvertisement) or reply.cipher == reply.mask:
            raise SecAggProtocolError(f"client {node}: malformed key advertisement")
        if {len(reply.cipher), len(reply.mask)} != {KEY_BYTES}:
            raise SecAggProtocolError(f"client {node}: malformed key advertisement")
        if reply.cipher in self._seen_keys or reply.mask in self._seen_keys:
            raise SecAggProtocolError(f"client {node}: reused public key")
        if self.malicious:
            self._check_advert_signature(node, reply)
        self._seen_keys |= {reply.cipher, reply.mask}
        self._keys[node] = PublicKeys(node, reply.cipher, reply.mask)

    def _check_advert_signature(self, node: int, reply: KeyAdvertisement) -> None:
        if len(reply.signature) != SIGNATURE_BYTES:
            raise SecAggProtocolError(f"client {node}: unsigned key advertisement")
        message = advertisement_message(setup_digest(self.setup), node, reply.cipher, reply.mask)
        if self._directory is not None and not self._directory.verify(node, reply.signature, message):
            raise SecAggProtocolError(f"client {node}: key advertisement signature does not verify")
        self._advert_sigs[node] = reply.signature

    def _prune(self, stage: Stage, answered: frozenset[int]) -> None:
        """Keep the clients whose live closed neighbourhood still reaches ``t``."""
        live = answered
        while True:
            kept = frozenset(u for u in live if len(closed(self.graph, u) & live) >= self.threshold)
            if kept == live:
                break
            live = kept
        if not live:
            raise SecAggAborted(stage, len(answered), self.threshold, sampled=len(self.setup.participants))
        self.live = live

    def _close_keys(self, answered: frozenset[int]) -> None:
        self._prune(Stage.ADVERTISE_KEYS, answered)
        self._keys = {u: self._keys[u] for u in self.live}
        entries = tuple(self._keys[u] for u in sorted(self.live))
        self._session = session_digest(self.setup.round, setup_digest(self.setup), entries)

    def _check_shares(self, node: int, reply: Reply) -> None:
        if not isinstance(reply, ShareKeysReply) or len(reply.commitment) != 32:
            raise SecAggProtocolError(f"client {node}: malformed share message")
        receivers = [s.receiver for s in reply.shares]
        if sorted(receivers) != sorted(self.graph[node] & self.live):
            raise SecAggProtocolError(f"client {node}: shares not addressed to its neighbours")
        if any(s.sender != node or len(s.ciphertext) != _CIPHERTEXT_BYTES for s in reply.shares):
            raise SecAggProtocolError(f"client {node}: malformed share message")
        self._shares[node] = reply

    def _close_shares(self, answered: frozenset[int]) -> None:
        self._prune(Stage.SHARE_KEYS, answered)
        self._shares = {u: self._shares[u] for u in self.live}

    def _forward_shares(self) -> dict[int, Request]:
        inbox: dict[int, list[EncryptedShare]] = {u: [] for u in self.live}
        for reply in self._shares.values():
            for share in reply.shares:
                if share.receiver in inbox:
                    inbox[share.receiver].append(share)
        return {u: MaskedInputRequest(tuple(box)) for u, box in inbox.items()}

    def _fold_input(self, node: int, reply: Reply) -> None:
        dtype = dtype_for(self.setup.bits)
        if not isinstance(reply, MaskedInput) or reply.vector.dtype != dtype or reply.vector.ndim != 1:
            raise SecAggProtocolError(f"client {node}: malformed masked input")
        if self._length is None:
            self._length = reply.vector.shape[0]
        if reply.vector.shape[0] != self._length or self._length < 2:
            raise SecAggProtocolError(f"client {node}: masked input of the wrong length")
        if self._acc is None:
            self._acc = np.zeros(self._length, dtype=dtype)
        np.add(self._acc, reply.vector, out=self._acc)

    def _close_inputs(self, answered: frozenset[int]) -> None:
        dropped = self.live - answered
        needed = answered | {v for v in dropped if self.graph[v] & answered}
        self._require_holders(Stage.MASKED_INPUT, needed, answered)
        self._inputs, self.live, self._dropped = answered, answered, frozenset(dropped)

    def _require_holders(self, stage: Stage, owners: frozenset[int] | set[int],
                         holders: frozenset[int]) -> None:
        thinnest = min((len(closed(self.graph, o) & holders), o) for o in owners) if owners else (0, -1)
        if not holders or thinnest[0] < self.threshold:
            raise SecAggAborted(stage, len(holders), self.threshold,
                                sampled=len(self.setup.participants),
                                detail=f"client {thinnest[1]} has {thinnest[0]} live share holders")

    def _check_signed(self, node: int, reply: Reply) -> None:
        if not isinstance(reply, ConsistencyReply) or len(reply.signature) != SIGNATURE_BYTES:
            raise SecAggProtocolError(f"client {node}: malformed consistency reply")
        message = survivors_message(self._session, self._inputs)
        if self._directory is not None and not self._directory.verify(node, reply.signature, message):
            raise SecAggProtocolError(f"client {node}: survivor signature does not verify")
        self._survivor_sigs[node] = reply.signature

    def _close_signed(self, answered: frozenset[int]) -> None:
        needed = self._inputs | {v for v in self._dropped if self.graph[v] & self._inputs}
        self._require_holders(Stage.CONSISTENCY_CHECK, needed, answered)
        self.live = answered
        self._survivor_sigs = {u: self._survivor_sigs[u] for u in answered}

    def _unmask_request(self, u: int) -> UnmaskRequest:
        around = closed(self.graph, u)
        # A client needs t signatures from its neighbourhood; more would only cost it time.
        signers = sorted(around & self._survivor_sigs.keys())[:self.threshold]
        signed = tuple(SignedSurvivors(v, self._survivor_sigs[v]) for v in signers)
        return UnmaskRequest(tuple(sorted(around & self._inputs)), tuple(sorted(around & self._dropped)), signed)

    def _check_unmask(self, node: int, reply: Reply) -> None:
        request = self._requests[node]
        if not isinstance(reply, UnmaskReply):
            raise SecAggProtocolError(f"client {node}: malformed unmask reply")
        owners = (tuple(s.owner for s in reply.self_mask_shares), tuple(s.owner for s in reply.mask_key_shares))
        values = [s.value for s in reply.self_mask_shares + reply.mask_key_shares]
        if owners != (request.survivors, request.dropped) or any(not 0 <= v < PRIME for v in values):
            raise SecAggProtocolError(f"client {node}: unmask reply does not match its request")
        self._revealed[node] = reply

    def _close_unmask(self, answered: frozenset[int]) -> None:
        self_shares, key_shares = collect_shares(self._revealed)
        needed = self._inputs | {v for v in self._dropped if self.graph[v] & self._inputs}
        self._require_holders(Stage.UNMASK, needed, answered)
        plan = UnmaskPlan(self._session, self.setup.bits, self.threshold, self.graph, self._keys,
                          {u: self._shares[u].commitment for u in self._inputs},
                          {u: i + 1 for i, u in enumerate(self.setup.participants)},
                          self._inputs, frozenset(self._dropped))
        acc = self._acc if self._acc is not None else np.zeros(2, dtype=dtype_for(self.setup.bits))
        try:
            remove_masks(acc, plan, self_shares, key_shares)
        except SecAggCryptoError as exc:
            raise SecAggAborted(Stage.UNMASK, len(answered), self.threshold,
                                sampled=len(self.setup.participants),
                                detail="a rebuilt secret failed verification") from exc
        total, weight = self.quantizer.decode(acc)
        scale = self.setup.max_weight
        self._result = (total * scale, weight * scale)
        self._acc, self._revealed, self._shares = None, {}, {}
