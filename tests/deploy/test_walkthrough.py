"""docs/deploy.md's one-machine walkthrough, run from the page itself (issue 17, item 6).

The bash block after the ``<!-- walkthrough`` mark is read from the document
and run as it stands, with free ports in place of the page's 9443, 9440 and
8000, in a folder holding three devices' CSV files made here: scikit-learn's
digits as raw pixels (0-256, unscaled), non-IID (each device holds mostly
three classes). Then the page's own ``quorum client start`` line, changed one
mistake at a time (a CA that is not the federation's, a key never enrolled, a
revoked key), must stop on its own with the line the page's table promises.
When the page and the product drift apart, this fails.
"""

from __future__ import annotations

import csv
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
from sklearn.datasets import load_digits

from deploy.loopback import free_ports
from deploy.pki import ensure_tls
from deploy.preflight import agent_running
from tests.conftest import REPO, wait_for
from tests.deploy.conftest import needs_nginx

pytestmark = [needs_nginx, pytest.mark.e2e, pytest.mark.heavy]

DOC = REPO / "docs" / "deploy.md"
MARK = "<!-- walkthrough"
#: The page's ports, replaced by free ones (each must still be on the page).
PAGE_PORTS = ("9443", "9440", "8000")
#: The least federated accuracy the walkthrough's run must end with (the page's run: see docs/deploy.md).
ACCURACY_FLOOR = 0.7


def page_script() -> str:
    """The bash block that follows the walkthrough mark in docs/deploy.md."""
    after = DOC.read_text(encoding="utf-8").split(MARK, 1)[1]
    return after.split("```bash\n", 1)[1].split("\n```", 1)[0]


def page_table(first_column: str) -> str:
    """The message in the row of docs/deploy.md's table whose first column holds ``first_column``."""
    for line in DOC.read_text(encoding="utf-8").splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) >= 2 and first_column in cells[0]:
            return cells[-1].strip("`")
    raise AssertionError(f"docs/deploy.md has no table row for {first_column!r}")


def words(text: str) -> list[str]:
    """The words of a message that must match: no parenthesised detail, paths, numbers or placeholders."""
    text = re.sub(r"\([^()]*\)", " ", text)
    return [w for w in text.split() if not re.search(r"HOST|\.\.\.|[<>/0-9]|\.pem|\.key|\.csv|device-a", w)]


def says(message: str, output: str) -> bool:
    """Whether ``output`` holds the page's ``message``: its words, in order."""
    wanted, found = words(message), iter(words(output))
    return bool(wanted) and all(any(w == f for f in found) for w in wanted)


def write_devices(folder: Path, devices: int = 3, seed: int = 0) -> None:
    """device-1.csv .. device-N.csv: raw digits pixels 0-256, each device mostly three classes."""
    digits = load_digits()
    rng = np.random.default_rng(seed)
    home = digits.target % devices
    owner = np.where(rng.random(len(home)) < 0.85, home, rng.integers(0, devices, len(home)))
    for d in range(devices):
        with (folder / f"device-{d + 1}.csv").open("w", newline="") as handle:
            writer = csv.writer(handle)
            writer.writerow([f"p{i}" for i in range(64)] + ["label"])
            for row, label in zip(digits.data[owner == d] * 16, digits.target[owner == d], strict=True):
                writer.writerow([f"{v:g}" for v in row] + [int(label)])


def env() -> dict[str, str]:
    """The page's shell: this environment's ``quorum`` first; one torch thread per process (three agents
    and the ServerApp share the test machine: with a thread per core each, a round's training took
    10 to 40 times as long)."""
    return {**os.environ, "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}",
            "PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": "1"}


def run_bash(script: str, cwd: Path, timeout_s: float) -> subprocess.CompletedProcess[str]:
    """Run ``script`` in its own process group; on a timeout the whole group is killed (by its PID)."""
    proc = subprocess.Popen(["bash", "-c", script], cwd=cwd, env=env(), text=True, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, start_new_session=True)
    try:
        out, _ = proc.communicate(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, _ = proc.communicate()
        pytest.fail(f"timed out after {timeout_s:g} s:\n{out[-4000:]}")
    return subprocess.CompletedProcess(proc.args, proc.returncode, out, "")


def start_line(script: str, i: int) -> str:
    """The page's ``quorum client start`` command for device ``i``, without its redirection and ``&``."""
    joined = script.replace("\\\n", " ")
    line = next(line.strip() for line in joined.splitlines() if line.strip().startswith("quorum client start"))
    return re.sub(r"\s*>.*$", "", line).replace("$i", str(i))


def line_of(script: str, prefix: str) -> str:
    return next(line.strip() for line in script.splitlines() if line.strip().startswith(prefix))


@pytest.fixture
def folder(tmp_path: Path):
    """The walkthrough's folder: the devices' files and the checkout's scenarios; afterwards, everything
    the page started is stopped by PID (the agents by their workdirs' pid files, the aggregator by ``stop``)."""
    write_devices(tmp_path)
    (tmp_path / "scenarios").symlink_to(REPO / "scenarios")
    yield tmp_path
    try:
        subprocess.run([sys.executable, "-m", "quorum", "aggregator", "stop", "--config", "federation.toml"],
                       cwd=tmp_path, env=env(), capture_output=True, timeout=60)
    finally:
        _stop_agents(tmp_path)


def _stop_agents(folder: Path) -> None:
    """SIGTERM every agent the walkthrough left running (by its workdir's pid file), then wait for it."""
    for workdir in folder.glob("agent-*"):
        pid = agent_running(workdir) if workdir.is_dir() else None
        if pid is not None:
            os.kill(pid, signal.SIGTERM)
            wait_for(lambda w=workdir: agent_running(w) is None, 20, f"the agent in {workdir.name} to stop",
                     poll_s=0.2)


def test_the_walkthrough_trains_three_devices_and_each_setup_mistake_names_its_fix(folder: Path) -> None:
    script = page_script()
    for port, free in zip(PAGE_PORTS, free_ports(len(PAGE_PORTS)), strict=True):
        assert port in script, f"the walkthrough no longer uses port {port}: update PAGE_PORTS"
        script = re.sub(rf"\b{port}\b", str(free), script)

    started = time.monotonic()
    done = run_bash(script, folder, timeout_s=420)
    wall_s = time.monotonic() - started
    agents = "\n".join((folder / f"agent-{i}.log").read_text() for i in (1, 2, 3))
    assert done.returncode == 0, f"{done.stdout[-4000:]}\n--- agents ---\n{agents[-3000:]}"
    print(f"walkthrough: {wall_s:.0f} s from aggregator start to the stopped federation")
    print("\n".join(line for line in done.stdout.splitlines() if line.startswith(("submitted", "run "))))

    # the run trained: the last round's accuracy on the devices' held-out rows
    accuracies = [float(a) for a in re.findall(r"accuracy ([0-9.]+) \(on the devices\)", done.stdout)]
    assert accuracies and accuracies[-1] >= ACCURACY_FLOOR, done.stdout
    assert re.search(r"run \S+ finished", done.stdout), done.stdout
    assert _run_log_says(folder, "federated standardisation: 64 features from 3 of 3 clients")
    # each agent warned about the raw pixels as the page's table says, and connected
    assert says(page_table("raw 0-255 pixels"), agents), agents[-2000:]
    assert agents.count("connected to the aggregator as node") >= 3

    _the_three_mistakes(script, folder)


def _run_log_says(folder: Path, text: str) -> bool:
    from runstore.store import RunStore

    store = RunStore(f"sqlite:///{folder / 'federation' / 'runs' / 'quorum.db'}")
    return any(text in e.message for run in store.list_runs() for e in store.events(run.id))


def _the_three_mistakes(script: str, folder: Path) -> None:
    """The page's start line, one mistake at a time: each agent stops by itself with the page's line."""
    ready = run_bash(line_of(script, "quorum aggregator start"), folder, timeout_s=120)
    assert ready.returncode == 0, ready.stdout
    ensure_tls(folder / "wrong-ca", ["127.0.0.1"], name="another")
    keygen = run_bash("quorum client keygen stranger.key", folder, timeout_s=60)
    revoke = run_bash("quorum client revoke device-3 --config federation.toml", folder, timeout_s=60)
    assert keygen.returncode == 0 and revoke.returncode == 0, keygen.stdout + revoke.stdout
    mistakes = {
        "a `ca.pem` that is not the federation's": start_line(script, 1).replace(
            "--ca federation/tls/ca.pem", "--ca wrong-ca/ca.pem").replace("agent-1", "agent-wrong-ca"),
        "a key never enrolled, or revoked": start_line(script, 2).replace("device-2.key", "stranger.key").replace(
            "agent-2", "agent-stranger"),
        # a fresh workdir: agent-3's own session ended under a minute ago, which the agent would wait out
        "revoked": start_line(script, 3).replace("agent-3", "agent-revoked"),
    }
    # the three agents start at once (each stops by itself): a third of the wall time of one after another
    running = {mistake: subprocess.Popen(["bash", "-c", command], cwd=folder, env=env(), text=True,
                                         stdout=subprocess.PIPE, stderr=subprocess.STDOUT, start_new_session=True)
               for mistake, command in mistakes.items()}
    outputs: dict[str, str] = {}
    try:
        for mistake, proc in running.items():
            try:
                outputs[mistake] = proc.communicate(timeout=120)[0]
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                outputs[mistake] = proc.communicate()[0]
                pytest.fail(f"{mistake}: the agent did not stop by itself in 120 s:\n{outputs[mistake][-3000:]}")
    finally:
        for proc in running.values():  # a failure above leaves none of them running
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.communicate()
    for mistake, proc in running.items():
        out = outputs[mistake]
        row = "a key never enrolled, or revoked" if mistake == "revoked" else mistake
        assert proc.returncode in (2, 3), f"{mistake}: rc {proc.returncode}\n{out[-3000:]}"
        assert says(page_table(row), out), f"{mistake}:\n{out[-3000:]}"
        assert "restarting in" not in out, f"{mistake}: the agent looped\n{out[-3000:]}"
