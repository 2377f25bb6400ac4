"""The ``lightning-loco`` command (``python -m lightning_loco.cli`` runs it too)."""

from lightning_loco.cli.main import main

__all__ = ["main"]
