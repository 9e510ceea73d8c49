"""Errors of the scenario package."""

__all__ = ["ScenarioError"]


class ScenarioError(ValueError):
    """A scenario file is malformed: the message names the file, key and value."""
