"""The loop: one training run of Data-Parallel, DiLoCo or Streaming DiLoCo.

It only wires the parts together, each owned elsewhere:
  diloco/trainer.py        state, jitted inner step and evaluation (its plan: diloco/resolve.py)
  diloco/outer/driver.py   sends, outer updates and merges as the schedule says
  diloco/outer/placement.py  where each send's exchange runs (blocking, in_step, comm_device)
  diloco/data/             token batches (resumable position)
  diloco/checkpoint.py     orbax checkpoints;  diloco/rundir.py  the run folder's records
  diloco/faults.py         fault injection;    diloco/distributed.py  processes of one job

Per step t: inner step t (carrying step t−1's exchange when the placement puts it on the step) →
(at log rows) gather the window's losses → the sends after step t, the applies (each landing its
exchange first) and merges → log/eval → checkpoint (every exchange landed first) → stop if a signal
arrived (all processes agree at a log row).
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import os
import signal
import sys
import time
from typing import Any

import numpy as np

from diloco.checkpoint import CheckpointError
from diloco.errors import ConfigError
from diloco.faults import NumericalFault
from diloco.noise import restore_stderr


@dataclasses.dataclass
class Counters:
    """Run totals, checkpointed in the sidecar so that a resumed run continues them."""
    bytes_exchanged: int = 0
    bytes_peak_per_sync: int = 0
    bytes_per_fragment: dict = dataclasses.field(default_factory=dict)
    syncs: int = 0
    wall_seconds: float = 0.0
    skipped_batches: int = 0

    def add_sends(self, sent: list[tuple[int, int]], peak_of) -> None:
        for p, nb in sent:
            self.bytes_exchanged += nb
            self.syncs += 1
            self.bytes_per_fragment[str(p)] = self.bytes_per_fragment.get(str(p), 0) + nb
            self.bytes_peak_per_sync = max(self.bytes_peak_per_sync, peak_of(p))

    def add_dp_step(self, nb: int, replicas: int) -> None:
        self.bytes_exchanged += nb * replicas
        self.bytes_peak_per_sync = nb
        self.syncs += 1


class StopSignal:
    """SIGTERM/SIGINT set `name`; the loop checkpoints and exits at a step boundary."""

    def __init__(self):
        self.name: str | None = None
        self.old = {}

    def __enter__(self):
        def on_signal(signum, _):
            self.name = signal.Signals(signum).name
        self.old = {s: signal.signal(s, on_signal) for s in (signal.SIGTERM, signal.SIGINT)}
        return self

    def __exit__(self, *exc):
        for s, h in self.old.items():
            signal.signal(s, h)


class LossWindow:
    """Per-replica losses of the steps since the last gather (on device), folded into `losses` (host
    floats since the last metrics row) at log rows and checkpoints: one gather across processes."""

    def __init__(self, trainer, faults, counters: Counters, losses: list[float], last_ckpt,
                 losses_R: list[list[float]] | None = None):
        self.tr, self.faults, self.counters, self.losses, self.last_ckpt = trainer, faults, counters, losses, last_ckpt
        self.losses_R = losses_R or []  # each replica's loss per folded step (the rows `losses` averages)
        self.rows: list[tuple[int, Any, Any]] = []

    def add(self, t: int, ce_R, fin_R) -> None:
        self.rows.append((t, ce_R, fin_R))

    def flush(self, stop_local: bool | None = None) -> bool:
        """Fold the window in; with `stop_local` (log rows, which every process reaches at the same
        step) the processes also share whether any of them got a stop signal; True if one did."""
        from diloco.distributed import gather_window

        rows, any_stop = gather_window(self.rows, self.tr.mesh, stop_local)
        for t, ce, fin in rows:
            if fin.all():
                self.losses.append(float(ce.mean()))
                self.losses_R.append([float(c) for c in ce])
                continue
            bad = [m for m, f in enumerate(fin) if not f]
            if not self.faults.skip_bad_batches:
                raise NumericalFault(f"step {t}: non-finite loss or gradient on replica(s) {bad} "
                                     f"(loss {ce.tolist()}); the run stopped and the last good checkpoint "
                                     f"(step {self.last_ckpt()}) is kept. Lower optimizer.lr or set "
                                     "--config.faults.nan_policy=skip to skip bad batches.")
            self.counters.skipped_batches += 1
            print(f"step {t}: non-finite loss/gradient on replica(s) {bad}; batch skipped "
                  "(faults.nan_policy=skip)", file=sys.stderr)
        self.rows.clear()
        return any_stop

    def take_mean(self) -> float | None:
        out = float(np.mean(self.losses)) if self.losses else None
        self.losses.clear()
        return out

    def take_replica_means(self) -> list[float] | None:
        """Each replica's mean loss over the same steps as `take_mean` (whose value is their mean)."""
        out = [float(v) for v in np.mean(self.losses_R, axis=0)] if self.losses_R else None
        self.losses_R.clear()
        return out


class Run:
    """One run (or its resumption): what the loop needs between steps, in one place."""

    def __init__(self, cfg, workdir, progress: bool = True, fresh: bool = False):
        import jax

        from diloco import distributed as dist
        from diloco.checkpoint import Checkpointer
        from diloco.config import load_spec, to_json
        from diloco.data import eval_batches, train_batches
        from diloco.eval.benchmarks import check_downstream
        from diloco.faults import Faults
        from diloco.rundir import RunDir, is_remote, require
        from diloco.hostmem import check_fits_host
        from diloco.trainer import Trainer

        from diloco.compile import use_gpu_overlap_flags, use_tpu_overlap_flags
        use_tpu_overlap_flags()  # LIBTPU_INIT_ARGS for overlap, before libtpu starts (no-op without libtpu)
        use_gpu_overlap_flags(need_gpu=True)  # XLA_FLAGS for the exchange's overlap on an NVIDIA GPU (else no-op)
        dist.initialize_from_env()  # multi-process (diloco launch): before any other JAX use
        self.multi = dist.num_processes() > 1
        dist.check_processes(1 if cfg.method == "dp" else cfg.replicas)
        check_downstream(cfg.downstream)  # cfg was validated once (load_config); the mesh: resolve.mesh_shape
        self.cfg, self.dist = cfg, dist
        workdir = require(workdir, "workdir")
        self.tr = tr = Trainer(cfg, devices=dist.compute_devices(), comm_devices=dist.comm_devices(),
                               check=self.check)  # the pending check of every send, given once
        check_fits_host(tr)  # on CPU: a state bigger than this host's memory is refused, nothing allocated
        self.run = RunDir(workdir, primary=dist.is_primary())
        self.run.make()
        self.run.claim(to_json(cfg), to_json(load_spec("experiments/base.py")))  # a key added since: its default
        if fresh:  # the previous checkpoints and records are kept, out of the way, never deleted
            aside = self.run.set_aside()
            dist.allgather(np.int32(0))  # every process waits for process 0's move before reading ckpt/
            if aside is not None and dist.is_primary():
                print(f"diloco train: --fresh: the previous checkpoints and records are now in {aside}; "
                      "starting from step 0", file=sys.stderr)
        self.timeline = None
        # steps, exchanges, waits: per-process files appended line by line, so only in a local run folder
        if (self.multi or os.environ.get("DILOCO_TIMELINE") == "1") and not is_remote(self.run.root):
            from diloco.timeline import Timeline

            self.timeline = Timeline(os.fspath(self.run / "timeline" / f"rank{jax.process_index()}.jsonl"),
                                     jax.process_index(), resume=True)
            if tr.overlap is not None:
                tr.overlap.timeline = self.timeline
        self.faults = Faults(cfg, tr.R)
        self.ck = Checkpointer(self.run.ckpt, cfg.keep_checkpoints)
        # Each process reads only the rows of the global batch its devices hold, from the run's token
        # store (diloco/data/batches.py); the reader is made from the newest checkpoint's data state first,
        # so that a data state this run cannot continue is refused before the model state is restored.
        self.batch_shape = (tr.R, cfg.batch_size // tr.R, cfg.seq_len)
        try:  # a checkpoint this run cannot use stops it (CheckpointError), unless --fresh set it aside
            self.data = train_batches(cfg, tr.batch_sharding, self.batch_shape, self.ck.latest_meta().get("data"))
            got = self.ck.restore(tr.abstract_state(), quarantine=True)
        except BaseException:
            self.ck.close()
            raise
        self.data_rows = self.data.rows()
        self.counters = Counters()
        losses: list[float] = []
        losses_R: list[list[float]] = []
        if got is None:
            self.start, self.state = 0, tr.fresh_state()
        else:
            self.start, self.state, meta = got
            self.data.set_state(meta["data"])
            self.counters = Counters(**meta["counters"])
            losses = list(meta.get("pending_losses", []))  # since the last metrics row
            losses_R = [list(r) for r in meta.get("pending_losses_replicas", [])]
            print(f"resumed {self.run.root} at step {self.start}", file=sys.stderr)
        self.run.resume_records(self.start)
        self.window = LossWindow(tr, self.faults, self.counters, losses, self.last_ckpt, losses_R)
        self.evals = [dist.global_array(np.asarray(b), tr.replicated_sharding)
                      for b in eval_batches(cfg.data, cfg.vocab, cfg.seq_len, cfg.batch_size // tr.R * tr.R,
                                            cfg.eval_batches, data_dir=cfg.data_dir or None)]
        self.tokens_per_step = cfg.batch_size * cfg.seq_len
        self.t0 = time.time() - self.counters.wall_seconds
        self.last_log = (time.time(), self.start)
        self.progress = progress
        self.bar = progress_bar(self.start, cfg.steps, progress)
        self.shown_eval: float | None = None

    # -- pieces of a step ---------------------------------------------------------------------------
    def last_ckpt(self) -> int:
        return max(self.ck.steps(), default=0)

    def check(self, state, p: int, t_send: int, finite_R) -> None:
        from diloco.outer.driver import check_pending_finite

        check_pending_finite(state, p, t_send, self.last_ckpt(), finite_R)

    def eval_loss(self, state=None) -> float:
        ev, params = self.tr.eval_fn(), self.tr.eval_params(self.state if state is None else state)
        return float(np.mean([float(ev(params, b)) for b in self.evals]))

    def drained(self, t: int) -> tuple[Any, list[int]]:
        """(the state as at the next sync boundary: fragments in flight after t applied, those fragments)."""
        self.state, out, frags = self.tr.drained(self.state, t)
        return out, frags

    def save(self, step: int) -> None:
        self.window.flush()
        if self.tr.placement is not None:  # a checkpoint holds no exchange in flight
            self.state = self.tr.placement.settle(self.state)
        data = self.data.state(np.concatenate(list(self.dist.allgather(self.data.local_positions()))))
        self.ck.save(step, self.state, {"data": data, "counters": dataclasses.asdict(self.counters),
                                        "step": step, "pending_losses": self.window.losses,
                                        "pending_losses_replicas": self.window.losses_R})
        self.run.sync_tb()  # a remote run folder's TensorBoard files, as far as this checkpoint

    def inner_step(self, t: int) -> None:
        tr, cfg = self.tr, self.cfg
        tokens_RxBxL = self.dist.global_batch(next(self.data), self.data_rows, tr.batch_sharding, self.batch_shape)
        active = tr.schedule.next_sender(t) if cfg.freeze_non_syncing and tr.schedule is not None else None
        t_start = time.perf_counter()
        poison = self.faults.poison(t, "loss")
        if tr.placement is None:  # DP
            self.state, ce_R, fin_R = tr.inner_step(active)(self.state, tokens_RxBxL, *poison)
        else:  # step t; with in_step its program also exchanges the send parked after step t−1
            self.state, ce_R, fin_R = tr.placement.step(self.state, tokens_RxBxL, active, poison)
        # This process's replicas only (no collective per step: it would queue behind an exchange
        # in flight); the whole window is gathered at the next log row or checkpoint.
        fin_local = self.dist.local_rows(fin_R)
        if self.timeline is not None:
            self.timeline.add("step", step=t, start=round(t_start - self.timeline.t0, 6),
                              end=round(time.perf_counter() - self.timeline.t0, 6))
        self.window.add(t, ce_R, fin_R)
        if not self.faults.skip_bad_batches and not all(fin_local.values()):
            self.window.flush()  # raises with every replica's loss

    def outer_step(self, t: int) -> None:
        tr = self.tr
        if tr.driver is None:
            self.counters.add_dp_step(tr.dp_bytes_per_replica(), self.cfg.replicas)
            return
        if self.faults.restart_due(t):
            self.state = self.faults.restart_replica(tr, self.state)
        self.state = self.faults.poison_params(self.state, t)
        t_sync = time.perf_counter()
        # the sends after step t go to the placement (blocking: exchanged now; in_step: parked for step
        # t+1's program; comm_device: dispatched), each apply lands its fragment's exchange first
        self.state, sent = tr.driver.after_step(self.state, t, self.faults.contrib)
        if self.timeline is not None and (sent or tr.schedule.outer_updates(t)):
            self.timeline.add("syncs", step=t, start=round(t_sync - self.timeline.t0, 6), sent=[p for p, _ in sent])
        self.counters.add_sends(sent, tr.driver.bytes_per_replica)

    def log_row(self, t: int) -> None:
        cfg, now = self.cfg, time.time()
        tok_s = (t - self.last_log[1]) * self.tokens_per_step / max(now - self.last_log[0], 1e-9)
        self.last_log = (now, t)
        row = {"step": t, "tokens": t * self.tokens_per_step, "train_loss": self.window.take_mean(),
               "train_loss_replicas": self.window.take_replica_means(),
               "lr": float(self.tr.lr_schedule(t)), "bytes_exchanged": self.counters.bytes_exchanged,
               "seconds": round(self.counters.wall_seconds, 3), "tokens_per_s": round(tok_s, 1)}
        row["data_hash"] = self.data.batch_hash(t - 1, t)  # which store rows step t's global batch held
        if t % cfg.eval_every == 0 or t == cfg.steps:
            if cfg.eval_drain == "every" and self.tr.driver is not None:
                drained, row["drained_fragments"] = self.drained(t)
                row["eval_loss"], row["eval_loss_undrained"] = self.eval_loss(drained), self.eval_loss()
            else:
                row["eval_loss"] = self.eval_loss()
            self.shown_eval = row["eval_loss"]
        self.run.log(row)
        post = {"loss": f"{row['train_loss'] or float('nan'):.3f}"}
        if self.shown_eval is not None:  # the bar shows an eval loss once there is one
            post["eval"] = f"{self.shown_eval:.3f}"
        self.bar.set_postfix(**post, tok_s=f"{tok_s:,.0f}")

    def downstream(self, state=None, write: bool = True) -> dict:
        from diloco.eval import evaluate

        cfg = self.cfg
        res = evaluate(self.tr.apply_fn(), self.tr.eval_params(self.state if state is None else state), self.tr.vocab,
                       [t for t in cfg.downstream.tasks.split(",") if t], cfg.downstream.data_dir or None,
                       cfg.downstream.limit or None, cfg.seq_len)
        if write:
            self.run.log({"step": int(self.state.step), **res}, "downstream.jsonl")
        return res

    def stop(self, t: int, signal_name: str) -> None:
        if t not in self.ck.steps():  # a checkpoint step already saved this state
            self.save(t)
        self.bar.close()
        raise KeyboardInterrupt(f"{signal_name}: saved a checkpoint at step {t} in {self.run.ckpt}; "
                                "run the same command to resume")

    # -- the loop -----------------------------------------------------------------------------------
    def precompile(self) -> None:
        """Every program this run executes, compiled before its first step, side by side (diloco/precompile.py):
        nothing compiles at a fragment's first send, apply or merge. On by default on TPU and GPU, where chips
        would wait; off on CPU (toy runs and tests compile only what they use); DILOCO_PRECOMPILE=1 / 0 forces it."""
        import jax

        want = os.environ.get("DILOCO_PRECOMPILE", "")
        on = want == "1" or (want != "0" and jax.local_devices()[0].platform != "cpu")
        self.device_memory = None  # on a GPU: the largest program's peak and the device's bytes_limit (summary.json)
        if self.start >= self.cfg.steps or not on:
            return
        from diloco.devmem import check_fits_device
        from diloco.precompile import precompile, run_programs

        tr = self.tr
        zeros = np.zeros((len(self.data_rows), self.cfg.seq_len), np.int32)  # placed as the loop places a batch
        tokens = self.dist.global_batch(zeros, self.data_rows, tr.batch_sharding, self.batch_shape)
        got = precompile(run_programs(tr, self.state, tokens, self.evals[0] if self.evals else None),
                         log=None if self.progress else (lambda msg: None))
        # on a GPU, a program that would not fit the device's memory pool is refused here, before step 1
        self.device_memory = check_fits_device(got["peak_bytes"], tr, jax.local_devices()[0])

    def train(self, stop_after: int | None = None) -> dict:
        cfg = self.cfg
        self.precompile()
        with StopSignal() as sig:
            try:
                for t in range(self.start + 1, cfg.steps + 1):
                    self.inner_step(t)  # carries step t−1's exchange when the placement is in_step
                    log_due = t % cfg.log_every == 0 or t % cfg.eval_every == 0 or t == cfg.steps
                    # gather the losses before this step's sends: behind a fragment in flight it would wait
                    peer_stop = self.window.flush(bool(sig.name) if self.multi else None) if log_due else False
                    self.outer_step(t)  # step t's sends, applies and merges (placement.send / land)
                    self.counters.wall_seconds = time.time() - self.t0
                    self.bar.update(1)
                    if log_due:
                        self.log_row(t)
                    if downstream_due(cfg, t):
                        self.downstream()
                    if t % cfg.checkpoint_every == 0 and t != cfg.steps:
                        self.save(t)
                    if stop_after is not None and t == stop_after:
                        sig.name = "SIGTERM"
                    # One process alone cannot stop: the others would wait in the next collective (and
                    # orbax saves together). Processes agree at the next log row, which all of them reach.
                    if self.multi:
                        if peer_stop:
                            self.stop(t, sig.name or "a stop signal to another process")
                    elif sig.name:
                        self.stop(t, sig.name)
                self.bar.close()
                if not self.ck.steps() or max(self.ck.steps()) != cfg.steps:
                    self.save(cfg.steps)
            finally:
                self.data.close()
                self.ck.close()
                self.run.close()
                if self.timeline is not None:
                    self.timeline.close()
        return self.summary()

    def summary(self) -> dict:
        from diloco.data import corpus_info
        from diloco.outer.sync import params_sha256
        from diloco.resolve import mesh_dict
        from diloco.rundir import versions

        cfg, tr, c = self.cfg, self.tr, self.counters
        sync = tr.sync
        drained, frags = self.drained(cfg.steps)  # θᵍ as at the next sync boundary
        summary = self.run.summary()
        tokens_read = [int(x) for x in self.dist.allgather(np.int64(self.data.tokens_read()))]
        summary.update({
            "processes": self.dist.num_processes(), "tokens_read": tokens_read,
            "data_store": self.data.store.fingerprint, "data_order": "store",  # reader.py's order rule (#30)
            "method": cfg.method, "scale": cfg.scale, "steps": cfg.steps, "tokens": cfg.steps * self.tokens_per_step,
            "final_eval_loss": self.eval_loss(drained), "final_eval_loss_undrained": self.eval_loss(),
            "drained_fragments": frags, "bytes_exchanged_total": c.bytes_exchanged,
            "bytes_peak_per_sync": c.bytes_peak_per_sync, "bytes_per_fragment": c.bytes_per_fragment,
            "syncs": c.syncs, "params": tr.n_params, "params_sha256": params_sha256(tr.eval_params(drained)),
            "wall_seconds": round(c.wall_seconds, 3), "skipped_batches": c.skipped_batches,
            "replicas": cfg.replicas, "H": cfg.H if sync else None,
            "fragments": sync.frags.P if sync else None, "pattern": cfg.pattern if sync else None,
            "tau": cfg.replica_tau or cfg.tau if sync else None, "alpha": cfg.alpha if sync else None,
            "codec": cfg.codec if sync else None,
            "eager": cfg.eager if sync else None, "eager_rounds": cfg.eager_rounds if sync else None,
            "error_feedback": cfg.error_feedback if sync else None,
            "eval_params": tr.driver.rule.eval_label if sync else "the replica's parameters",
            "fragment_sizes": list(sync.frags.sizes) if sync else None,
            "corpus": corpus_info(cfg.data, cfg.data_dir or None),
            "versions": versions(),
            "mesh": mesh_dict(tr.mesh.shape),
            "resolved": tr.plan.to_json(),  # every `auto` of the config as this run resolved it (diloco/resolve.py)
        })
        if cfg.downstream.tasks:
            summary["downstream"] = self.downstream(drained, write=False)
        if getattr(self, "device_memory", None):
            summary["device_memory"] = self.device_memory
        self.run.write_summary(summary)
        print(self.host_line(tokens_read[self.dist.process_index()]), file=sys.stderr, flush=True)
        return summary

    def host_line(self, tokens: int) -> str:
        """This process's own line: a user sees that every host joined and read its share."""
        import jax

        devs = ",".join(str(d.id) for d in jax.local_devices())
        return (f"diloco host {self.dist.process_index()}/{self.dist.num_processes()}: devices [{devs}] "
                f"({jax.local_devices()[0].platform}); {self.data.describe()}; tokens read {tokens:,}")


def train(cfg, workdir: str | os.PathLike, progress: bool = True, stop_after: int | None = None,
          fresh: bool = False) -> dict:
    """Run (or resume) one training run; returns the summary.

    A checkpoint in `workdir` that cannot be used raises diloco.checkpoint.CheckpointError (nothing is
    moved); `fresh=True` sets the folder's checkpoints and records aside (RunDir.set_aside) and starts
    from step 0. `stop_after=k` behaves as if SIGTERM arrived during step k (tests of the preemption path)."""
    return Run(cfg, workdir, progress, fresh).train(stop_after)


def progress_bar(start: int, total: int, enabled: bool):
    from tqdm.auto import tqdm

    return tqdm(total=total, initial=start, disable=not enabled, unit="step", dynamic_ncols=True,
                mininterval=1.0)


def downstream_due(cfg, t: int) -> bool:
    return bool(cfg.downstream.tasks) and cfg.downstream.every > 0 and t % cfg.downstream.every == 0 and t != cfg.steps


def main(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(
        prog="diloco train", description="Train one run (resumes if DIR has a checkpoint).",
        epilog="Exit codes: 0 done; 2 bad input (including a run too big for this host's memory on CPU); "
               "3 numerical fault; 4 a checkpoint in --workdir that cannot be used (written for another "
               "state, unreadable storage, or all corrupt: nothing is moved; see --fresh); 130 interrupted "
               "(a checkpoint was saved: run the same command to resume). docs/reliability.md")
    ap.add_argument("--config", required=True, help="experiments/<file>.py[:arg], e.g. experiments/toy.py:streaming")
    ap.add_argument("--workdir", required=True)
    ap.add_argument("--no_progress", action="store_true")
    ap.add_argument("--fresh", action="store_true",
                    help="start from step 0 even though --workdir holds checkpoints: they and the run's records "
                         "(metrics.jsonl, downstream.jsonl, summary.json) are moved to DIR/set_aside/<time>/, "
                         "never deleted. Without it a run resumes, or stops (exit 4) at checkpoints it cannot use")
    from diloco.learners.client import add_flags, run_learner

    add_flags(ap)
    args, overrides = ap.parse_known_args(argv)
    from diloco.config import load_config
    from diloco.devmem import use_gpu_memory_fraction
    from diloco.interrupt import prompt_exit, train_lines
    from diloco.rundir import require

    use_gpu_memory_fraction()  # XLA_PYTHON_CLIENT_MEM_FRACTION=0.90 unless set, before JAX's GPU client starts

    try:
        require(args.workdir, "workdir")  # a gs:// folder without the filesystem installed: one line, now
        with prompt_exit(*train_lines(args.workdir)):
            cfg = load_config(args.config, overrides)
            if cfg.sync:  # one independent learner of a `diloco syncer` run (diloco/learners/client.py)
                print(json.dumps(run_learner(cfg, args)), flush=True)
                return 0
            if cfg.learner != -1:
                raise ConfigError("learner", "--config.learner=m needs --config.sync=grpc://HOST:PORT (the synchronizer)")
            summary = train(cfg, args.workdir, progress=not args.no_progress, fresh=args.fresh)
    except ConfigError as e:
        print(f"diloco train: bad input: {e}", file=sys.stderr)
        return 2
    except CheckpointError as e:
        restore_stderr()  # a full disk silenced the checkpoint writers' tracebacks (checkpoint.Checkpointer.save)
        print(f"diloco train: {e}", file=sys.stderr)
        return 4
    except NumericalFault as e:
        print(f"diloco train: {e}", file=sys.stderr)
        return 3
    except KeyboardInterrupt as e:  # the loop saved a checkpoint and says where
        print(f"diloco train: {e}" if str(e) else "diloco train: interrupted", file=sys.stderr)
        return 130
    keys = ("method", "steps", "final_eval_loss", "bytes_exchanged_total", "bytes_peak_per_sync", "wall_seconds")
    print(json.dumps({k: summary[k] for k in keys}), flush=True)
    return 0
