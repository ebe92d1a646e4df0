"""The `corral` command line (typer + rich). One module per command group."""

from ._app import app, main

__all__ = ["app", "main"]
