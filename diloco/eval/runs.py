"""A finished (or interrupted) run read back for evaluation: its config, a Trainer for it and the
newest readable checkpoint's state, and the parameters to score (diloco eval, diloco tables)."""
from __future__ import annotations

import json
import os
from typing import Any


def load_run(workdir: str | os.PathLike) -> tuple[Any, Any, Any]:
    """(config, trainer, state) of a run's newest readable checkpoint."""
    import ml_collections

    from diloco import rundir
    from diloco.checkpoint import Checkpointer
    from diloco.hostmem import check_fits_host
    from diloco.trainer import Trainer

    run = rundir.RunDir(workdir)
    cfg_path = run / "config.json"
    if not cfg_path.exists():
        raise FileNotFoundError(f"{cfg_path} not found: is {workdir} a diloco run directory?")
    cfg = ml_collections.ConfigDict(json.loads(cfg_path.read_text()))
    trainer = Trainer(cfg)
    check_fits_host(trainer)
    ck = Checkpointer(run.ckpt, cfg.keep_checkpoints)
    try:
        got = ck.restore(trainer.abstract_state())
    finally:
        ck.close()
    if got is None:
        raise FileNotFoundError(f"no readable checkpoint under {run.ckpt}")
    return cfg, trainer, got[1]


def load_eval_params(workdir: str | os.PathLike, which: str = "drained"):
    """(config, model, params, vocab, what the params are) of the newest checkpoint of a run; by
    default θᵍ drained, the parameters whose sha256 and loss summary.json reports (Trainer.params_of)."""
    cfg, trainer, state = load_run(workdir)
    params, about = trainer.params_of(state, which)
    return cfg, trainer.model, params, trainer.vocab, about
