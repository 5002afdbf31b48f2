"""diloco: Data-Parallel, DiLoCo and Streaming DiLoCo (arXiv 2501.18512) in one JAX/Flax loop."""

__version__ = "0.1.0"
