"""Subcommands registered beside the modules they drive (cli.py holds run and inspect)."""
from __future__ import annotations

COMMANDS: list = []
