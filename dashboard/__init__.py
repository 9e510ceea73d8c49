"""The Quorum dashboard: every run, round and client, live, in a browser.

A read-only FastAPI app over the run store: server-rendered pages, a JSON API
under ``/api/``, Server-Sent Events for live rounds, Prometheus ``/metrics``.
``quorum`` mounts ``dashboard.cli`` on every start, so this package imports
FastAPI only when the app is built.
"""

from __future__ import annotations

from typing import Any

__all__ = ["create_app"]


def __getattr__(name: str) -> Any:
    if name == "create_app":
        from dashboard.app import create_app

        return create_app
    raise AttributeError(f"module 'dashboard' has no attribute {name!r}")
