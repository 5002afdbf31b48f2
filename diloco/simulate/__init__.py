"""Compute-utilisation simulator of DP, DiLoCo and Streaming DiLoCo (docs/simulator.md). numpy only."""
from diloco.simulate.dag import Assumptions, Method, Model, Result, compute_utilisation, simulate
from diloco.simulate.presets import MODELS, PAPER, PHYSICAL, make_method
from diloco.simulate.search import GRID, Required, required_bandwidth

__all__ = [
    "Assumptions", "Method", "Model", "Result", "compute_utilisation", "simulate",
    "MODELS", "PAPER", "PHYSICAL", "make_method", "GRID", "Required", "required_bandwidth",
]
