"""A stock Flower app under Quorum's ServerApp (issue 33, item 1), in-process: where its model comes from,
what becomes of its run-config keys, and what goes to Flower's log.

The apps here are a few lines each, written as Flower's templates write them:
a ClientApp of ``@app.train()`` / ``@app.evaluate()`` over a linear model
``w`` of numpy arrays, and a ServerApp running Flower's own ``FedAvg``. Each
client moves ``w`` a step towards its own target (``node id`` in every entry),
so the FedAvg model after a round is known by hand.
"""

from __future__ import annotations

import logging
import sys
from pathlib import Path

import numpy as np
import pytest
from flwr.app import ArrayRecord, ConfigRecord, Context, Message, MetricRecord, RecordDict
from flwr.clientapp import ClientApp
from flwr.serverapp import Grid, ServerApp
from flwr.serverapp.strategy import FedAvg
from hypothesis import given, settings
from hypothesis import strategies as st

from aggregator.app_model import arrays_of, first_reply_model, initial_model, model_from_arrays
from aggregator.errors import AppModelError, RunFailed
from aggregator.flower_app import FlowerApp, find_app, read_app, serve_flower_app
from aggregator.serverapp import app as quorum_serverapp
from runstore.store import RunStore
from runtimes.inprocess import InProcessGrid, NodeSpec
from scenarios.errors import ScenarioError
from scenarios.flower_app import HONOURED, QUORUM_KEYS, REFUSED, flower_app_scenario

STEP = 0.5  # each client moves w half way to its target


def client_app(*, builds_own_model: bool = False, fortran: bool = False) -> ClientApp:
    """A template-style ClientApp: ``w <- w + STEP * (node_id - w)``; evaluate reports ``mse`` and ``accuracy``."""
    app = ClientApp()

    @app.train()
    def train(msg: Message, context: Context) -> Message:
        arrays = msg.content["arrays"].to_numpy_ndarrays()
        if not arrays and builds_own_model:
            arrays = [np.zeros((2, 3)), np.zeros(3)]
        target = float(context.node_id)
        updated = [np.asfortranarray(a + STEP * (target - a)) if fortran else a + STEP * (target - a) for a in arrays]
        config = msg.content["config"]
        metrics = {"train_loss": float(np.mean((updated[0] - target) ** 2)), "num-examples": 10,
                   "lr": float(config.get("lr", -1.0)), "momentum": float(config.get("momentum", -1.0))}
        return Message(RecordDict({"arrays": ArrayRecord(updated), "metrics": MetricRecord(metrics)}), reply_to=msg)

    @app.evaluate()
    def evaluate(msg: Message, context: Context) -> Message:
        w = msg.content["arrays"].to_numpy_ndarrays()[0]
        metrics = {"mse": float(np.mean((w - 2.0) ** 2)), "accuracy": 0.5, "num-examples": 5}
        return Message(RecordDict({"metrics": MetricRecord(metrics)}), reply_to=msg)

    return app


#: The app's own ServerApp, as `flwr new` writes one: probed for its initial arrays and train config.
own_server = ServerApp()


@own_server.main()
def _own_main(grid: Grid, context: Context) -> None:
    arrays = ArrayRecord([np.ones((2, 3), dtype=np.float64), np.full(3, 2.0)])
    FedAvg().start(grid=grid, initial_arrays=arrays, train_config=ConfigRecord({"lr": 0.25, "momentum": 0.9}),
                   num_rounds=int(context.run_config["num-server-rounds"]))


def initial_arrays() -> list[np.ndarray]:
    """An `initial-arrays` hook: a function returning numpy arrays."""
    return [np.full((2, 3), 4.0), np.zeros(3)]


def nodes(n: int) -> list[NodeSpec]:
    return [NodeSpec(i + 1, {"partition-id": i, "num-partitions": n}) for i in range(n)]


def context(config: dict) -> Context:
    return Context(run_id=1, node_id=0, node_config={}, state=RecordDict(), run_config=config)


def serve(app: ClientApp, config: dict, db_url: str, n: int = 2, flower_app: FlowerApp | None = None):
    store = RunStore(db_url)
    with InProcessGrid(app, nodes(n), config) as grid:
        run_id, result = serve_flower_app(grid, context(config), store, app=flower_app, engine="inprocess",
                                          wait_s=0.0)
    return store, run_id, result


# -- where the model comes from ----------------------------------------------------------------------------


def test_the_model_is_the_apps_own_serverapps_first_message_with_its_train_config() -> None:
    # Execute: the hook names the app's own ServerApp; it is run until its first message
    with InProcessGrid(client_app(), nodes(2), {}) as grid:
        model = initial_model(grid, context({"num-server-rounds": 3,
                                             "initial-arrays": f"{__name__}:own_server"}), None)

    # Assert: its arrays (float64, converted once), its lr, and its other train-config keys to pass through
    assert model.layout.names == ("0", "1") and model.layout.shapes == ((2, 3), (3,))
    assert model.params.dtype == np.float32 and model.params.tolist() == [1.0] * 6 + [2.0] * 3
    assert model.lr == 0.25 and model.train_config == {"momentum": 0.9}
    assert "own_server" in model.source
    assert arrays_of(model, model.params)["0"].tolist() == [[1.0] * 3] * 2  # back in the app's names and shapes


def test_an_initial_arrays_hook_may_be_a_function_returning_numpy_arrays() -> None:
    with InProcessGrid(client_app(), nodes(1), {}) as grid:
        model = initial_model(grid, context({"initial-arrays": f"{__name__}:initial_arrays"}), None)

    assert model.params.tolist() == [4.0] * 6 + [0.0] * 3 and model.lr is None


def test_without_a_serverapp_the_first_reply_gives_the_model_names_and_shapes() -> None:
    # Execute: a ClientApp that builds its own model when the server sends none
    with InProcessGrid(client_app(builds_own_model=True), nodes(3), {}) as grid:
        model = first_reply_model(grid)

    # Assert: node 1 trained from zeros half way to 1.0
    assert model.layout.shapes == ((2, 3), (3,))
    assert model.params.tolist() == [0.5] * 9
    assert "node 1's reply" in model.source


def test_no_model_anywhere_is_an_error_naming_what_was_tried_and_the_hook() -> None:
    # A template ClientApp cannot train without the server's arrays, and there is no ServerApp to probe
    with InProcessGrid(client_app(), nodes(2), {}) as grid, pytest.raises(AppModelError) as caught:
        initial_model(grid, context({}), None)

    message = str(caught.value)
    assert "node 1's reply to a train message without arrays" in message
    assert "initial-arrays = \"module:attr\"" in message


def test_an_integer_tensor_joins_the_model_and_other_kinds_are_refused_by_name() -> None:
    w, steps = ArrayRecord([np.zeros(2)])["0"], ArrayRecord([np.array([7], np.int64)])["0"]
    model = model_from_arrays(ArrayRecord({"w": w, "steps": steps}), "the test's arrays")
    assert model.params.tolist() == [0.0, 0.0, 7.0] and model.layout.names == ("w", "steps")

    flags = ArrayRecord([np.zeros(1, np.bool_)])["0"]
    with pytest.raises(AppModelError, match="tensor 'mask' is bool: Quorum averages float and integer tensors"):
        model_from_arrays(ArrayRecord({"w": w, "mask": flags}), "the test's arrays")
    huge = ArrayRecord([np.array([2**24 + 1], np.int64)])["0"]
    with pytest.raises(AppModelError, match="'steps' is int64 with a value beyond 2\\^24"):
        model_from_arrays(ArrayRecord({"w": w, "steps": huge}), "the test's arrays")


# -- a whole run ---------------------------------------------------------------------------------------------


def test_a_flower_app_runs_with_its_own_model_lr_and_rounds(db_url: str) -> None:
    # Prepare: two nodes (targets 1 and 2), the app's own ServerApp's model (ones and twos), 2 rounds
    config = {"num-server-rounds": 2, "initial-arrays": f"{__name__}:own_server"}

    # Execute: the clients reply with Fortran-ordered float64 arrays, as scikit-learn's coef_ is
    store, run_id, result = serve(client_app(fortran=True), config, db_url)

    # Assert: FedAvg by hand (equal weights): w <- mean over targets t of (w + (t - w) / 2) = (w + 1.5) / 2
    assert result.status == "finished"
    w = np.array([1.0] * 6 + [2.0] * 3)
    for _ in range(2):
        w = (w + 1.5) / 2
    np.testing.assert_allclose(store.load_state(run_id).params, w, rtol=1e-6)
    rows = store.rounds(run_id)
    assert [r.answered for r in rows] == [2, 2]
    assert rows[-1].fed_accuracy == 0.5 and rows[-1].fed_loss is None  # no loss named: none, not a refusal
    assert rows[-1].metrics["fed-mse"] == pytest.approx(float(np.mean((w[:6] - 2.0) ** 2)))
    # the app's lr and its momentum reached the clients in the train config, under their own names
    assert {(c.metrics["lr"], c.metrics["momentum"]) for c in store.client_results(run_id, 1)} == {(0.25, 0.9)}
    # the stored scenario describes what ran: no Quorum task, data set or model (the app brought its own)
    recorded = store.get_run(run_id).scenario
    assert not {"task", "data", "model", "secagg", "dp"} & recorded.keys(), sorted(recorded)
    assert recorded["rounds"] == 2 and recorded["training"]["lr"] == 0.25


def batchnorm_app() -> ClientApp:
    """A PyTorch ClientApp as the quickstart writes one, its model with a BatchNorm layer: ``load_state_dict`` of
    the server's arrays (its int64 ``num_batches_tracked`` among them), a few SGD steps, ``state_dict`` back."""
    import torch

    app = ClientApp()

    @app.train()
    def train(msg: Message, context: Context) -> Message:
        net = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.BatchNorm1d(4), torch.nn.Linear(4, 2))
        net.load_state_dict(msg.content["arrays"].to_torch_state_dict())
        torch.manual_seed(context.node_id)
        x, y = torch.randn(32, 3) + context.node_id, torch.randint(0, 2, (32,))
        optimizer = torch.optim.SGD(net.parameters(), lr=0.1)
        for _ in range(2 + context.node_id):  # node 1: 3 batches, node 2: 4
            optimizer.zero_grad()
            torch.nn.functional.cross_entropy(net(x), y).backward()
            optimizer.step()
        arrays = ArrayRecord(net.state_dict())
        return Message(RecordDict({"arrays": arrays, "metrics": MetricRecord({"num-examples": 32})}), reply_to=msg)

    return app


def batchnorm_server() -> ArrayRecord:
    """The app's initial model (an `initial-arrays` hook): a fresh net's state dict, num_batches_tracked = 0."""
    import torch

    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.BatchNorm1d(4), torch.nn.Linear(4, 2))
    return ArrayRecord(net.state_dict())


def test_a_pytorch_app_with_batchnorm_averages_its_integer_batch_counter(db_url: str) -> None:
    # Execute: two rounds, each node trains 3 or 4 batches a round, FedAvg with equal weights
    config = {"num-server-rounds": 2, "initial-arrays": f"{__name__}:batchnorm_server",
              "fraction-evaluate": 0.0}
    store, run_id, result = serve(batchnorm_app(), config, db_url)

    # Assert: the int64 counter travelled and was averaged as Flower's FedAvg averages it: 0 -> 3.5 -> 6.5
    # (node 1 loads 3.5 into its long buffer as 3 and adds 3, node 2 as 3 and adds 4)
    assert result.status == "finished", result
    model = store.get_run(run_id).info["model"]
    assert "batchnorm_server" in model
    state = store.load_state(run_id)
    assert state is not None
    names = [k for k in batchnorm_server()]
    counter = names.index("1.num_batches_tracked")
    offset = sum(int(np.prod(batchnorm_server()[k].shape)) for k in names[:counter])
    assert state.params[offset] == (3 + 3 + 3 + 4) / 2


def test_fraction_evaluate_asks_that_share_of_the_nodes_at_least_min_evaluate_nodes(db_url: str) -> None:
    # Prepare: 6 nodes, fraction-evaluate 0.5 (3 of them); with 0 no federated evaluation at all
    counted: list[int] = []
    inner = client_app()

    def counting(message: Message, ctx: Context) -> Message:
        if message.metadata.message_type == "evaluate":
            counted.append(ctx.node_id)
        return inner(message, ctx)

    base = {"num-server-rounds": 1, "initial-arrays": f"{__name__}:initial_arrays"}

    # Execute
    serve(counting, {**base, "fraction-evaluate": 0.5}, db_url, n=6)
    half = len(counted)
    counted.clear()
    serve(counting, {**base, "fraction-evaluate": 0.1, "min-evaluate-nodes": 2}, db_url, n=6)
    floor = len(counted)
    counted.clear()
    store, run_id, _ = serve(counting, {**base, "fraction-evaluate": 0.0}, db_url, n=6)

    # Assert: Flower's FedAvg counts: max(floor(fraction x n), min_evaluate_nodes)
    assert (half, floor, len(counted)) == (3, 2, 0)
    assert store.rounds(run_id)[-1].fed_accuracy is None


@pytest.mark.parametrize(("key", "value", "why"), [
    ("proximal-mu", 0.1, "run config proximal-mu = 0.1: Quorum's ServerApp does not apply FedProx"),
    ("num-server-rounds", 2.5, "run config num-server-rounds = 2.5: expected a whole number >= 1"),
    ("fraction-train", 0, r"run config fraction-train = 0: expected a fraction in \(0, 1\]"),
    ("learning-rate", "fast", "run config learning-rate = 'fast': expected a number"),
])
def test_a_run_config_key_quorum_cannot_honour_stops_the_run_by_name(db_url: str, key: str, value: object,
                                                                       why: str) -> None:
    config = {"num-server-rounds": 1, "initial-arrays": f"{__name__}:initial_arrays", key: value}

    with pytest.raises(ScenarioError, match=why):
        serve(client_app(), config, db_url)

    assert RunStore(db_url).list_runs() == []  # refused before a run exists


# -- Quorum's ServerApp object, as `flwr run` calls it ---------------------------------------------------------


APP_PYPROJECT = """
[project]
name = "tiny-flower-app"
version = "1.0.0"
[tool.flwr.app]
publisher = "tests"
[tool.flwr.app.components]
serverapp = "aggregator.serverapp:app"
clientapp = "tinyapp.client_app:app"
[tool.flwr.app.config]
num-server-rounds = 2
batch-size = 8
"""


@pytest.fixture
def tiny_app(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A Flower app folder as `flwr new` lays it out, put on sys.path as Flower puts the app's folder."""
    (tmp_path / "tinyapp").mkdir()
    (tmp_path / "pyproject.toml").write_text(APP_PYPROJECT)
    (tmp_path / "tinyapp" / "__init__.py").write_text("")
    (tmp_path / "tinyapp" / "client_app.py").write_text("")
    (tmp_path / "tinyapp" / "server_app.py").write_text(
        f"from {__name__} import own_server as app  # the app's own ServerApp\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    return tmp_path


def flwr_records(caplog: pytest.LogCaptureFixture) -> list[logging.LogRecord]:
    return [r for r in caplog.records if r.name == "flwr" and "[quorum]" in r.getMessage()]


def test_quorums_serverapp_finds_the_app_and_logs_each_round_to_flowers_log(
        tiny_app: Path, db_url: str, caplog: pytest.LogCaptureFixture) -> None:
    # Prepare
    app = read_app(tiny_app)
    config = {**app.config, "db": db_url}

    # Execute: Quorum's ServerApp object, as the flwr-serverapp process calls it
    assert find_app() == app and app.own_serverapp == "tinyapp.server_app:app"
    with InProcessGrid(client_app(), nodes(2), config) as grid:
        quorum_serverapp(grid=grid, context=context(config))

    # Assert: the start (model, keys), one line per round, and the ending, on Flower's logger
    lines = [r.getMessage() for r in flwr_records(caplog)]
    assert "tinyapp.server_app:app (the app's own ServerApp" in lines[0]
    assert "run config honoured: num-server-rounds=2, batch-size=8; left to the ClientApp: none" in lines[0]
    assert lines[1].startswith("[quorum] round 1/2: accuracy 50.00%, mse ")
    assert "clients 2/2 answered" in lines[1] and lines[2].startswith("[quorum] round 2/2")
    assert " finished after 2 rounds" in lines[3]


def broken_app(message: Message, ctx: Context) -> Message:
    raise ValueError("no label column 'y'")


def test_a_failed_run_is_logged_with_its_reasons_and_raises_so_flower_records_it(
        tiny_app: Path, db_url: str, caplog: pytest.LogCaptureFixture) -> None:
    config = {**read_app(tiny_app).config, "db": db_url}

    with InProcessGrid(broken_app, nodes(2), config) as grid, pytest.raises(RunFailed, match="failed: no round"):
        quorum_serverapp(grid=grid, context=context(config))

    rounds = [r for r in flwr_records(caplog) if "round 1/2" in r.getMessage()]
    assert rounds[0].levelno == logging.WARNING and "2 failed: client 1 ValueError: no label column 'y'" in \
        rounds[0].getMessage()
    assert flwr_records(caplog)[-1].levelno == logging.ERROR


#: An app's ServerApp that exits with the run config's `exit-code` before it sends anything.
exiting_server = ServerApp()


@exiting_server.main()
def _exiting_main(grid: Grid, context: Context) -> None:
    sys.exit(int(context.run_config["exit-code"]))


@pytest.mark.parametrize("code", [0, 3])
def test_a_serverapp_exiting_0_leaves_the_model_to_the_first_reply_and_any_other_code_fails(code: int) -> None:
    # Execute: the app's own ServerApp (probed in a process of its own) calls sys.exit(code) before its first message
    config = {"exit-code": code}
    with InProcessGrid(client_app(builds_own_model=True), nodes(2), config) as grid:
        try:
            model = initial_model(grid, context(config), f"{__name__}:exiting_server")
        except RunFailed as exc:
            failed = str(exc)

    # Assert: 0 is a plain return (the next source gives the model); 3 is the app's own failure, named
    if code == 0:
        assert "node 1's reply" in model.source
    else:
        assert failed == (f"the app's ServerApp {__name__}:exiting_server exited with code 3 (SystemExit) before "
                          "its first message")


def test_under_flwr_run_a_serverapp_exiting_with_its_own_code_is_a_failed_run_flower_records(
        db_url: str, caplog: pytest.LogCaptureFixture) -> None:
    # Execute: Quorum's ServerApp as the flwr-serverapp process calls it; the app's model hook is a ServerApp
    # that calls sys.exit(3) (which Flower would otherwise take as the process's own exit)
    config = {"db": db_url, "num-server-rounds": 1, "initial-arrays": f"{__name__}:exiting_server", "exit-code": 3}
    with InProcessGrid(client_app(), nodes(2), config) as grid, pytest.raises(RunFailed) as caught:
        quorum_serverapp(grid=grid, context=context(config))

    # Assert: RunFailed (Flower records the run failed) with the reason; the stored run failed with it too
    (run,) = RunStore(db_url).list_runs()
    reason = "never started: the app's ServerApp " + f"{__name__}:exiting_server exited with code 3 (SystemExit)"
    assert str(caught.value).startswith(f"run {run.id} failed: {reason}")
    assert run.status == "failed" and run.error.startswith(reason) and run.rounds_done == 0
    assert flwr_records(caplog)[-1].levelno == logging.ERROR


_ANY_VALUE = st.one_of(
    st.none(), st.booleans(), st.integers(min_value=-(2**80), max_value=2**80),
    st.floats(allow_nan=True, allow_infinity=True), st.text(max_size=30), st.binary(max_size=10),
    st.lists(st.integers(), max_size=3))
_KEYS = st.sampled_from([*HONOURED, *REFUSED, "overrides", "penalty", "num-server-rounds"])


@settings(max_examples=500, deadline=None)
@given(run_config=st.dictionaries(_KEYS, _ANY_VALUE, max_size=6), clients=st.integers(min_value=1, max_value=50))
def test_any_run_config_gives_a_scenario_or_one_named_refusal(run_config: dict, clients: int) -> None:
    # A Flower app's run config is what its pyproject or `flwr run --run-config` says: huge integers, inf,
    # NaN, strings, bytes and lists where numbers belong must end in a ScenarioError naming the key, never
    # another exception or a scenario with unusable settings.
    try:
        scenario, keys = flower_app_scenario(run_config, clients=clients, name="app")
    except ScenarioError as exc:
        message = str(exc)
        assert "\n" not in message.strip()
        assert any(k in message for k in run_config), (run_config, message)
        return
    assert scenario.rounds >= 1 and 1 <= scenario.federation.clients_per_round <= clients
    assert np.isfinite(scenario.training.lr) and scenario.training.lr > 0
    rounds = run_config.get("num-server-rounds")
    if rounds is not None:
        assert scenario.rounds == rounds
    assert set(keys.client) == {k for k in run_config if k not in HONOURED and k not in QUORUM_KEYS}
