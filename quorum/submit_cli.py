"""``quorum submit SCENARIO --to URL --token ...``: submit a run to a remote aggregator's dashboard.

The scenario file goes, as its TOML text, to the dashboard's ``POST /api/runs``
with an account's API token (a ``lead`` or an ``admin``: ``quorum accounts``);
the dashboard checks it and queues it, and the aggregator that leads the
federation submits it (``dashboard/submit.py``, ``deploy/submissions.py``).
The command prints the submission's id; with ``--wait`` it follows the
submission until the aggregator took it, then the run until it ends.

Exit codes, as the other commands': 0 submitted (with ``--wait``: the run
finished), 3 the run ended degraded, 1 the run failed, the aggregator could
not submit it, the dashboard could not be reached, or ``--wait`` timed out;
2 refused or bad input (the server's reason is printed).
"""

from __future__ import annotations

import ssl
import time
from pathlib import Path
from typing import Annotated, Any, NoReturn

import httpx
import typer
from rich.console import Console
from rich.text import Text

__all__ = ["submit_command", "TOKEN_ENV"]

TOKEN_ENV = "QUORUM_TOKEN"
#: Run statuses after which a run goes on no more, with the exit code each gives (``core.status``).
ENDINGS = {"finished": 0, "stopped_budget": 0, "degraded": 3, "failed": 1}
MAX_FILE = 256 * 1024
POLL_S = 1.0


def _fail(message: str, code: int = 2) -> NoReturn:
    err = Console(stderr=True, markup=False, highlight=False)
    err.print(Text.assemble(("error:", "bold red"), " ", message), soft_wrap=True)
    raise typer.Exit(code)


def _say(message: str) -> None:
    Console(markup=False, highlight=False, soft_wrap=True).print(message)


def _read(scenario: Path) -> str:
    try:
        with scenario.open("rb") as handle:
            raw = handle.read(MAX_FILE + 1)
    except OSError as exc:
        _fail(f"{scenario}: cannot read the scenario file ({exc.strerror or exc})")
    if len(raw) > MAX_FILE:
        _fail(f"{scenario}: larger than {MAX_FILE // 1024} KiB, the most a dashboard takes")
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError:
        _fail(f"{scenario}: not UTF-8 text")


def _reason(answer: httpx.Response) -> str:
    """Return the server's reason for an error answer, in one line (its JSON ``detail``, else the status)."""
    try:
        detail = answer.json().get("detail")
    except (ValueError, AttributeError):
        detail = None
    return f"{answer.status_code}: {str(detail) if detail else answer.reason_phrase}".splitlines()[0][:500]


def _call(client: httpx.Client, method: str, path: str, **kwargs: Any) -> dict[str, Any]:
    """One request; exit 2 on a refusal (4xx) naming the reason, 1 on a server error or no answer."""
    try:
        answer = client.request(method, path, **kwargs)
    except httpx.HTTPError as exc:
        _fail(f"{client.base_url}: no answer ({type(exc).__name__}: {str(exc)[:200]})", 1)
    if 400 <= answer.status_code < 500:
        _fail(f"refused by {client.base_url}: {_reason(answer)}", 2)
    if answer.status_code >= 300:
        _fail(f"{client.base_url} answered {_reason(answer)}", 1)
    try:
        found: dict[str, Any] = answer.json()
    except ValueError:
        _fail(f"{client.base_url} answered something that is not JSON", 1)
    return found


def _wait_submission(client: httpx.Client, submission: int, deadline: float) -> dict[str, Any]:
    """Poll the submission until the aggregator finished it (done or failed), or the deadline."""
    while True:
        found = _call(client, "GET", f"/api/submissions/{submission}")
        if found.get("status") in ("done", "failed"):
            return found
        if time.monotonic() >= deadline:
            _fail(f"submission {submission} is still {found.get('status')} (no leading aggregator took it?)", 1)
        time.sleep(POLL_S)


def _wait_run(client: httpx.Client, submission: int, deadline: float) -> int:
    """Poll the submission until it names its run, then the run until it ends; return the exit code."""
    run_id: str | None = None
    while True:
        if run_id is None:
            run_id = _call(client, "GET", f"/api/submissions/{submission}").get("run_id")
            if run_id is not None:
                _say(f"run {run_id}")
        status = _call(client, "GET", f"/api/runs/{run_id}").get("status") if run_id else None
        if status in ENDINGS:
            _say(f"run {run_id} {status}")
            return ENDINGS[str(status)]
        if time.monotonic() >= deadline:
            _fail(f"run {run_id or '(not opened yet)'} is still {status or 'starting'} after the --timeout", 1)
        time.sleep(POLL_S)


def submit_command(
    scenario: Annotated[Path, typer.Argument(help="The scenario file (TOML) to run.")],
    to: Annotated[str, typer.Option("--to", help="The dashboard of the aggregator: https://HOST:PORT.")],
    token: Annotated[str, typer.Option("--token", envvar=TOKEN_ENV, show_default=False, show_envvar=True,
                                       help="An account's API token (a lead's or an admin's).")] = "",
    wait: Annotated[bool, typer.Option("--wait", help="Follow the submission, then the run, until it ends.")]
    = False,
    ca: Annotated[Path | None, typer.Option("--ca", help="The CA certificate to trust for an https dashboard "
                                                          "(the federation's ca.pem).")] = None,
    federation: Annotated[str | None, typer.Option("--federation", help="Only this federation's aggregator "
                                                                        "may take it.")] = None,
    timeout: Annotated[float, typer.Option("--timeout", min=1.0, help="With --wait: give up after this many "
                                                                      "seconds.")] = 3600.0,
) -> None:
    """Submit a run to a remote aggregator: its dashboard queues it for the aggregator that leads.

    Exit code: 0 submitted (--wait: finished), 3 degraded, 1 failed or unreachable, 2 refused or bad input.
    """
    if not token:
        _fail(f"give an API token: --token TOKEN, or ${TOKEN_ENV} (quorum accounts token NAME)")
    if not to.startswith(("https://", "http://")):
        _fail(f"--to {to!r}: the dashboard's address, https://HOST:PORT")
    if ca is not None and not ca.is_file():
        _fail(f"--ca {ca}: no such file")
    text = _read(scenario)
    body: dict[str, Any] = {"scenario": text, **({"federation": federation} if federation else {})}
    headers = {"authorization": f"Bearer {token}", "accept": "application/json"}
    verify: ssl.SSLContext | bool = ssl.create_default_context(cafile=str(ca)) if ca is not None else True
    with httpx.Client(base_url=to.rstrip("/"), headers=headers, verify=verify, timeout=30.0) as client:
        submission = int(_call(client, "POST", "/api/runs", json=body)["submission"])
        _say(f"submission {submission} queued")
        if not wait:
            return
        deadline = time.monotonic() + timeout
        found = _wait_submission(client, submission, deadline)
        if found.get("status") == "failed":
            _fail(f"submission {submission} failed: {(found.get('result') or {}).get('error', '?')}", 1)
        code = _wait_run(client, submission, deadline)
    raise typer.Exit(code)
