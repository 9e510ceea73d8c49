"""The instructions the aggregator sends a client, and how a client reads them.

Half of the wire format (the replies are :mod:`core.replies` and
:mod:`core.eval_replies`): these three modules are the only ones that spell a
message key, and both sides import them. An instruction carries
the global model once, as ``arrays``: an ``ArrayRecord`` shaped like the
model's ``state_dict`` (:mod:`core.layouts`), in float32 or the lighter
precision of :func:`broadcast_of`, with the :class:`TrainConfig` settings in
``config``; the legacy names ``fitins.*`` / ``evaluateins.*`` point at the same
two records. Quorum's ``config`` carries ``quorum-wire``; a client reads an
instruction from Quorum, a Flower message-API server or a legacy one, and
remembers which (:class:`Wire`) so that it answers in the same layout.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field, fields, replace
from enum import Enum
from typing import Any

import numpy as np
from flwr.app import ArrayRecord, ConfigRecord, RecordDict

from core.aggregate import all_finite
from core.broadcast import Broadcast
from core.errors import UpdateRejected
from core.layouts import ParamLayout, encode_named, gather, npy_view

__all__ = [
    "TrainConfig", "Wire", "Instruction", "QUORUM_WIRE", "DOWNLINK_BITS", "client_seed", "broadcast_of",
    "train_instruction", "evaluate_instruction", "parse_instruction", "read_instruction", "SCAFFOLD_CONTROL",
    "with_control", "control_of", "quorum_settings",
]


def client_seed(seed: int, server_round: int, node: int) -> int:
    """Return the training seed of ``node`` in ``server_round``.

    Independent streams per (run seed, round, node), so a resumed run trains
    exactly as an uninterrupted one.
    """
    return int(np.random.SeedSequence([seed, server_round, node]).generate_state(1)[0] & 0x7FFFFFFF)


@dataclass(frozen=True)
class TrainConfig:
    """What a client needs to train one round.

    ``seed`` is the run's seed; each client derives its own with
    :func:`client_seed`.

    ``steps > 0`` asks for that many local optimiser steps (mini-batches,
    cycling the data) instead of ``epochs`` passes (``[training] local_steps``).
    ``app`` is a Flower app's own train config (what its ServerApp sends, say
    ``{"momentum": 0.9}``), sent under its own names beside Quorum's, and over
    Quorum's value of the same name (the app's ClientApp reads the app's); an
    instruction's keys that Quorum does not know are read back into it.
    """

    round: int
    epochs: int
    batch_size: int
    lr: float
    seed: int
    momentum: float = 0.0
    proximal_mu: float = 0.0
    extra: dict[str, float | int | bool | str | bytes | list[float]] = field(default_factory=dict)
    steps: int = 0
    app: dict[str, float | int | bool | str] = field(default_factory=dict)

    def to_record(self) -> ConfigRecord:
        """Encode these settings as the instruction's ``config`` record, with the names a Flower client reads."""
        data: dict[str, Any] = {k: v for k, v in asdict(self).items() if k not in ("extra", "app")}
        data.update({f"x.{k}": v for k, v in self.extra.items()})
        # the marker of Quorum's layout, and the names a Flower client reads (Flower's FedAvg, quickstart)
        data.update({QUORUM_WIRE: 2, **{alias: data[key] for alias, key in _FLOWER_ALIASES.items()}})
        return ConfigRecord({**data, **self.app})

    @classmethod
    def from_record(cls, record: ConfigRecord) -> TrainConfig:
        """Decode the settings :meth:`to_record` wrote; ``x.`` keys go to ``extra``, unknown keys to ``app``."""
        data: dict[str, Any] = {k: v for k, v in dict(record).items()
                                if k != QUORUM_WIRE and k not in _FLOWER_ALIASES}
        extra = {k[2:]: data.pop(k) for k in list(data) if k.startswith("x.")}
        known = {f.name for f in fields(cls)}
        app = {k: data.pop(k) for k in list(data) if k not in known}
        return cls(**data, extra=extra, app=app)

    def updated_by(self, record: ConfigRecord) -> TrainConfig:
        """Return these settings overridden by a Flower server's ``config``.

        The keys read are ``lr``, ``local-epochs``, ``batch-size``,
        ``server-round`` and ``proximal-mu``; a value of the wrong type or range
        is an error.

        Raises
        ------
        ValueError
            Naming the key and the value.
        """
        changes: dict[str, Any] = {}
        for alias, key in {**_FLOWER_ALIASES, "lr": "lr", "batch-size": "batch_size",
                           "proximal-mu": "proximal_mu"}.items():
            value = record.get(alias)
            if value is None:
                continue
            wanted = float if key in ("lr", "proximal_mu") else int
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not (
                    wanted is float or float(value).is_integer()) or not 0 <= value < 1e9:
                raise ValueError(f"config {alias!r} = {value!r} is not a usable {wanted.__name__}")
            changes[key] = wanted(value)
        if "epochs" in changes:  # the server asked for epochs: that replaces the scenario's local steps
            changes["steps"] = 0
        return replace(self, **changes)


#: Config key marking an instruction as Quorum's (its client answers with a delta).
QUORUM_WIRE = "quorum-wire"
#: ``TrainConfig.extra`` key: the precision the global model travels in (``[compression] downlink_bits``).
DOWNLINK_BITS = "dl-bits"
#: ``TrainConfig.extra`` key: SCAFFOLD's server control variate, float32 bytes in the units of one local step
#: (``lr * c``; Karimireddy et al., ICML 2020).
SCAFFOLD_CONTROL = "scaffold-c"
#: Flower's names for Quorum's settings, sent beside them (alias -> TrainConfig field).
_FLOWER_ALIASES = {"server-round": "round", "local-epochs": "epochs"}


class Wire(Enum):
    """The layout a message is in: Quorum's own, Flower's message API, or Flower's legacy ``*Ins``/``*Res``."""

    QUORUM = "quorum"
    FLOWER = "flower"
    LEGACY = "legacy"


@dataclass(frozen=True)
class Instruction:
    """A train or evaluate instruction as a client reads it.

    The global model as one flat buffer (in the client's tensor order), the
    settings, and the layout to answer in.
    """

    params: np.ndarray
    config: TrainConfig
    wire: Wire
    layout: ParamLayout


def train_instruction(params: np.ndarray, config: TrainConfig, layout: ParamLayout | None = None) -> RecordDict:
    """Build the ``train`` instruction: the model once, named by ``layout`` (default: one tensor ``params``)."""
    return _instruction(params, config, layout, "fitins")


def evaluate_instruction(params: np.ndarray, config: TrainConfig, layout: ParamLayout | None = None) -> RecordDict:
    """Build the ``evaluate`` instruction (the same records; the legacy aliases are ``evaluateins.*``)."""
    return _instruction(params, config, layout, "evaluateins")


def _instruction(params: np.ndarray, config: TrainConfig, layout: ParamLayout | None, legacy: str) -> RecordDict:
    layout = layout or ParamLayout.flat(params.size)
    bits = config.extra.get(DOWNLINK_BITS, 32)
    arrays = ArrayRecord(encode_named(params, layout) if bits == 32 else broadcast_of(config).encode(params, layout))
    settings = config.to_record()
    return RecordDict({"arrays": arrays, "config": settings,
                       f"{legacy}.parameters": arrays, f"{legacy}.config": settings})


def with_control(config: TrainConfig, control: np.ndarray) -> TrainConfig:
    """``config`` carrying SCAFFOLD's server control variate ``control`` (float32, one value per parameter)."""
    payload = np.ascontiguousarray(control, dtype=np.float32).tobytes()
    return replace(config, extra={**config.extra, SCAFFOLD_CONTROL: payload})


def control_of(config: TrainConfig, size: int) -> np.ndarray | None:
    """SCAFFOLD's server control variate in ``config`` (a new writable array), or ``None`` when the round has none.

    Raises
    ------
    ValueError
        Not ``size`` finite float32 values.
    """
    payload = config.extra.get(SCAFFOLD_CONTROL)
    if payload is None:
        return None
    if not isinstance(payload, bytes) or len(payload) != 4 * size:
        raise ValueError(f"the round's SCAFFOLD control variate is not {size} float32 values")
    control = np.frombuffer(payload, dtype=np.float32).copy()
    if not all_finite(control):
        raise ValueError("the round's SCAFFOLD control variate holds NaN or Inf values")
    return control


def broadcast_of(config: TrainConfig) -> Broadcast:
    """Return the precision a round's global model travels in (``[compression] downlink_bits``).

    Raises
    ------
    ValueError
        A value other than 8, 16 or 32.
    """
    return Broadcast(config.extra.get(DOWNLINK_BITS, 32))  # type: ignore[arg-type]


def quorum_settings(content: RecordDict) -> TrainConfig | None:
    """Read the settings of one of Quorum's instructions without its model; ``None`` for any other message.

    What a ClientApp mod needs to know of the round (its ``extra``: DP, compression) before the
    handler trains. A stock Flower server's instruction carries none of Quorum's settings.
    """
    settings = content.get("config") if isinstance(content, RecordDict) else None
    if not isinstance(settings, ConfigRecord) or QUORUM_WIRE not in settings:
        return None
    return TrainConfig.from_record(settings)


def parse_instruction(content: RecordDict) -> tuple[np.ndarray, TrainConfig]:
    """Read the global model and training config of one of Quorum's train or evaluate instructions."""
    instruction = read_instruction(content)
    return instruction.params, instruction.config


def read_instruction(content: RecordDict, layout: ParamLayout | None = None,
                     defaults: TrainConfig | None = None) -> Instruction:
    """Read a train or evaluate instruction from Quorum or from a stock Flower server.

    Parameters
    ----------
    layout : ParamLayout, optional
        The client model's tensors: a Flower server's ``arrays`` are read by
        these names (a legacy server's positionally) into this order.
    defaults : TrainConfig, optional
        The settings a Flower server does not send (its ``config`` overrides
        ``lr``, ``local-epochs``, ...; see :meth:`TrainConfig.updated_by`).

    Raises
    ------
    ValueError
        The instruction is in no layout this client reads, or its model does not fit ``layout``.
    """
    settings, arrays = content.get("config"), content.get("arrays")
    legacy = [r for k in ("fitins", "evaluateins") if isinstance(r := content.get(f"{k}.parameters"), ArrayRecord)]
    try:
        if isinstance(settings, ConfigRecord) and QUORUM_WIRE in settings and isinstance(arrays, ArrayRecord):
            return _read_quorum(arrays, TrainConfig.from_record(settings))
        base = defaults or TrainConfig(round=0, epochs=1, batch_size=32, lr=0.01, seed=0)
        if isinstance(arrays, ArrayRecord):
            want = layout or ParamLayout(tuple(arrays), tuple(tuple(a.shape) for a in arrays.values()))
            if _positional(arrays, want):  # ArrayRecord(list of arrays): keys "0", "1", ... in the model's order
                want = ParamLayout(tuple(arrays), want.shapes)
            missing = [n for n in want.names if n not in arrays]
            if missing:
                raise UpdateRejected(f"the server's 'arrays' lack {missing[:3]}; this client's model is "
                                     f"{want.describe()}")
            params = gather([(n, arrays[n]) for n in want.names], want, "global model")
            config = base.updated_by(settings) if isinstance(settings, ConfigRecord) else base
            return Instruction(params, config, Wire.FLOWER, want)
        if legacy:
            return _read_legacy(legacy[0], content.get("fitins.config", content.get("evaluateins.config")),
                                layout, base)
    except UpdateRejected as exc:
        raise ValueError(str(exc)) from None
    raise ValueError(f"instruction is in no known layout: expected 'arrays' (an ArrayRecord) with 'config', "
                     f"or legacy 'fitins.parameters'; got {sorted(content)}")


def _read_quorum(arrays: ArrayRecord, config: TrainConfig) -> Instruction:
    """Quorum's instruction: the model as named tensors, in float32, float16 or 8-bit codes."""
    broadcast = broadcast_of(config)
    tensors = [(n, a) for n, a in arrays.items() if not n.endswith("@range")]
    own = ParamLayout(tuple(n for n, _ in tensors), tuple(tuple(a.shape) for _, a in tensors))
    params = broadcast.decode(arrays, own) if broadcast.bits == 8 else gather(tensors, own, "global model")
    if not all_finite(params):
        raise UpdateRejected("global model holds NaN or Inf values")
    return Instruction(params, config, Wire.QUORUM, own)


def _positional(arrays: ArrayRecord, layout: ParamLayout) -> bool:
    """Whether a Flower server's ``arrays`` name tensors by position where the client's model names them otherwise.

    Positional names are what ``ArrayRecord([a, b])`` gives, as NumPy and
    scikit-learn apps build theirs: keys ``"0"``, ``"1"``, ..., one tensor per
    name. They are read, and answered, in the model's order under the server's
    keys (the shapes must still agree).
    """
    keys = tuple(arrays)
    return (keys != layout.names and len(keys) == len(layout.names)
            and keys == tuple(str(i) for i in range(len(keys))))


def _read_legacy(record: ArrayRecord, settings: Any, layout: ParamLayout | None, base: TrainConfig) -> Instruction:
    """Read a legacy ``fitins``/``evaluateins`` instruction: unnamed ``.npy`` tensors, in the model's order."""
    tensors = [(k, a) for k, a in record.items() if k != "_empty"]
    if layout is None:
        layout = ParamLayout(tuple(k for k, _ in tensors), tuple(npy_view(bytes(a.data)).shape for _, a in tensors))
    config = base.updated_by(settings) if isinstance(settings, ConfigRecord) else base
    return Instruction(gather(tensors, layout, "global model"), config, Wire.LEGACY, layout)
