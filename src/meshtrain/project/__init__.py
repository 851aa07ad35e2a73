"""The Kedro project around the engine: its hooks, its config loader, and the checks and
tracking settings they use (the Kedro layer, with pipelines/, hooks.py, settings.py and
cli.py; the engine imports nothing from here)."""
