"""Count the files one round's updates cross, from the clients' replies to the stored model.

Runs one in-process FedAvg round (four clients of sklearn's digits, no
evaluation) under a profile hook and records every product function the
server calls from the moment the first client has built its reply
(``core.replies.train_reply``) until the round is committed
(``runstore.store.RunStore.commit_round`` returns). What runs inside a client
(under Flower's ``ClientApp``: Quorum's mods, the handlers, training) is left
out: the path is what the server does with an update once it exists.

Prints the files in the order the path first reaches them, their count, and
the hops: calls from one package into another, and the round trips
``aggregator -> core -> aggregator`` (a core function calling back into the
aggregator). Run it from a checkout's root; ``--root`` measures another
checkout (an older commit's ``git worktree``) with the same script::

    python bench/update_path.py
    python bench/update_path.py --root /tmp/before
    python bench/update_path.py --quick    # the same round (it takes seconds already), as every bench takes it

Ends with one JSON line: ``files``, ``cross_package_calls``, ``round_trips``
(the three counts).
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import threading
from pathlib import Path
from types import FrameType
from typing import Any

PACKAGES = ("core", "runstore", "scenarios", "privacy", "aggregator", "clients", "runtimes")


def _on_a_client(frame: FrameType | None) -> bool:
    """Whether ``frame`` runs inside a client: under Flower's ``ClientApp`` or Quorum's ``clients`` package."""
    while frame is not None:
        name = frame.f_code.co_filename
        if "/flwr/clientapp/" in name or "/clients/" in name or "/learning/" in name:
            return True
        frame = frame.f_back
    return False


class _PathRecorder:
    """A profile hook: the product files the server calls between the first reply and the round's commit."""

    def __init__(self, root: Path) -> None:
        self.prefix = str(root.resolve()) + "/"
        self.order: list[str] = []
        self.edges: set[tuple[str, str]] = set()
        self.round_trips: set[tuple[str, str, str]] = set()
        self.on = self.done = False

    def _rel(self, frame: FrameType | None) -> str | None:
        if frame is None or not frame.f_code.co_filename.startswith(self.prefix):
            return None
        path = frame.f_code.co_filename[len(self.prefix):]
        return path if path.split("/", 1)[0] in PACKAGES else None

    def __call__(self, frame: FrameType, event: str, _arg: object) -> None:
        """Record one call (``sys.setprofile``'s signature)."""
        here = self._rel(frame) if event in ("call", "return") and not self.done else None
        if here is None:
            return
        function = frame.f_code.co_name
        if event == "call" and here == "core/replies.py" and function == "train_reply":
            self.on = True
        if event == "return" and here.endswith("/store.py") and function == "commit_round":  # aggregator/ before
            self.done = True
        if self.on and event == "call" and not _on_a_client(frame):
            self._call(frame, here)

    def _call(self, frame: FrameType, here: str) -> None:
        if here not in self.order:
            self.order.append(here)
        caller = self._rel(frame.f_back)
        if caller is None or caller.split("/")[0] == here.split("/")[0]:
            return
        self.edges.add((caller, here))
        above = self._rel(frame.f_back.f_back) if frame.f_back is not None else None
        if above is not None and (above.split("/")[0], caller.split("/")[0], here.split("/")[0]) == \
                ("aggregator", "core", "aggregator"):
            self.round_trips.add((above, caller, here))


def measure(root: Path) -> dict[str, Any]:
    """Run one round in the checkout at ``root``; return the files and hops of its updates' path."""
    sys.path.insert(0, str(root))
    from runtimes.simulation import simulate
    from scenarios.schema import scenario_from_dict

    scenario = scenario_from_dict({
        "name": "path", "seed": 3, "rounds": 1,
        "data": {"dataset": "digits", "partition": "iid", "server_test_fraction": 0.2},
        "model": {"name": "logreg"},
        "federation": {"clients": 4, "fraction": 1.0, "min_clients": 1, "deadline_s": 60.0},
        "training": {"local_epochs": 1, "batch_size": 16, "lr": 0.1},
        "evaluation": {"federated": False, "server": False},
    }, source="bench")
    recorder = _PathRecorder(root)
    with tempfile.TemporaryDirectory() as tmp:
        threading.setprofile(recorder)
        sys.setprofile(recorder)
        try:
            simulate(scenario, db_url=f"sqlite:///{tmp}/runs.db", workers=1)
        finally:
            sys.setprofile(None)
            threading.setprofile(None)  # type: ignore[arg-type]
    return {"files": recorder.order, "edges": sorted(recorder.edges), "round_trips": sorted(recorder.round_trips)}


def main() -> None:
    """Print the path's files, their count and the hops."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--root", type=Path, default=Path.cwd(), help="the checkout to measure (default: here)")
    parser.add_argument("--quick", action="store_true", help="the same one round: seconds already")
    args = parser.parse_args()
    result = measure(args.root)
    print("files on the path, in the order an update reaches them:")
    for path in result["files"]:
        print(f"  {path}")
    packages = [b.split("/")[0] for _, b in result["edges"]]
    print(f"server files: {len(result['files'])}; cross-package calls: "
          f"{len(result['edges'])} ({', '.join(sorted(set(packages)))}); "
          f"aggregator -> core -> aggregator round trips: {len(result['round_trips'])}")
    for trip in result["round_trips"]:
        print("  round trip: " + " -> ".join(trip))
    print(json.dumps({"files": len(result["files"]), "cross_package_calls": len(result["edges"]),
                      "round_trips": len(result["round_trips"]), "quick": args.quick}))


if __name__ == "__main__":
    main()
