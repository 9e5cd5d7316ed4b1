"""Canopy: outcome-only agentic RL of LLM agents (the CANOPY recipe)."""

from canopy.compat import let_torchtitan_import

let_torchtitan_import()  # torch < 2.13: lets TorchTitan 0.3.0 import for one process (canopy/compat.py)
