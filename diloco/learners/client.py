"""A learner (`diloco train --config … --config.sync=grpc://HOST:PORT --config.learner=m --workdir DIR`): one JAX job
training replica m of the run config on its own, exchanging with the synchronizer (diloco/learners/syncer.py)
over gRPC instead of the `replica` mesh axis.

It drives the existing Trainer from outside (its jitted inner step, OuterSync's delta and merge, the
schedule, the codec registry) rather than being a placement of the SPMD loop. After inner step t, as the
SPMD driver does (diloco/outer/driver.py):

  sends(t)          Δ_m,p = θᵍ_p − θ_m,p, encoded with the run's codec and the key the SPMD run's replica m
                    uses, pushed as round k of fragment p on a thread of its own (training goes on meanwhile)
  outer_updates(t)  (τ steps later) wait for round k's answer, θᵍ_p after the synchronizer's outer step
  merges(t)         θ_m,p ← α·θ_m,p + (1−α)·θᵍ_p

A push the synchronizer cannot take (UNAVAILABLE: down or restarting; INTERNAL: a failed merge) is sent
again with `retry` set, with backoff (0.5 s doubling to 8 s, for up to --retry_for seconds). While a
fragment's answer is owed for that reason the learner trains on: that fragment's apply and merge happen
when the answer comes, and only its next send waits for it.

Every `checkpoint_every` steps (and at the end) the learner lands what is in flight (not waiting for a
synchronizer that is down) and saves its state (diloco/checkpoint.py) with the rounds landed in DIR/ckpt. Started again on DIR it resumes from the newest
one and catches up (`catch_up`): a round of its own still open at the synchronizer is claimed (a retry, its
answer awaited); a fragment the others merged further meanwhile takes the synchronizer's θᵍ_p, as outer and
as its own parameters, and goes on from that round. A learner started fresh into a run in progress does
the same from the run's init.

Records in DIR: metrics.jsonl (step, train_loss, bytes sent/received, seconds, unix time) and summary.json
(with the eval loss of its final θᵍ).
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from concurrent import futures

import numpy as np

from diloco.errors import ConfigError
from diloco.learners import common, proto
class Pending:
    """A push on the client's pool; `down` once an attempt failed for a reason worth retrying."""

    def __init__(self):
        self.down = False
        self.fut: futures.Future | None = None

    def wait(self) -> bool:
        """Wait for the answer unless the synchronizer is unreachable: True when the answer is here."""
        while not self.fut.done():
            if self.down:
                return False
            futures.wait([self.fut], timeout=0.05)
        return True


class SyncClient:
    """The learner's side of the service: Push (a Pending), Join, Stats; the token on every call, retries."""

    BACKOFF = (0.5, 8.0)  # first wait, longest wait (doubling)

    def __init__(self, address: str, token: str, learner: int, fingerprint: str, timeout: float = 600.0,
                 retry_for: float = 600.0, log=lambda msg: print(msg, file=sys.stderr, flush=True),
                 tls_ca: bytes | None = None, tls_pair: tuple[bytes, bytes] | None = None):
        import grpc

        address = address.removeprefix("grpc://")
        self.grpc, self.timeout, self.retry_for, self.log = grpc, timeout, retry_for, log
        options = [("grpc.max_receive_message_length", 1 << 30), ("grpc.max_send_message_length", 1 << 30)]
        key, cert = tls_pair or (None, None)  # a client certificate, for a synchronizer that asks for one (mTLS)
        self.channel = (grpc.insecure_channel(address, options=options) if tls_ca is None else grpc.secure_channel(
            address, grpc.ssl_channel_credentials(root_certificates=tls_ca, private_key=key, certificate_chain=cert),
            options))
        self.meta = (("authorization", f"Bearer {token}"),)
        self.learner, self.fingerprint = learner, fingerprint
        self.calls = {name: self.channel.unary_unary(f"/{proto.SERVICE}/{name}") for name in ("Push", "Join", "Stats")}
        self.pool = futures.ThreadPoolExecutor(8, thread_name_prefix="diloco-push")
        self.sent = self.received = 0  # bytes on the wire (frames)
        self.payload = 0               # of them, the codec's bytes: what the SPMD path counts in bytes_exchanged
        self.retries = 0

    def call(self, name: str, body: bytes, again: bytes | None = None, pending: Pending | None = None) -> bytes:
        """One call, sent again (`again`: the retry's body) with backoff while the synchronizer is unreachable
        (UNAVAILABLE, DEADLINE_EXCEEDED) or failed a merge (INTERNAL: it is being restarted); other errors raise."""
        grpc, start, wait = self.grpc, time.monotonic(), self.BACKOFF[0]
        retryable = (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED, grpc.StatusCode.INTERNAL)
        while True:
            try:
                return self.calls[name](body, timeout=self.timeout, metadata=self.meta)
            except grpc.RpcError as e:
                if e.code() not in retryable or time.monotonic() - start + wait > self.retry_for:
                    raise
                if pending is not None:
                    pending.down = True
                self.retries += 1
                self.log(f"diloco learner {self.learner}: {name} failed ({e.code().name}: {e.details()}); "
                         f"again in {wait:g} s")
                time.sleep(wait)
                wait, body = min(2 * wait, self.BACKOFF[1]), again or body

    def push(self, p: int, k: int, tokens: int, codec: str, arrays: dict[str, np.ndarray], retry: bool = False,
             have: int | None = None):
        """Round k of fragment p: the codec's arrays in name order; returns a Pending of the answer. `have`:
        the round this learner's θᵍ_p is at (k − 1 lets the synchronizer answer with a quantized update)."""
        names = sorted(arrays)
        head = {"v": proto.VERSION, "learner": self.learner, "fragment": p, "round": k, "tokens": int(tokens),
                "fingerprint": self.fingerprint, "codec": codec,
                "arrays": [[n, arrays[n].dtype.name, list(arrays[n].shape)] for n in names]}
        if have is not None:  # absent: the answer is θᵍ_p in fp32
            head["have"] = have
        payload = b"".join(np.ascontiguousarray(arrays[n]).tobytes() for n in names)
        body, again = proto.frame({**head, "retry": retry}, payload), proto.frame({**head, "retry": True}, payload)
        self.sent += len(body)
        self.payload += len(payload)
        pending = Pending()
        pending.fut = self.pool.submit(self.call, "Push", body, again, pending)
        return pending

    def answer(self, pending: Pending) -> tuple[dict, np.ndarray | dict]:
        """(header, θᵍ_p fp32) of a pushed round, waiting for it; for a quantized answer (header `base`) the
        codec's arrays of the update instead."""
        body = pending.fut.result()
        self.received += len(body)
        head, payload = proto.unframe(body)
        if "base" not in head:
            return head, np.frombuffer(payload, np.float32)
        out, at = {}, 0
        for name, dtype, shape in head["arrays"]:
            nb = int(np.prod(shape)) * np.dtype(dtype).itemsize
            out[name] = np.frombuffer(payload[at:at + nb], dtype).reshape(shape)
            at += nb
        return head, out

    def join(self) -> tuple[list[np.ndarray], dict]:
        """θᵍ per fragment (fp32) and the header: `merged` (last merged round per fragment), `mine`."""
        body = self.call("Join", proto.frame({"v": proto.VERSION, "learner": self.learner,
                                              "fingerprint": self.fingerprint}))
        self.received += len(body)
        head, payload = proto.unframe(body)
        flats, at = [], 0
        for _, _, (n,) in head["arrays"]:
            flats.append(np.frombuffer(payload[at:at + 4 * n], np.float32))
            at += 4 * n
        return flats, head

    def stats(self) -> dict:
        return json.loads(self.call("Stats", b"\0\0\0\x02{}"))


class Learner:
    """Replica m of the run, trained alone: the Trainer's programs, the run's data rows, gRPC exchanges."""

    def __init__(self, cfg, m: int, client: SyncClient, workdir: str, sleep: float = 0.0):
        import jax

        from diloco.checkpoint import Checkpointer
        from diloco.data import prepare
        from diloco.data.reader import StoreBatches
        from diloco.rundir import RunDir, path
        from diloco.trainer import Trainer

        if not 0 <= m < cfg.replicas:
            raise ConfigError("learner", f"{m} must be in 0 … replicas-1 = {cfg.replicas - 1}")
        self.cfg, self.m, self.client, self.sleep = cfg, m, client, sleep
        self.root = path(workdir)
        RunDir(self.root).make()  # the folder and its lock, as a run's: a second learner on it is refused
        self.tr = tr = Trainer(common.learner_config(cfg), devices=jax.devices())  # its own mesh: every local device
        self.sync, self.schedule, self.b = tr.sync, tr.schedule, tr.cfg.batch_size
        self.data = StoreBatches(prepare.store_for(cfg.data, cfg.vocab, cfg.data_dir or None), cfg.seq_len,
                                 cfg.batch_size, cfg.seed, rows=range(m * self.b, (m + 1) * self.b))
        self.ck = Checkpointer(self.root / "ckpt", keep=2)
        self.state = tr.fresh_state()
        self.step = tr.inner_step()
        self.rounds = [0] * self.sync.frags.P      # last round of each fragment sent (or caught up to)
        self.last_send = [0] * self.sync.frags.P   # step of each fragment's previous send
        self.inflight: dict[int, tuple[int, Pending]] = {}  # p → (round, its push)
        self.owed: set[int] = set()                # fragments whose answer came late: apply and merge owed
        self.deferred_steps = 0                    # steps trained while an answer was owed
        self.waited = 0.0                          # seconds the loop waited for answers (transfers not hidden)
        self.caught_up: list[int] = []             # rounds skipped by catch_up, per fragment
        self._jit: dict = {}

    def program(self, kind: str, p: int):
        import jax

        from diloco.outer import codecs

        if (kind, p) not in self._jit:
            sync, M, m = self.sync, self.cfg.replicas, self.m

            def outer(state, theta_n):  # θᵍ_p from the synchronizer into the outer params
                return state.replace(outer=state.outer.replace(params=sync.frags.unflatten(state.outer.params, p,
                                                                                            theta_n)))
            if kind == "encode":  # Δ of the one replica, encoded with the SPMD run's key for replica m
                def f(state, key):
                    return codecs.encode(sync.codec, sync.flat(sync.delta(state.params, state.outer, p))[0],
                                         jax.random.split(key, M)[m])
            elif kind == "theta":
                f = outer
            elif kind == "update":  # a quantized answer: θᵍ_p + decode(update), the synchronizer's program
                add = common.apply_update(sync.codec, sync.frags.sizes[p])

                def f(state, payload):
                    return outer(state, add(sync.frags.flatten(state.outer.params, p), payload))
            elif kind == "adopt":  # catching up: θᵍ_p as outer and as this learner's own fragment p
                def f(state, theta_n):
                    return outer(state, theta_n).replace(
                        params=jax.vmap(lambda th: sync.frags.unflatten(th, p, theta_n))(state.params))
            else:  # merge
                def f(state, mask):
                    return state.replace(params=sync.merge(state.params, state.outer, p, mask))
            self._jit[(kind, p)] = jax.jit(f)
        return self._jit[(kind, p)]

    def resume(self) -> int:
        """The newest checkpoint of this learner (its step, 0 without one), then `catch_up`."""
        got = self.ck.restore(self.tr.abstract_state())
        start = 0
        if got is not None:
            start, self.state, meta = got
            self.rounds, self.last_send = list(meta["rounds"]), list(meta["last_send"])
            self.client.sent, self.client.received, self.client.payload = meta["bytes"]
            self.data.step = start  # the rows of a step are a function of the step alone
            print(f"diloco learner {self.m}: resumed at step {start} (rounds {self.rounds})", file=sys.stderr)
        self.catch_up(fresh=got is None)
        return start

    def catch_up(self, fresh: bool) -> None:
        """Where the synchronizer is: claim a round of ours still open there, adopt θᵍ_p of the fragments
        merged past our last round, and go on from there (see the module's docstring)."""
        import jax.numpy as jnp

        flats, head = self.client.join()
        if fresh and not any(head["merged"]) and not any(head["mine"]):  # a run's start: the synchronizer's θᵍ is this learner's init
            for p, f in enumerate(flats):
                if not np.array_equal(f, np.asarray(self.sync.frags.flatten(self.state.outer.params, p))):
                    raise ConfigError("config", f"fragment {p} of the synchronizer's θᵍ is not this learner's init")
            return
        self.caught_up = [0] * len(flats)
        for p, (merged, mine) in enumerate(zip(head["merged"], head["mine"])):
            at = merged
            if mine > merged:  # our contribution waits in round `mine`: its answer is ours (a retry adds nothing)
                zeros = {n: np.zeros(s, d) for n, d, s, _ in common.payload_layouts(self.sync)[p]}
                h, flats[p] = self.client.answer(self.client.push(p, mine, 1, self.sync.codec.name, zeros, retry=True))
                at = h["round"]
            if at < self.rounds[p]:
                raise ConfigError("sync", f"the synchronizer is at round {at} of fragment {p}, this learner's "
                                          f"checkpoint at {self.rounds[p]}: was it started on another --workdir?")
            if at > self.rounds[p]:
                self.state = self.program("adopt", p)(self.state, jnp.asarray(flats[p]))
                self.caught_up[p], self.rounds[p] = at - self.rounds[p], at
        print(f"diloco learner {self.m}: caught up to rounds {self.rounds} (skipped {self.caught_up})", file=sys.stderr)

    def after_step(self, t: int) -> None:
        import jax.numpy as jnp

        tokens_per_step = self.b * self.cfg.seq_len
        for p in sorted(self.owed):  # late answers that have come: applied and merged now
            if self.inflight[p][1].fut.done():
                self.land(p, merge=True)
        for p in self.schedule.sends(t):
            if p in self.inflight:  # one round in flight per fragment: the previous one's answer first
                self.land(p, merge=p in self.owed)
            arrays = self.program("encode", p)(self.state, self.tr.driver.key(t, p))
            self.rounds[p] += 1
            tokens, self.last_send[p] = (t - self.last_send[p]) * tokens_per_step, t
            self.inflight[p] = (self.rounds[p], self.client.push(p, self.rounds[p], tokens, self.sync.codec.name,
                                                                 {k: np.asarray(v) for k, v in arrays.items()},
                                                                 have=self.rounds[p] - 1))
        for p in self.schedule.outer_updates(t):
            if p in self.inflight and not self.waiting(self.inflight[p][1].wait):
                self.owed.add(p)  # the synchronizer is unreachable: train on, apply when it answers
            elif p in self.inflight:
                self.land(p)
        for p, mask in self.schedule.merges(t):
            if p not in self.owed:
                self.state = self.program("merge", p)(self.state, jnp.asarray(mask[:1]))
        self.deferred_steps += bool(self.owed)

    def waiting(self, fn, *args):
        t = time.monotonic()
        try:
            return fn(*args)
        finally:
            self.waited += time.monotonic() - t

    def land(self, p: int, merge: bool = False) -> dict:
        import jax.numpy as jnp

        k, pending = self.inflight.pop(p)
        head, theta = self.waiting(self.client.answer, pending)
        if head["round"] < k or head["fragment"] != p:
            raise RuntimeError(f"asked fragment {p} round {k}, got {head['fragment']} round {head['round']}")
        self.rounds[p] = max(self.rounds[p], head["round"])  # a late contribution gets the newest θᵍ_p
        if "base" in head:  # quantized: the update from round k − 1, which this learner holds
            self.state = self.program("update", p)(self.state, theta)
        else:
            self.state = self.program("theta", p)(self.state, theta)
        if merge:
            self.owed.discard(p)
            self.state = self.program("merge", p)(self.state, jnp.ones((1,), bool))
        return head

    def save(self, t: int) -> None:
        """A checkpoint of step t: the answers in flight landed first, except those owed by a synchronizer that
        is down (not waited for): their rounds are not in it (counted as not landed), and a resume catches up
        on them from the synchronizer (`catch_up`)."""
        for p in sorted(self.inflight):
            if self.inflight[p][1].wait():
                self.land(p, merge=p in self.owed)
        landed = [k - (p in self.inflight) for p, k in enumerate(self.rounds)]
        self.ck.save(t, self.state, {"rounds": landed, "last_send": self.last_send,
                                     "bytes": [self.client.sent, self.client.received, self.client.payload]})

    def train(self) -> dict:
        from diloco.data.batches import eval_batches
        from diloco.outer.sync import params_sha256
        from diloco.rundir import append_jsonl, atomic_write_json, atomic_write_text

        start = self.resume()
        metrics = self.root / "metrics.jsonl"
        if metrics.exists():  # rows past the checkpoint are trained again: theirs replace them
            keep = [ln for ln in metrics.read_text().splitlines() if json.loads(ln)["step"] <= start]
            atomic_write_text(metrics, "".join(ln + "\n" for ln in keep))
        t0 = time.time()
        for t in range(start + 1, self.cfg.steps + 1):
            tokens = np.asarray(next(self.data))[None]  # (1, b, L): replica m's rows of step t
            self.state, ce_R, _ = self.step(self.state, tokens)
            if self.sleep:
                time.sleep(self.sleep)
            self.after_step(t)
            append_jsonl(metrics, {"step": t, "train_loss": float(ce_R[0]), "bytes_sent": self.client.sent,
                                   "bytes_payload": self.client.payload, "bytes_received": self.client.received,
                                   "seconds": round(time.time() - t0, 3), "unix": round(time.time(), 3)})
            if t % self.cfg.checkpoint_every == 0 or t == self.cfg.steps:
                self.save(t)
        for p in sorted(self.inflight):  # θᵍ with every round in flight applied (the SPMD summary's)
            self.land(p, merge=p in self.owed)
        loop = time.time() - t0
        self.data.close()
        self.ck.close()
        ev = self.tr.eval_fn()
        params = self.tr.eval_params(self.state)
        evals = eval_batches(self.cfg.data, self.cfg.vocab, self.cfg.seq_len, self.cfg.batch_size, self.cfg.eval_batches,
                             data_dir=self.cfg.data_dir or None)
        summary = {"learner": self.m, "steps": self.cfg.steps, "resumed_at": start, "mesh": dict(self.tr.mesh.shape),
                   "params_sha256": params_sha256(self.state.outer.params),
                   "eval_loss": float(np.mean([float(ev(params, np.asarray(b))) for b in evals])),
                   "bytes_sent": self.client.sent, "bytes_payload": self.client.payload,
                   "bytes_received": self.client.received, "rounds": list(self.rounds), "retries": self.client.retries,
                   "steps_with_an_answer_owed": self.deferred_steps, "caught_up": self.caught_up,
                   "loop_seconds": round(loop, 3), "seconds_waiting": round(self.waited, 3),
                   "wall_seconds": round(time.time() - t0, 3)}
        atomic_write_json(self.root / "summary.json", summary)
        return summary


def add_flags(ap: argparse.ArgumentParser) -> None:
    """`diloco train`'s flags of an independent learner (used with --config.sync=grpc://HOST:PORT)."""
    g = ap.add_argument_group("an independent learner (with --config.sync=grpc://HOST:PORT; docs/distributed.md §11)")
    g.add_argument("--token_file", default=None, help=f"the shared token (default ${common.TOKEN_ENV})")
    g.add_argument("--tls_ca", default=None, help="PEM certificate(s) to trust: talk TLS to a synchronizer "
                   "started with --tls_cert")
    g.add_argument("--tls_cert", default=None, help="this learner's PEM certificate, for a synchronizer that "
                   "requires client certificates (its --tls_ca); with --tls_key")
    g.add_argument("--tls_key", default=None, help="PEM private key of --tls_cert")
    g.add_argument("--retry_for", type=float, default=600.0,
                   help="seconds a call is retried while the synchronizer is unreachable (default 600)")
    g.add_argument("--sleep", type=float, default=0.0, help="seconds slept per step (a straggler, for tests)")


def run_learner(cfg, args: argparse.Namespace) -> dict:
    """`diloco train --config.sync=grpc://HOST:PORT --learner m …`: learner m of the run, to its end."""
    if not 0 <= cfg.learner < cfg.replicas:
        raise ConfigError("learner", f"{cfg.learner}: --config.sync={cfg.sync} makes this process one independent "
                                     f"learner; give its index, --config.learner=m (0 … replicas-1 = {cfg.replicas - 1})")
    ca = None if args.tls_ca is None else common.read_file(args.tls_ca, "tls_ca")
    if (args.tls_cert is None) != (args.tls_key is None):
        raise ConfigError("tls_cert", "give both --tls_cert and --tls_key (PEM files), or neither")
    if args.tls_cert is not None and ca is None:
        raise ConfigError("tls_cert", "a client certificate is presented over TLS only: give --tls_ca too")
    pair = None if args.tls_cert is None else (common.read_file(args.tls_key, "tls_key"),
                                                common.read_file(args.tls_cert, "tls_cert"))
    client = SyncClient(cfg.sync, common.read_token(args.token_file), cfg.learner, common.fingerprint(cfg),
                        retry_for=args.retry_for, tls_ca=ca, tls_pair=pair)
    return Learner(cfg, cfg.learner, client, args.workdir, args.sleep).train()
