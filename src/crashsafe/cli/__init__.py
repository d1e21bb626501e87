"""The ``crashsafe`` command line."""

from __future__ import annotations

__all__ = ["main"]


def main() -> None:
    """Entry point of the ``crashsafe`` console script."""
    from crashsafe.cli.app import app

    app()
