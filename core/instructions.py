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

import math
from collections.abc import Mapping
from dataclasses import dataclass, field, fields, replace
from enum import Enum
from types import MappingProxyType
from typing import Any, Generic, TypeVar, cast

import numpy as np
from flwr.app import ArrayRecord, ConfigRecord, RecordDict

from core.aggregate import all_finite
from core.broadcast import Broadcast
from core.errors import UpdateRejected
from core.layouts import ParamLayout, encode_named, gather, npy_view

__all__ = [
    "TrainConfig", "Wire", "Instruction", "QUORUM_WIRE", "client_seed", "broadcast_of",
    "train_instruction", "evaluate_instruction", "parse_instruction", "read_instruction",
    "with_control", "control_of", "quorum_settings", "Setting", "SettingValue", "SETTINGS",
    "DOWNLINK_BITS", "SCAFFOLD_CONTROL", "CODEC_BITS", "CODEC_TOPK", "CODEC_RANDOMK", "CODEC_FEEDBACK", "CODEC_SEED",
    "CODEC_RESCALE", "DP_CLIP", "DP_NOISE_STD", "DP_ADAPTIVE", "DP_COUNT_NOISE_STD", "DP_DISCRETE", "STD_PASS",
    "STD_LIMIT", "STD_SCALES", "STD_MEAN", "STD_STD", "COHORT",
]

#: What one of Quorum's instruction settings may hold (a ``ConfigRecord`` value).
SettingValue = float | int | bool | str | bytes | list[float]
T = TypeVar("T")


@dataclass(frozen=True)
class Setting(Generic[T]):
    """One of Quorum's instruction settings: its key, its type, and the feature that owns it.

    On the wire it travels as ``x.<key>`` in the instruction's ``config``
    record. :data:`SETTINGS` is the one table of them: a :class:`TrainConfig`
    holds no key outside it and no value :meth:`parse` refuses, so a feature
    reads its settings typed (:meth:`TrainConfig.get`) and no module spells a
    key but this one.
    """

    key: str
    kind: type[T]
    owner: str

    def parse(self, value: object) -> T:
        """Return ``value`` as this setting's type; a bool is not a number, a number not a bool.

        Raises
        ------
        ValueError
            ``value`` is not of the setting's type (or a list with a non-number), naming the key.
        """
        kind: type[Any] = self.kind
        out: object = None
        if kind is list:
            if isinstance(value, list) and all(_finite_number(v) for v in value):
                out = [float(v) for v in value]
        elif kind is float:
            if _finite_number(value):
                out = float(value)  # type: ignore[arg-type]  # checked: an int or a float
        elif isinstance(value, kind) and (kind is bool or not isinstance(value, bool)):
            out = value
        if out is not None:
            return cast(T, out)  # checked above: a value of the setting's kind
        raise ValueError(f"instruction setting x.{self.key} = {_shown(value)} is not a {_KIND_NAMES[kind]} "
                         f"(set by {self.owner})")


_KIND_NAMES: dict[type[Any], str] = {float: "finite number", int: "integer", bool: "boolean", str: "string",
                                     bytes: "byte string", list: "list of finite numbers"}


def _finite_number(value: object) -> bool:
    """Whether ``value`` is an int or a float (not a bool) whose float is finite (not NaN, not +-inf, not huge)."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return False
    try:
        return math.isfinite(float(value))
    except OverflowError:  # an int beyond float's range
        return False


def _shown(value: object) -> str:
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


#: The precision the global model travels in (``[compression] downlink_bits``).
DOWNLINK_BITS = Setting("dl-bits", int, "[compression] downlink_bits")
#: SCAFFOLD's server control variate, float32 bytes in the units of one local step
#: (``lr * c``; Karimireddy et al., ICML 2020).
SCAFFOLD_CONTROL = Setting("scaffold-c", bytes, "the scaffold strategy")
#: The uplink codec (:class:`core.compress.Codec`, ``[compression]``).
CODEC_BITS = Setting("cx-bits", int, "[compression]")
CODEC_TOPK = Setting("cx-topk", float, "[compression] topk")
CODEC_RANDOMK = Setting("cx-randomk", float, "[compression] randomk")
CODEC_FEEDBACK = Setting("cx-ef", bool, "[compression] error_feedback")
CODEC_SEED = Setting("cx-seed", int, "[compression]")
CODEC_RESCALE = Setting("cx-rescale", bool, "[compression]")
#: What a client does for client-level DP (``privacy.dp.ClientDPConfig``, ``[dp]``).
DP_CLIP = Setting("dp-clip", float, "[dp]")
DP_NOISE_STD = Setting("dp-noise-std", float, "[dp]")
DP_ADAPTIVE = Setting("dp-adaptive", bool, "[dp] adaptive_clipping")
DP_COUNT_NOISE_STD = Setting("dp-count-noise-std", float, "[dp]")
DP_DISCRETE = Setting("dp-discrete", bool, "[dp] mechanism")
#: Federated standardisation (``learning.standardize``): the statistics pass asked for (``flags``,
#: ``means``, ``spread``), its clip range, the features' scales; the mean and std every later
#: instruction carries.
STD_PASS = Setting("std-pass", str, "[data] standardize")
STD_LIMIT = Setting("std-limit", float, "[data] standardize")
STD_SCALES: Setting[list[float]] = Setting("std-scales", list, "[data] standardize")
STD_MEAN: Setting[list[float]] = Setting("std-mean", list, "[data] standardize")
STD_STD: Setting[list[float]] = Setting("std-std", list, "[data] standardize")
#: How many clients the round asked (its cohort; FedBuff's: the updates one step folds), as the aggregator
#: states it: what a device's site policy checks ``min_cohort`` against (``clients.policy``).
COHORT = Setting("cohort", int, "the round loop")

#: Every setting an instruction may carry, by key: the one table.
SETTINGS: dict[str, Setting[Any]] = {s.key: s for s in (
    DOWNLINK_BITS, SCAFFOLD_CONTROL, CODEC_BITS, CODEC_TOPK, CODEC_RANDOMK, CODEC_FEEDBACK, CODEC_SEED,
    CODEC_RESCALE, DP_CLIP, DP_NOISE_STD, DP_ADAPTIVE, DP_COUNT_NOISE_STD, DP_DISCRETE, STD_PASS, STD_LIMIT,
    STD_SCALES, STD_MEAN, STD_STD, COHORT)}


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

    ``settings`` holds the features' settings (DP, compression, SCAFFOLD,
    standardisation), each a :class:`Setting` of :data:`SETTINGS`: read them
    with :meth:`get`, add them with :meth:`with_settings`. A key outside the
    table or a value of the wrong type is a ``ValueError`` naming it, when the
    config is built and so when an instruction is read.
    """

    round: int
    epochs: int
    batch_size: int
    lr: float
    seed: int
    momentum: float = 0.0
    proximal_mu: float = 0.0
    settings: Mapping[str, SettingValue] = field(default_factory=dict)
    steps: int = 0
    app: dict[str, float | int | bool | str] = field(default_factory=dict)

    def __post_init__(self) -> None:
        """Check every setting against :data:`SETTINGS` (its key known, its value of its type).

        Raises
        ------
        ValueError
            An unknown key or a mistyped value, named.
        """
        checked: dict[str, SettingValue] = {}
        for key, value in self.settings.items():
            setting = SETTINGS.get(key)
            if setting is None:
                shown = key if isinstance(key, str) and key.isprintable() and len(key) <= 60 else _shown(key)
                raise ValueError(f"instruction setting x.{shown} is not one of this Quorum's settings: the "
                                 "aggregator may run a newer Quorum (upgrade this device), and a feature's "
                                 "setting is never ignored")
            checked[key] = setting.parse(value)
        object.__setattr__(self, "settings", MappingProxyType(checked))  # read-only: checked once, kept so

    def get(self, setting: Setting[T]) -> T | None:
        """Return the value of ``setting`` this config carries, or ``None``."""
        value = self.settings.get(setting.key)
        return None if value is None else setting.parse(value)

    def with_settings(self, values: Mapping[Setting[Any], SettingValue]) -> TrainConfig:
        """Return a copy carrying ``values`` as well (over the same settings' values here)."""
        return replace(self, settings={**self.settings, **{s.key: v for s, v in values.items()}})

    def to_record(self) -> ConfigRecord:
        """Encode these settings as the instruction's ``config`` record, with the names a Flower client reads."""
        data: dict[str, Any] = {f.name: getattr(self, f.name) for f in fields(self)
                                if f.name not in ("settings", "app")}
        data.update({f"x.{k}": v for k, v in self.settings.items()})
        # the marker of Quorum's layout, and the names a Flower client reads (Flower's FedAvg, quickstart)
        data.update({QUORUM_WIRE: 2, **{alias: data[key] for alias, key in _FLOWER_ALIASES.items()}})
        return ConfigRecord({**data, **self.app})

    @classmethod
    def from_record(cls, record: ConfigRecord) -> TrainConfig:
        """Decode the settings :meth:`to_record` wrote; ``x.`` keys go to ``settings``, unknown keys to ``app``.

        Raises
        ------
        ValueError
            An ``x.`` key that is not one of :data:`SETTINGS`, or a value of the wrong type.
        """
        data: dict[str, Any] = {k: v for k, v in dict(record).items()
                                if k != QUORUM_WIRE and k not in _FLOWER_ALIASES}
        settings = {k[2:]: data.pop(k) for k in list(data) if k.startswith("x.")}
        known = {f.name for f in fields(cls)}
        app = {k: data.pop(k) for k in list(data) if k not in known}
        return cls(**data, settings=settings, app=app)

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
    bits = broadcast_of(config).bits
    arrays = ArrayRecord(encode_named(params, layout) if bits == 32 else broadcast_of(config).encode(params, layout))
    settings = config.to_record()
    return RecordDict({"arrays": arrays, "config": settings,
                       f"{legacy}.parameters": arrays, f"{legacy}.config": settings})


def with_control(config: TrainConfig, control: np.ndarray) -> TrainConfig:
    """``config`` carrying SCAFFOLD's server control variate ``control`` (float32, one value per parameter)."""
    payload = np.ascontiguousarray(control, dtype=np.float32).tobytes()
    return config.with_settings({SCAFFOLD_CONTROL: payload})


def control_of(config: TrainConfig, size: int) -> np.ndarray | None:
    """SCAFFOLD's server control variate in ``config`` (a new writable array), or ``None`` when the round has none.

    Raises
    ------
    ValueError
        Not ``size`` finite float32 values.
    """
    payload = config.get(SCAFFOLD_CONTROL)
    if payload is None:
        return None
    if len(payload) != 4 * size:
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
    bits = config.get(DOWNLINK_BITS)
    return Broadcast(32 if bits is None else bits)  # Broadcast refuses all but 8, 16 and 32


def quorum_settings(content: RecordDict) -> TrainConfig | None:
    """Read the settings of one of Quorum's instructions without its model; ``None`` for any other message.

    What a ClientApp mod needs to know of the round (its ``settings``: DP, compression) before the
    handler trains. A stock Flower server's instruction carries none of Quorum's settings.

    Raises
    ------
    UpdateRejected
        A setting this client does not know (an aggregator running a newer Quorum) or of the wrong type,
        named: a feature's setting is never ignored.
    """
    settings = content.get("config") if isinstance(content, RecordDict) else None
    if not isinstance(settings, ConfigRecord) or QUORUM_WIRE not in settings:
        return None
    try:
        return TrainConfig.from_record(settings)
    except (TypeError, ValueError) as exc:  # a stray or mistyped setting: the task fails with the reason
        raise UpdateRejected(str(exc)) from None


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
