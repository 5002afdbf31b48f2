"""A learner (`diloco learner --config … --sync grpc://HOST:PORT --learner m --workdir DIR`): one JAX job
training replica m of the run config on its own, exchanging with the synchronizer (diloco/learners/syncer.py)
over gRPC instead of the `replica` mesh axis.

This first slice drives the existing Trainer from outside (its jitted inner step, OuterSync's delta and
merge, the schedule, the codec registry) rather than being a placement of `diloco train`. After inner step t,
as the SPMD driver does (diloco/outer/driver.py):

  sends(t)          Δ_m,p = θᵍ_p − θ_m,p, encoded with the run's codec and the key the SPMD run's replica m
                    uses, pushed as round k of fragment p (a gRPC future: training goes on meanwhile)
  outer_updates(t)  (τ steps later) wait for round k's answer, θᵍ_p after the synchronizer's outer step
  merges(t)         θ_m,p ← α·θ_m,p + (1−α)·θᵍ_p

Records in DIR: metrics.jsonl (step, train_loss, bytes sent/received, seconds) and summary.json.
Not yet: a learner checkpoint (a killed learner does not rejoin mid-run), quantized answers, retries
across a synchronizer restart (UNAVAILABLE is retried with backoff while the call's deadline lasts).
"""
from __future__ import annotations

import argparse
import json
import sys
import time

import numpy as np

from diloco.errors import ConfigError
from diloco.learners import common, proto


class SyncClient:
    """The learner's side of the service: Push (a future), Join, Stats; the token on every call."""

    def __init__(self, address: str, token: str, learner: int, fingerprint: str, timeout: float = 600.0):
        import grpc

        if address.startswith("grpc://"):
            address = address[len("grpc://"):]
        self.grpc, self.timeout = grpc, timeout
        self.channel = grpc.insecure_channel(address, options=[("grpc.max_receive_message_length", 1 << 30),
                                                               ("grpc.max_send_message_length", 1 << 30)])
        self.meta = (("authorization", f"Bearer {token}"),)
        self.learner, self.fingerprint = learner, fingerprint
        self.calls = {name: self.channel.unary_unary(f"/{proto.SERVICE}/{name}") for name in ("Push", "Join", "Stats")}
        self.sent = self.received = 0  # bytes on the wire (frames)
        self.payload = 0               # of them, the codec's bytes: what the SPMD path counts in bytes_exchanged

    def call(self, name: str, body: bytes, future: bool = False):
        rpc = self.calls[name]
        if future:
            return rpc.future(body, timeout=self.timeout, metadata=self.meta, wait_for_ready=True)
        return rpc(body, timeout=self.timeout, metadata=self.meta, wait_for_ready=True)

    def push(self, p: int, k: int, tokens: int, codec: str, arrays: dict[str, np.ndarray]):
        """Round k of fragment p: the codec's arrays in name order; returns a future of the answer."""
        names = sorted(arrays)
        head = {"v": proto.VERSION, "learner": self.learner, "fragment": p, "round": k, "tokens": int(tokens),
                "fingerprint": self.fingerprint, "codec": codec,
                "arrays": [[n, arrays[n].dtype.name, list(arrays[n].shape)] for n in names]}
        body = proto.frame(head, b"".join(np.ascontiguousarray(arrays[n]).tobytes() for n in names))
        self.sent += len(body)
        self.payload += sum(a.nbytes for a in arrays.values())
        return self.call("Push", body, future=True)

    def answer(self, fut) -> tuple[dict, np.ndarray]:
        """(header, θᵍ_p fp32) of a pushed round, waiting for it."""
        body = fut.result()
        self.received += len(body)
        head, payload = proto.unframe(body)
        return head, np.frombuffer(payload, np.float32)

    def join(self) -> tuple[list[np.ndarray], list[int]]:
        body = self.call("Join", proto.frame({"v": proto.VERSION, "learner": self.learner,
                                              "fingerprint": self.fingerprint}))
        self.received += len(body)
        head, payload = proto.unframe(body)
        flats, at = [], 0
        for _, _, (n,) in head["arrays"]:
            flats.append(np.frombuffer(payload[at:at + 4 * n], np.float32))
            at += 4 * n
        return flats, head["merged"]

    def stats(self) -> dict:
        return json.loads(self.call("Stats", b"\0\0\0\x02{}"))


class Learner:
    """Replica m of the run, trained alone: the Trainer's programs, the run's data rows, gRPC exchanges."""

    def __init__(self, cfg, m: int, client: SyncClient, sleep: float = 0.0):
        import jax

        from diloco.data import prepare
        from diloco.data.reader import StoreBatches
        from diloco.trainer import Trainer

        if not 0 <= m < cfg.replicas:
            raise ConfigError("learner", f"{m} must be in 0 … replicas-1 = {cfg.replicas - 1}")
        self.cfg, self.m, self.client, self.sleep = cfg, m, client, sleep
        self.tr = tr = Trainer(common.learner_config(cfg), devices=jax.devices()[:1])
        self.sync, self.schedule, self.b = tr.sync, tr.schedule, tr.cfg.batch_size
        self.data = StoreBatches(prepare.store_for(cfg.data, cfg.vocab, cfg.data_dir or None), cfg.seq_len,
                                 cfg.batch_size, cfg.seed, rows=range(m * self.b, (m + 1) * self.b))
        self.state = tr.fresh_state()
        self.step = tr.inner_step()
        self.rounds = [0] * self.sync.frags.P      # sends of each fragment so far
        self.last_send = [0] * self.sync.frags.P   # step of each fragment's previous send
        self.inflight: dict[int, tuple[int, object]] = {}  # p → (round, future)
        self._jit: dict = {}

    def program(self, kind: str, p: int):
        import jax

        from diloco.outer import codecs

        if (kind, p) not in self._jit:
            sync, M, m = self.sync, self.cfg.replicas, self.m
            if kind == "encode":  # Δ of the one replica, encoded with the SPMD run's key for replica m
                def f(state, key):
                    return codecs.encode(sync.codec, sync.delta(state.params, state.outer, p)[0], jax.random.split(key, M)[m])
            elif kind == "theta":  # θᵍ_p from the synchronizer into the outer params
                def f(state, theta_n):
                    return state.replace(outer=state.outer.replace(params=sync.frags.unflatten(state.outer.params, p,
                                                                                                theta_n)))
            else:  # merge
                def f(state, mask):
                    return state.replace(params=sync.merge(state.params, state.outer, p, mask))
            self._jit[(kind, p)] = jax.jit(f)
        return self._jit[(kind, p)]

    def check_join(self) -> None:
        """The synchronizer's θᵍ is this learner's init (same config, same seed) and no round is merged yet."""
        flats, merged = self.client.join()
        if any(merged):
            raise ConfigError("learner", f"the synchronizer has merged rounds {merged} already: joining a run in "
                                         "progress needs a learner checkpoint, not in this version")
        for p, f in enumerate(flats):
            if not np.array_equal(f, np.asarray(self.sync.frags.flatten(self.state.outer.params, p))):
                raise ConfigError("config", f"fragment {p} of the synchronizer's θᵍ is not this learner's init")

    def after_step(self, t: int) -> None:
        import jax.numpy as jnp

        tokens_per_step = self.b * self.cfg.seq_len
        for p in self.schedule.sends(t):
            arrays = self.program("encode", p)(self.state, self.tr.driver.key(t, p))
            self.rounds[p] += 1
            tokens, self.last_send[p] = (t - self.last_send[p]) * tokens_per_step, t
            self.inflight[p] = (self.rounds[p], self.client.push(p, self.rounds[p], tokens, self.sync.codec.name,
                                                                 {k: np.asarray(v) for k, v in arrays.items()}))
        for p in self.schedule.outer_updates(t):
            self.land(p)
        for p, mask in self.schedule.merges(t):
            self.state = self.program("merge", p)(self.state, jnp.asarray(mask[:1]))

    def land(self, p: int) -> dict:
        k, fut = self.inflight.pop(p)
        head, theta = self.client.answer(fut)
        if head["round"] != k or head["fragment"] != p:
            raise RuntimeError(f"asked fragment {p} round {k}, got {head['fragment']} round {head['round']}")
        self.state = self.program("theta", p)(self.state, theta)
        return head

    def train(self, workdir: str) -> dict:
        from diloco.outer.sync import params_sha256
        from diloco.rundir import append_jsonl, atomic_write_json, path

        root = path(workdir)
        root.mkdir(parents=True, exist_ok=True)
        self.check_join()
        t0 = time.time()
        for t in range(1, self.cfg.steps + 1):
            tokens = np.asarray(next(self.data))[None]  # (1, b, L): replica m's rows of step t
            self.state, ce_R, _ = self.step(self.state, tokens)
            if self.sleep:
                time.sleep(self.sleep)
            self.after_step(t)
            append_jsonl(root / "metrics.jsonl", {"step": t, "train_loss": float(ce_R[0]),
                                                  "bytes_sent": self.client.sent, "bytes_payload": self.client.payload,
                                                  "bytes_received": self.client.received,
                                                  "seconds": round(time.time() - t0, 3)})
        for p in sorted(self.inflight):  # drained: θᵍ with every round in flight applied (the SPMD summary's)
            self.land(p)
        self.data.close()
        summary = {"learner": self.m, "steps": self.cfg.steps, "params_sha256": params_sha256(self.state.outer.params),
                   "bytes_sent": self.client.sent, "bytes_payload": self.client.payload, "bytes_received": self.client.received,
                   "rounds": list(self.rounds), "wall_seconds": round(time.time() - t0, 3)}
        atomic_write_json(root / "summary.json", summary)
        return summary


def main(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(prog="diloco learner", description="One independent learner of a run "
                                 "(replica m), exchanging with `diloco syncer` over gRPC (docs/distributed.md).")
    ap.add_argument("--config", required=True, help="the run config (replicas = number of learners)")
    ap.add_argument("--sync", required=True, help="grpc://HOST:PORT of the synchronizer")
    ap.add_argument("--learner", type=int, required=True, help="this learner's index m (0 … replicas-1)")
    ap.add_argument("--workdir", required=True)
    ap.add_argument("--token_file", default=None, help=f"the shared token (default ${common.TOKEN_ENV})")
    ap.add_argument("--sleep", type=float, default=0.0, help="seconds slept per step (a straggler, for tests)")
    args, overrides = ap.parse_known_args(argv)
    from diloco.config import load_config

    try:
        cfg = load_config(args.config, overrides)
        client = SyncClient(args.sync, common.read_token(args.token_file), args.learner, common.fingerprint(cfg))
        summary = Learner(cfg, args.learner, client, args.sleep).train(args.workdir)
    except ConfigError as e:
        print(f"diloco learner: bad input: {e}", file=sys.stderr)
        return 2
    print(json.dumps(summary), flush=True)
    return 0
