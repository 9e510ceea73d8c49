"""The scenario a Flower run was started with, read from its run config.

Both Flower apps (the ServerApp on the aggregator and the ClientApp on every
node) read the same ``[tool.flwr.app.config]`` keys: ``scenario-json`` (the
scenario inline, wins when set) or ``scenario`` (a TOML path, relative to the
app directory). Parsed once per process and cached.
"""

from __future__ import annotations

import functools
import json
from pathlib import Path
from typing import Any

from scenarios.schema import Scenario, load_scenario, scenario_from_dict

__all__ = ["scenario_from_run_config"]


def scenario_from_run_config(run_config: dict[str, Any]) -> Scenario:
    """Load the scenario a run was started with: inline JSON, or a TOML path."""
    if run_config.get("scenario-json"):  # declared empty in pyproject: absent unless given
        return _scenario_from_json(str(run_config["scenario-json"]))
    return _scenario_from_path(str(run_config.get("scenario", "scenarios/quickstart.toml")))


@functools.lru_cache(maxsize=4)
def _scenario_from_json(text: str) -> Scenario:
    return scenario_from_dict(json.loads(text), source="run_config")


@functools.lru_cache(maxsize=4)
def _scenario_from_path(name: str) -> Scenario:
    path = Path(name)
    if not path.is_absolute() and not path.exists():
        path = Path(__file__).resolve().parent.parent / path  # relative to the app
    return load_scenario(path)
