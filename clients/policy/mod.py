"""The site policy as a ClientApp mod: a message that breaks it is refused before the node's data is read.

The node's own config names the policy (``site-policy``: the agent's
``--policy``; a simulated node may carry one too) and the file that counts its
rounds (``site-policy-rounds``; default beside the policy,
``<policy>.rounds.json``). The aggregator sets neither: a SuperNode's node
config is the device's own. The policy is read when first needed and again
whenever the file changes; a policy that cannot be read, or a file that went
away, refuses every train and evaluate message until it is mended.

The mod sits inside secure aggregation's (``clients.clientapp.client_mods``)
and outside every mod and handler that reads the node's data, so a refused
message reads nothing. What a message asks (:func:`round_ask`) comes from what
the device received and will itself do: secure aggregation counts only when
the protocol's earlier stages ran on this node for this round, so the mask
will be applied; the cohort is the instruction's; the DP budget is the run's
``[dp]`` section as the device received it; the task is hashed from the file
this device imports.
"""

from __future__ import annotations

import logging
import threading
from pathlib import Path

from flwr.app import ConfigRecord, Context, Message
from flwr.clientapp.typing import ClientAppCallable

from clients.policy.errors import PolicyError
from clients.policy.ledger import RoundLedger
from clients.policy.rules import RoundAsk, refusals, run_epsilon, task_digest
from clients.policy.spec import SitePolicy, load_policy
from core.errors import UpdateRejected
from core.instructions import COHORT, TrainConfig, quorum_settings
from core.replies import refusal
from learning.standardize import asks_for_statistics
from privacy.secagg.errors import SecAggError
from privacy.secagg.flower_records import RECORD, STATE_RECORD, read_request, record_of
from privacy.secagg.stage import Stage
from scenarios.runconfig import scenario_from_run_config

__all__ = ["policy_mod", "round_ask", "current_policy", "under_secure_aggregation", "POLICY_KEY", "ROUNDS_KEY"]

#: The node config key naming the site policy's file.
POLICY_KEY = "site-policy"
#: The node config key naming the file that counts the rounds trained (``max_rounds_per_day``).
ROUNDS_KEY = "site-policy-rounds"
UNREADABLE = "the site policy cannot be read (the device's log says why)"
UNCOUNTED = "the device's round count cannot be kept (the device's log says why)"

_log = logging.getLogger("quorum.policy")
_LOADED: dict[Path, tuple[tuple[int, int], SitePolicy]] = {}
_LOCK = threading.Lock()


def policy_mod(message: Message, context: Context, call_next: ClientAppCallable) -> Message:
    """Refuse a train or evaluate message that breaks the node's site policy, naming the rules; else pass it on.

    A node without ``site-policy`` in its config, or any other message, passes untouched.
    """
    path = context.node_config.get(POLICY_KEY)
    kind = message.metadata.message_type.partition(".")[0]
    if not path or kind not in ("train", "evaluate") or not message.has_content():
        return call_next(message, context)
    reasons = _judge(message, context, Path(str(path)), evaluation=kind == "evaluate")
    if reasons:
        _log.info("refused %s of round %s: %s", kind, message.metadata.group_id, "; ".join(reasons))
        return Message(refusal("; ".join(reasons)), reply_to=message)
    return call_next(message, context)


def _judge(message: Message, context: Context, path: Path, evaluation: bool) -> list[str]:
    """Return the reasons to refuse ``message`` (none: accept it, counted when it trains under a daily limit)."""
    try:
        policy = current_policy(path)
    except PolicyError as exc:
        _log.warning("refusing every message: %s", exc)
        return [UNREADABLE]
    if policy.is_empty():
        return []
    ask = round_ask(message, context, policy, evaluation)
    if policy.max_rounds_per_day is None or evaluation or not ask.trains:
        return refusals(policy, ask)
    ledger = RoundLedger(_rounds_file(context, path))
    try:
        reasons = refusals(policy, ask, ledger.count())
        if not reasons:
            ledger.record()
    except PolicyError as exc:
        _log.warning("refusing to train: %s", exc)
        return [UNCOUNTED]
    return reasons


def _rounds_file(context: Context, policy: Path) -> Path:
    named = context.node_config.get(ROUNDS_KEY)
    return Path(str(named)) if named else policy.with_name(policy.stem + ".rounds.json")


def current_policy(path: Path) -> SitePolicy:
    """Return the policy in ``path``: read once, and again whenever the file changes.

    Raises
    ------
    PolicyError
        The file is gone or cannot be read, or its policy is refused (naming the key and value).
    """
    try:
        stat = path.stat()
    except OSError:
        raise PolicyError(f"{path}: the site policy is gone; every message is refused until it is back") from None
    version = (stat.st_mtime_ns, stat.st_size)
    with _LOCK:
        kept = _LOADED.get(path)
    if kept is not None and kept[0] == version:
        return kept[1]
    policy = load_policy(path)
    with _LOCK:
        _LOADED[path] = (version, policy)
    return policy


def round_ask(message: Message, context: Context, policy: SitePolicy, evaluation: bool = False) -> RoundAsk:
    """Read what ``message`` asks of this node, as far as ``policy``'s rules need it (the rest is left unread)."""
    config = _settings(message)
    needs_run = policy.max_epsilon is not None or policy.allowed_tasks is not None
    scenario = scenario_from_run_config(dict(context.run_config)) if needs_run else None
    epsilon = run_epsilon(scenario) if scenario is not None and policy.max_epsilon is not None else None
    task = ""
    if scenario is not None and policy.allowed_tasks is not None:
        try:
            task = task_digest(scenario.task)
        except Exception as exc:  # a task that cannot be imported or read is no listed task
            _log.warning("cannot identify the task %r: %s: %s", scenario.task.entry, type(exc).__name__, exc)
    return RoundAsk(evaluation=evaluation, secure=under_secure_aggregation(message, context), epsilon=epsilon,
                    cohort=None if config is None else config.get(COHORT), task=task,
                    trains=not asks_for_statistics(message.content))


def _settings(message: Message) -> TrainConfig | None:
    """Return the instruction's settings; ``None`` for a message with none, or with settings this device cannot read."""
    try:
        return quorum_settings(message.content)
    except UpdateRejected:  # the handler fails on them anyway: here, they state nothing
        return None


def under_secure_aggregation(message: Message, context: Context) -> bool:
    """Whether this node's update for ``message`` will be masked by secure aggregation.

    True only for the protocol's masked-input request of a round whose earlier
    stages this node completed (its protocol state for that round is kept):
    this mod runs inside ``secagg_mod``, which masks whatever the handlers
    inside it answer such a request with. A flag in the instruction proves
    nothing; a masked-input request without the earlier stages is refused by
    the protocol itself.
    """
    if record_of(message.content, RECORD, ConfigRecord) is None:
        return False
    try:
        stage, round_id, _ = read_request(message.content)
    except (SecAggError, ValueError):
        return False
    kept = record_of(context.state, STATE_RECORD, ConfigRecord)
    return stage is Stage.MASKED_INPUT and kept is not None and kept.get("round") == round_id
