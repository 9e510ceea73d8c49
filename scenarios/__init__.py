"""Scenarios: the schema of a scenario file, its loaders, and the shipped TOML scenarios."""
