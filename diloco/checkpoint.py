"""Orbax checkpoints of the whole training state (+ a JSON sidecar for the data position and
counters), atomic run records, and loading the outer parameters of a run for evaluation."""
from __future__ import annotations

import json
import os
import tempfile
import warnings
from pathlib import Path
from typing import Any


def atomic_write_text(path: str | os.PathLike, text: str) -> None:
    """Write via a temp file in the same directory + os.replace: readers never see half a file."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    with os.fdopen(fd, "w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def atomic_write_json(path, obj: Any) -> None:
    atomic_write_text(path, json.dumps(obj, indent=1, sort_keys=True, default=_json_default) + "\n")


def _json_default(x):
    import numpy as np

    if isinstance(x, (np.integer,)):
        return int(x)
    if isinstance(x, (np.floating,)):
        return float(x)
    if isinstance(x, np.ndarray):
        return x.tolist()
    raise TypeError(f"not JSON serialisable: {type(x)}")


class Checkpointer:
    """Keeps the last `keep` checkpoints under workdir/ckpt; restores the newest readable one."""

    def __init__(self, workdir: str | os.PathLike, keep: int = 2):
        import orbax.checkpoint as ocp

        self._ocp = ocp
        self.dir = Path(workdir).resolve() / "ckpt"
        self.mngr = ocp.CheckpointManager(
            self.dir, options=ocp.CheckpointManagerOptions(max_to_keep=keep, create=True,
                                                           enable_async_checkpointing=False))

    def steps(self) -> list[int]:
        return sorted(self.mngr.all_steps())

    def save(self, step: int, state, meta: dict) -> None:
        ocp = self._ocp
        self.mngr.save(step, args=ocp.args.Composite(state=ocp.args.StandardSave(state),
                                                      meta=ocp.args.JsonSave(meta)), force=True)
        self.mngr.wait_until_finished()

    def restore(self, abstract_state) -> tuple[int, Any, dict] | None:
        """Newest checkpoint that restores cleanly; a corrupt newest one is skipped with a warning."""
        ocp = self._ocp
        for step in reversed(self.steps()):
            try:
                out = self.mngr.restore(step, args=ocp.args.Composite(
                    state=ocp.args.StandardRestore(abstract_state), meta=ocp.args.JsonRestore()))
                return step, out["state"], dict(out["meta"])
            except Exception as e:  # truncated / corrupt files
                warnings.warn(f"checkpoint at step {step} in {self.dir} is unreadable ({type(e).__name__}: "
                              f"{str(e)[:200]}); falling back to the previous one")
        return None

    def close(self) -> None:
        self.mngr.close()


def load_eval_params(workdir: str | os.PathLike):
    """(config, model, outer params, vocab) of the newest checkpoint of a run."""
    import ml_collections

    from diloco.train import Trainer

    workdir = Path(workdir)
    cfg_path = workdir / "config.json"
    if not cfg_path.exists():
        raise FileNotFoundError(f"{cfg_path} not found: is {workdir} a diloco run directory?")
    cfg = ml_collections.ConfigDict(json.loads(cfg_path.read_text()))
    trainer = Trainer(cfg, workdir, need_data=False)
    step, state = trainer.restore_or_init(restore_only=True)
    return cfg, trainer.model, trainer.eval_params(state), trainer.vocab
