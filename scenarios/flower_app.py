"""The scenario of a stock Flower app run under Quorum's ServerApp, from the app's own run-config keys.

A run config without Quorum's ``scenario`` / ``scenario-json`` is a Flower
app's (``aggregator.flower_app``). Its keys are of three kinds, and none is
silently dropped:

- the ones Flower's templates and official examples give their ServerApp
  (:data:`HONOURED`: ``num-server-rounds``, ``fraction-train``,
  ``fraction-evaluate``, ``learning-rate``, ...) become the run's settings with
  Flower's meaning (``FedAvg``'s defaults where a key is absent: 3 rounds,
  every node trains and evaluates, at least 2 nodes each);
- server-side keys Quorum's ServerApp cannot apply (:data:`REFUSED`) stop the
  run before it starts, naming the key and what to do instead;
- every other key is the ClientApp's own (quickstart-sklearn's ``penalty``): it is in
  the run config every node sees, and Quorum's ServerApp lists it in its log.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from scenarios.bounds import MAX_CLIENTS
from scenarios.errors import ScenarioError
from scenarios.parse import show

if TYPE_CHECKING:  # the schema imports numpy: `quorum flower run --help` reads this module's bounds without it
    from scenarios.schema import Scenario

__all__ = ["is_flower_app", "flower_app_scenario", "min_available", "first_message_timeout", "check_seconds", "AppKeys",
           "HONOURED", "REFUSED", "QUORUM_KEYS", "FIRST_MESSAGE_KEY", "FIRST_MESSAGE_S", "MAX_FIRST_MESSAGE_S"]

#: A Flower app's run-config keys Quorum's ServerApp applies, and the setting each becomes.
HONOURED = {
    "num-server-rounds": "rounds",
    "fraction-train": "federation: floor(fraction x nodes) train, at least min-train-nodes",
    "fraction-fit": "federation: as fraction-train (Flower's legacy name)",
    "fraction-evaluate": "evaluation.fraction (0: no federated evaluation)",
    "min-train-nodes": "federation: at least this many nodes train (FedAvg's default 2)",
    "min-fit-clients": "federation: as min-train-nodes (legacy name)",
    "min-evaluate-nodes": "evaluation.min_clients (FedAvg's default 2)",
    "min-evaluate-clients": "evaluation.min_clients (legacy name)",
    "min-available-nodes": "nodes waited for before round 1 (FedAvg's default 2)",
    "min-available-clients": "as min-available-nodes (legacy name)",
    "learning-rate": "training.lr, sent to the clients as the train config's \"lr\"",
    "lr": "training.lr, sent as \"lr\"",
    "local-epochs": "training.local_epochs, sent as \"local-epochs\"",
    "batch-size": "training.batch_size (the ClientApp reads it from its run config)",
    "seed": "seed (client sampling)",
}
#: Server-side keys of Flower's strategies that Quorum's ServerApp does not apply to a Flower app: refused.
REFUSED = {
    "proximal-mu": "FedProx's proximal term: run the app with a Quorum scenario ([strategy] name = \"fedprox\", "
                   "[strategy.fedprox] mu = ...) and the scenario key",
    "server-learning-rate": "a server learning rate: run the app with a Quorum scenario ([strategy] server_lr)",
    "server-lr": "a server learning rate: run the app with a Quorum scenario ([strategy] server_lr)",
}
#: Quorum's own keys (pyproject.toml's [tool.flwr.app.config]); ``initial-arrays``: aggregator.app_model.
QUORUM_KEYS = ("scenario", "scenario-json", "db", "resume", "engine", "overrides", "wait-clients-s", "initial-arrays",
               "first-message-timeout-s")
#: The run-config key of the seconds the app's own ServerApp has to send its first message (``aggregator.app_model``
#: runs it up to there for the model); ``quorum flower run --first-message-timeout`` sets it.
FIRST_MESSAGE_KEY = "first-message-timeout-s"
#: Its default: model building (a download of pretrained weights included) well within; a hung app not for ever.
FIRST_MESSAGE_S = 300.0
#: Its largest value: a day.
MAX_FIRST_MESSAGE_S = 86_400.0

_DEFAULT_ROUNDS = 3  # flwr.serverapp.strategy.Strategy.start(num_rounds=3)
_FEDAVG_MIN_NODES = 2  # FedAvg's min_train_nodes, min_evaluate_nodes, min_available_nodes


@dataclass(frozen=True)
class AppKeys:
    """What became of a Flower app's run-config keys: honoured (key = value), and left to its ClientApp."""

    honoured: tuple[str, ...]
    client: tuple[str, ...]

    def describe(self) -> str:
        """Return one line for the run's log: the keys honoured, and those left to the ClientApp."""
        honoured = ", ".join(self.honoured) or "none"
        client = ", ".join(self.client) or "none"
        return f"run config honoured: {honoured}; left to the ClientApp: {client}"


def is_flower_app(run_config: Mapping[str, Any]) -> bool:
    """Whether a run config is a Flower app's: it names no Quorum scenario (``scenario`` / ``scenario-json``)."""
    return not (run_config.get("scenario") or run_config.get("scenario-json"))


def min_available(run_config: Mapping[str, Any]) -> int:
    """Return the nodes a Flower app waits for before round 1 (``min-available-nodes``; FedAvg's default 2)."""
    return _whole(run_config, ("min-available-nodes", "min-available-clients"), _FEDAVG_MIN_NODES, low=1,
                  high=MAX_CLIENTS)


def first_message_timeout(run_config: Mapping[str, Any]) -> float:
    """Return the seconds the app's own ServerApp has to send its first message (:data:`FIRST_MESSAGE_KEY`).

    Raises
    ------
    ScenarioError
        A value that is not seconds in (0, a day], naming the key and the value.
    """
    found = _first(run_config, (FIRST_MESSAGE_KEY,))
    return FIRST_MESSAGE_S if found is None else check_seconds(f"run config {FIRST_MESSAGE_KEY}", found[1])


def check_seconds(name: str, value: Any, most: float = MAX_FIRST_MESSAGE_S) -> float:
    """Return ``value`` as seconds: a number above 0 and at most ``most`` (so neither NaN nor infinite).

    Raises
    ------
    ScenarioError
        Anything else, naming ``name`` (a key, an option) and the value.
    """
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 < value <= most:  # NaN compares False
        raise ScenarioError(f"{name} = {show(value)}: expected seconds above 0 and at most {most:g}")
    return float(value)


def flower_app_scenario(run_config: Mapping[str, Any], *, clients: int, name: str) -> tuple[Scenario, AppKeys]:
    """Build the run's scenario from a Flower app's run config, ``clients`` nodes being connected.

    Raises
    ------
    ScenarioError
        A :data:`REFUSED` key, or an honoured key whose value is not usable (naming the key and value).
    """
    from scenarios.schema import scenario_from_dict  # numpy with it: imported when a run is planned

    refused = [k for k in REFUSED if k in run_config]
    if refused:
        key = refused[0]
        raise ScenarioError(f"run config {key} = {run_config[key]!r}: Quorum's ServerApp does not apply {REFUSED[key]}")
    rounds = _whole(run_config, ("num-server-rounds",), _DEFAULT_ROUNDS, low=1)
    train_fraction = _fraction(run_config, ("fraction-train", "fraction-fit"), allow_zero=False)
    eval_fraction = _fraction(run_config, ("fraction-evaluate",), allow_zero=True)
    min_train = _whole(run_config, ("min-train-nodes", "min-fit-clients"), _FEDAVG_MIN_NODES, low=0)
    min_eval = _whole(run_config, ("min-evaluate-nodes", "min-evaluate-clients"), _FEDAVG_MIN_NODES, low=0)
    per_round = min(clients, max(int(clients * train_fraction), min_train, 1))  # FedAvg.configure_train's count
    raw: dict[str, Any] = {
        "name": name, "seed": _whole(run_config, ("seed",), 0, low=0), "rounds": rounds,
        "federation": {"clients": clients, "clients_per_round": per_round, "min_clients": 1},
        "training": _training(run_config),
        "evaluation": {"federated": eval_fraction > 0, "server": False, "clients": "all",
                       "fraction": eval_fraction or 1.0, "min_clients": max(1, min(min_eval, clients))},
    }
    overrides = _overrides(run_config.get("overrides"))
    try:
        scenario = scenario_from_dict({**raw, **overrides}, source="the Flower app's run config")
    except ScenarioError as exc:
        given = ", ".join(f"{k} = {run_config[k]!r}" for k in HONOURED if k in run_config)
        raise ScenarioError(f"{exc} (from {given or 'no key'})") from None
    honoured = tuple(f"{k}={run_config[k]}" for k in HONOURED if k in run_config)
    client = tuple(sorted(k for k in run_config if k not in HONOURED and k not in QUORUM_KEYS))
    return scenario, AppKeys(honoured, client)


def _overrides(value: Any) -> dict[str, Any]:
    """Quorum's ``overrides`` key: a JSON object of scenario sections laid over the app's settings."""
    try:
        overrides = json.loads(str(value or "{}"))
    except json.JSONDecodeError as exc:
        raise ScenarioError(f"run config overrides = {value!r}: not JSON ({exc.msg} at character {exc.pos})") from None
    if not isinstance(overrides, dict):
        raise ScenarioError(f"run config overrides = {value!r}: expected a JSON object of scenario sections")
    return overrides


def _training(run_config: Mapping[str, Any]) -> dict[str, Any]:
    table: dict[str, Any] = {}
    lr = _first(run_config, ("learning-rate", "lr"))
    if lr is not None:
        table["lr"] = _number(lr[0], lr[1])
    epochs = _first(run_config, ("local-epochs",))
    if epochs is not None:
        table["local_epochs"] = _whole(run_config, ("local-epochs",), 1, low=1)
    if _first(run_config, ("batch-size",)) is not None:
        table["batch_size"] = _whole(run_config, ("batch-size",), 32, low=1)
    return table


def _first(run_config: Mapping[str, Any], keys: tuple[str, ...]) -> tuple[str, Any] | None:
    return next(((k, run_config[k]) for k in keys if k in run_config), None)


def _number(key: str, value: Any) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ScenarioError(f"run config {key} = {show(value)}: expected a number")
    try:
        return float(value)
    except OverflowError:  # an integer beyond ~1.8e308
        raise ScenarioError(f"run config {key} = {show(value)}: out of range (too large for a float)") from None


def _whole(run_config: Mapping[str, Any], keys: tuple[str, ...], default: int, *, low: int,
           high: int = 2**63 - 1) -> int:
    found = _first(run_config, keys)
    if found is None:
        return default
    key, value = found
    number = _number(key, value)
    if not number.is_integer() or number < low:
        raise ScenarioError(f"run config {key} = {show(value)}: expected a whole number >= {low}")
    if number > high:
        raise ScenarioError(f"run config {key} = {show(value)}: expected a whole number <= {high:,}")
    return int(number)


def _fraction(run_config: Mapping[str, Any], keys: tuple[str, ...], *, allow_zero: bool) -> float:
    found = _first(run_config, keys)
    if found is None:
        return 1.0
    key, value = found
    number = _number(key, value)
    if not (0 <= number <= 1) or (number == 0 and not allow_zero):
        low = "[0" if allow_zero else "(0"
        raise ScenarioError(f"run config {key} = {show(value)}: expected a fraction in {low}, 1]")
    return number
