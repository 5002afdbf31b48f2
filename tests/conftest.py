import os
from pathlib import Path

import pytest

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
REPO = Path(__file__).resolve().parents[1]
SHARED = REPO.parent / "shared"


@pytest.fixture
def shared_dir() -> Path:
    if not (SHARED / "data").is_dir():
        pytest.skip(f"needs the sample data in {SHARED}/data (present beside the repo in CI and dev)")
    return SHARED


def tiny_config(method: str = "diloco", **overrides):
    """The toy spec shrunk for unit tests: tiny scale, short sequences."""
    from diloco.config import load_config

    flat = {"scale": "tiny", "seq_len": 32, "batch_size": 4, "steps": 6, "log_every": 2, "eval_every": 3,
            "eval_batches": 2, "checkpoint_every": 3, "optimizer.warmup_steps": 2}
    flat.update(overrides)
    return load_config(f"experiments/toy.py:{method}", [f"--config.{k}={v}" for k, v in flat.items()])
