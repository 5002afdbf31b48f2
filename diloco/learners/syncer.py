"""The synchronizer (`diloco syncer --config … --port …`): independent learners (diloco/learners/client.py)
push their encoded outer gradients of a fragment's round; it merges the round when the quorum has arrived
or the grace window ends (diloco/learners/rounds.py), weighted by tokens, steps θᵍ_p with the run's outer
optimizer (`OuterSync.outer_step` of diloco/outer/sync.py: the code the SPMD path runs, not a copy) and
answers every contributor with the new θᵍ_p. A joining learner gets the current θᵍ (Join).

The service is grpcio with generic handlers over bytes (diloco/learners/proto.py has the frame and the
checks). It binds to 127.0.0.1 unless --host says otherwise, and every call must carry the shared token.
A bad message is refused with its reason (logged, counted in Stats) and the service goes on serving.
With --workdir every merge is checkpointed before it is answered, and a restart resumes from the newest
checkpoint (`Synchronizer.resume`); a merge that raises is answered INTERNAL and stops the service (exit 3).
"""
from __future__ import annotations

import argparse
import collections
import json
import sys
import threading
import time
from concurrent import futures

import numpy as np

from diloco.errors import ConfigError
from diloco.learners import common, proto
from diloco.learners.rounds import Rounds, weights


class MergeFailed(RuntimeError):
    """A merge or its checkpoint raised: the round's learners and every later call get this reason, and the
    synchronizer stops (exit 3); restarted, it resumes from its last checkpoint, which holds no part of it."""


class Synchronizer:
    """θᵍ per fragment and its outer-optimizer state (one OuterState), the rounds, the counters. With a
    `workdir`, every merge is checkpointed (diloco/checkpoint.py: orbax, atomic, checksummed) before any
    learner gets its answer, and a synchronizer started on that workdir resumes from the newest one."""

    def __init__(self, cfg, quorum: int | None = None, grace: float | None = None, workdir=None, answer: str = "fp32",
                 clock=time.monotonic, log=lambda msg: print(msg, file=sys.stderr, flush=True)):
        import jax
        import jax.numpy as jnp

        from diloco.trainer import Trainer

        self.tr = Trainer(common.learner_config(cfg), devices=jax.devices()[:1])
        self.sync = self.tr.sync
        self.outer = self.tr.fresh_state().outer  # θᵍ as every run makes it (jitted init: the same bits)
        self.learners, P = cfg.replicas, self.sync.frags.P
        self.expect = common.Expect(common.fingerprint(cfg), self.sync.codec.name, common.payload_layouts(self.sync))
        self.rounds = Rounds(self.learners, P, quorum, grace)
        if answer not in ("fp32", "codec"):
            raise ConfigError("answer", f"{answer!r}: fp32 (θᵍ_p) or codec (its update, quantized with the run's codec)")
        self.quantize = answer == "codec" and self.sync.codec.name != "none"
        self.residual = tuple(jnp.zeros((n,), jnp.float32) for n in self.sync.frags.sizes)  # of quantized answers
        self.clock, self.log = clock, log
        self.cond = threading.Condition()
        self.answers: dict[tuple[int, int], dict] = {}  # (p, k) → the round's answer: head, theta, update bytes
        self.rejected: collections.Counter = collections.Counter()
        self.bytes_in = self.bytes_out = self.resumed = 0
        self.failed: str | None = None
        self._jit: dict = {}
        self.ck = None if workdir is None else self.resume(workdir, quorum, grace)

    def resume(self, workdir, quorum, grace):
        """The checkpointer of `workdir`/ckpt, after restoring its newest checkpoint if there is one."""
        import jax

        from diloco.checkpoint import Checkpointer
        from diloco.rundir import RunDir, path

        RunDir(workdir).make()  # its lock, held for the process's life: a second synchronizer here is refused
        ck = Checkpointer(path(workdir) / "ckpt", keep=2)
        got = ck.restore(jax.tree_util.tree_map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding),
                                                {"outer": self.outer, "residual": self.residual}))
        if got is not None:
            step, tree, meta = got
            self.outer, self.residual = tree["outer"], tuple(tree["residual"])
            if meta["fingerprint"] != self.expect.fingerprint:
                raise ConfigError("config", f"the checkpoint in {workdir} is of another run config: start the "
                                            "synchronizer with that run's --config, or use a new --workdir")
            self.rounds = Rounds.restore(meta["rounds"], self.learners, quorum, grace)
            self.bytes_in, self.bytes_out, self.resumed = meta["bytes_in"], meta["bytes_out"], meta["resumed"] + 1
            self.log(f"diloco syncer: resumed from checkpoint {step} of {workdir}: merged rounds {self.rounds.merged}")
        return ck

    def save(self) -> None:
        if self.ck is not None:  # step: merges so far (grows by one per merge)
            self.ck.save(sum(self.rounds.merged), {"outer": self.outer, "residual": self.residual}, {
                "rounds": self.rounds.meta(), "fingerprint": self.expect.fingerprint, "bytes_in": self.bytes_in,
                "bytes_out": self.bytes_out, "resumed": self.resumed})

    # -- the math: the SPMD path's average and outer step --------------------------------------------
    def program(self, kind: str, p: int):
        import jax
        import jax.numpy as jnp

        from diloco.outer import codecs

        if (kind, p) not in self._jit:
            sync, n = self.sync, self.sync.frags.sizes[p]
            if kind == "average":  # OuterSync.exchange's arithmetic on the decoded payloads, in learner order
                def f(payload_R, w_R):
                    dec_Rxn = jax.vmap(lambda pl: codecs.decode(sync.codec, pl, n))(payload_R)
                    return (dec_Rxn * w_R[:, None]).sum(0) / jnp.maximum(w_R.sum(), 1.0)
            elif kind == "step":
                def f(params, opt_p, avg_n):
                    params, opt_p = sync.outer_step(params, opt_p, sync.unflat(avg_n, p), p)
                    return params, opt_p, sync.frags.flatten(params, p)
            elif kind == "quantize":  # the update since θᵍ_p's last round, plus what earlier answers left out
                def f(old_n, new_n, resid_n, key):
                    u_n = new_n - old_n + resid_n
                    payload = codecs.encode(sync.codec, u_n, key)
                    return payload, u_n - codecs.decode(sync.codec, payload, n)
            elif kind == "apply":
                f = common.apply_update(sync.codec, n)
            elif kind == "set":
                def f(params, theta_n):
                    return sync.frags.unflatten(params, p, theta_n)
            else:
                raise ValueError(kind)
            self._jit[(kind, p)] = jax.jit(f)
        return self._jit[(kind, p)]

    def merge(self, p: int, k: int) -> None:
        """Merge round k of fragment p (under self.cond): average, outer step, checkpoint, then the answer is
        kept for its learners. Any exception: MergeFailed for every waiter, and the service stops."""
        import jax

        got = self.rounds.take(p, k)
        try:
            w = np.asarray(weights([tok for _, tok, _ in got]), np.float32)
            payload = {name: np.stack([pl[name] for *_, pl in got]) for name in got[0][2]}
            avg = self.program("average", p)(payload, w)
            old_n = self.sync.frags.flatten(self.outer.params, p)
            params, opt_p, theta_n = self.program("step", p)(self.outer.params, self.outer.opt[p], avg)
            update = None
            if self.quantize:  # θᵍ_p moves by exactly what the answer carries; the rest waits in the residual
                key = jax.random.fold_in(jax.random.fold_in(jax.random.PRNGKey(self.tr.cfg.seed), p), k)
                pl, resid = self.program("quantize", p)(old_n, theta_n, self.residual[p], key)
                theta_n = self.program("apply", p)(old_n, pl)
                params = self.program("set", p)(params, theta_n)
                self.residual = self.residual[:p] + (resid,) + self.residual[p + 1:]
                update = {name: np.asarray(a) for name, a in sorted(pl.items())}
            self.outer = self.outer.replace(params=params, opt=self.outer.opt[:p] + (opt_p,) + self.outer.opt[p + 1:])
            theta = np.asarray(theta_n, np.float32)
            self.save()
        except Exception as e:  # noqa: BLE001  (any failure: loudly, to every learner waiting for it)
            self.failed = f"the merge of fragment {p} round {k} failed: {type(e).__name__}: {str(e)[:300]}"
            self.log(f"diloco syncer: {self.failed}; stopping (restart it: it resumes from its last checkpoint)")
            self.cond.notify_all()
            raise MergeFailed(self.failed) from e
        head = {"v": proto.VERSION, "fragment": p, "round": k, "merged": [m for m, *_ in got],
                "tokens": [int(t) for _, t, _ in got], "arrays": [["theta", "float32", list(theta.shape)]]}
        self.answers[(p, k)] = {"head": head, "theta": theta.tobytes(), "update": update}
        self.answers.pop((p, k - 4), None)  # a learner waits for its own round only; keep a few
        self.log(f"diloco syncer: merged fragment {p} round {k} from learners {head['merged']} "
                 f"(tokens {head['tokens']})")

    def reply(self, p: int, k: int, have: int | None = None) -> tuple[dict, bytes]:
        """Round k's answer while it is kept, else θᵍ_p as it is now (its round: the last merged). Quantized
        (the codec's update from round k−1, header `base`) when the learner holds round k−1 (`have`)."""
        if (p, k) in self.answers:
            a = self.answers[(p, k)]
            if a["update"] is not None and have == k - 1:
                u = a["update"]
                return ({**a["head"], "base": k - 1, "arrays": [[n, x.dtype.name, list(x.shape)] for n, x in u.items()]},
                        b"".join(x.tobytes() for x in u.values()))
            return a["head"], a["theta"]
        theta = np.asarray(self.sync.frags.flatten(self.outer.params, p), np.float32)
        r = self.rounds.merged[p]
        return ({"v": proto.VERSION, "fragment": p, "round": r, "merged": self.rounds.took.get((p, r), []),
                 "arrays": [["theta", "float32", list(theta.shape)]]}, theta.tobytes())

    # -- the calls -------------------------------------------------------------------------------------
    def push(self, body: bytes, who: int = proto.ANY) -> bytes:
        """One learner's contribution; returns (after the round merged) the frame of θᵍ_p. Rejected on a bad one.
        `who`: the caller's credential (proto.caller): a learner's token pushes only its own contributions."""
        header, payload = proto.unframe(body)
        proto.check_push(header, payload, self.expect, self.learners, len(self.expect.layouts))
        m, p, k = header["learner"], header["fragment"], header["round"]
        if who not in (proto.ANY, m):
            raise proto.Rejected(f"forbidden: learner {who}'s token cannot push learner {m}'s contribution")
        arrays = {name: np.frombuffer(b, dtype).reshape(shape)
                  for name, (dtype, shape, b) in proto.split_payload(payload, self.expect.layouts[p]).items()}
        with self.cond:
            if self.failed:
                raise MergeFailed(self.failed)
            self.bytes_in += len(body)
            how = self.rounds.add(m, p, k, header["tokens"], arrays, self.clock(), header.get("retry", False))
            if how != "fresh":
                self.log(f"diloco syncer: learner {m}'s fragment {p} round {k}: "
                         + ("late, merged without it (dropped)" if how == "late" else "a retry (nothing added)"))
            while self.rounds.merged[p] < k:
                if self.failed:
                    raise MergeFailed(self.failed)
                if self.rounds.due(p, k, self.clock()):
                    self.merge(p, k)
                    self.cond.notify_all()
                    continue
                end = self.rounds.deadline(p, k)
                self.cond.wait(timeout=1.0 if end is None else min(1.0, max(end - self.clock(), 0.0) + 1e-3))
            head, theta = (self.reply(p, k, header.get("have")) if how != "late" else self.reply(p, self.rounds.merged[p]))
            out = proto.frame({**head, "dropped": "late" if how == "late" else None}, theta)
            self.bytes_out += len(out)
            return out

    def join(self, body: bytes, who: int = proto.ANY) -> bytes:
        """θᵍ of every fragment (fp32, fragment order), the last merged round per fragment and the last round of
        this learner's recorded per fragment: what a new or restarted learner starts from."""
        header, _ = proto.unframe(body)
        proto.check_fields(header, {"v": int, "learner": int, "fingerprint": str})
        if header["fingerprint"] != self.expect.fingerprint:
            raise proto.Rejected("wrong config: this learner's config fingerprint is not the synchronizer's")
        if not 0 <= header["learner"] < self.learners:
            raise proto.Rejected(f"unknown learner {header['learner']} (0 … {self.learners - 1})")
        with self.cond:
            if self.failed:
                raise MergeFailed(self.failed)
            flats = [np.asarray(self.sync.frags.flatten(self.outer.params, p), np.float32)
                     for p in range(self.sync.frags.P)]
            merged, mine = list(self.rounds.merged), self.rounds.last_sent(header["learner"])
        head = {"v": proto.VERSION, "merged": merged, "mine": mine,
                "arrays": [[f"theta{p}", "float32", [len(f)]] for p, f in enumerate(flats)]}
        return proto.frame(head, b"".join(f.tobytes() for f in flats))

    def stats(self) -> dict:
        with self.cond:
            return {"merges": {f"{p}/{k}": n for (p, k), n in sorted(self.rounds.merges.items())},
                    "took": {f"{p}/{k}": ms for (p, k), ms in sorted(self.rounds.took.items())},
                    "merged_rounds": list(self.rounds.merged), "rejected": dict(self.rejected),
                    "dropped_late": {str(m): n for m, n in self.rounds.dropped.items()},
                    "tokens_merged": self.rounds.tokens, "bytes_in": self.bytes_in, "bytes_out": self.bytes_out,
                    "resumed": self.resumed,
                    "failed": self.failed}


def serve(syncer: Synchronizer, token: str, host: str = "127.0.0.1", port: int = 0, workers: int = 32,
          tls: tuple[bytes, bytes] | None = None, client_ca: bytes | None = None):
    """Start the gRPC service; returns (server, bound port). Every method checks the token first: the shared
    secret `token` or a learner's own (proto.learner_token). `tls`: (key, certificate) PEM bytes; `client_ca`:
    PEM certificate(s) a learner's client certificate must be signed by (mutual TLS; refused without one)."""
    import grpc

    def handler(fn):
        def call(body, context):
            who = proto.caller(context.invocation_metadata(), token, syncer.learners)
            if who is None:
                syncer.rejected["unauthenticated"] += 1
                syncer.log("diloco syncer: refused a call: missing or wrong token")
                context.abort(grpc.StatusCode.UNAUTHENTICATED, "missing or wrong token")
            try:
                return fn(body, who)
            except proto.Rejected as e:
                with syncer.cond:
                    syncer.rejected[str(e).split(":")[0]] += 1
                syncer.log(f"diloco syncer: refused a {fn.__name__}: {e}")
                context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(e))
            except MergeFailed as e:  # the learners retry until the synchronizer is restarted
                context.abort(grpc.StatusCode.INTERNAL, str(e))
        return grpc.unary_unary_rpc_method_handler(call)  # no (de)serializers: the body is bytes

    biggest = max(sum(b for *_, b in lay) for lay in syncer.expect.layouts) + proto.MAX_HEADER + 4
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=workers),
                         options=[("grpc.max_receive_message_length", biggest)])
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(proto.SERVICE, {
        "Push": handler(syncer.push), "Join": handler(syncer.join),
        "Stats": handler(lambda body, who: json.dumps(syncer.stats()).encode())}),))
    bound = (server.add_insecure_port(f"{host}:{port}") if tls is None else
             server.add_secure_port(f"{host}:{port}", grpc.ssl_server_credentials(
                 [tls], root_certificates=client_ca, require_client_auth=client_ca is not None)))
    if not bound:
        raise ConfigError("port", f"cannot bind {host}:{port} (in use?)")
    server.start()
    return server, bound


def main(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(prog="diloco syncer", description="The synchronizer of independent learners "
                                 "(docs/distributed.md): merges fragment rounds pushed over gRPC.")
    ap.add_argument("--config", required=True, help="the learners' run config (replicas = number of learners)")
    ap.add_argument("--port", type=int, required=True, help="0: any free port (printed)")
    ap.add_argument("--host", default="127.0.0.1", help="bind address (default loopback only)")
    ap.add_argument("--quorum", type=int, default=None, help="learners a round waits for (default: all)")
    ap.add_argument("--grace", type=float, default=None,
                    help="seconds after a round's first contribution before it merges with what arrived "
                         "(default: none, wait for the quorum)")
    ap.add_argument("--token_file", default=None, help=f"the shared token (default ${common.TOKEN_ENV})")
    ap.add_argument("--learner_token", type=int, default=None, metavar="M",
                    help="print learner M's own token (derived from the shared one; it can push only M's "
                         "contributions: give it to that learner as its --token_file) and exit")
    ap.add_argument("--answer", choices=("fp32", "codec"), default="fp32",
                    help="what a learner gets back: θᵍ_p in fp32 (default: the SPMD run's numbers), or θᵍ_p's update "
                         "quantized with the run's codec, the remainder carried to the next round (error feedback)")
    ap.add_argument("--tls_cert", default=None, help="PEM certificate: serve over TLS (learners: --tls_ca)")
    ap.add_argument("--tls_key", default=None, help="PEM private key of --tls_cert")
    ap.add_argument("--tls_ca", default=None, help="PEM CA certificate(s): require every learner to present a "
                    "client certificate signed by it (mutual TLS; learners: --tls_cert/--tls_key)")
    ap.add_argument("--insecure", action="store_true", help="allow plain gRPC off loopback")
    ap.add_argument("--workdir", default=None, help="checkpoint every merge into WORKDIR/ckpt and resume from "
                    "it when started again (default: none, the state dies with the process)")
    ap.add_argument("--stats", default=None, help="write the counters (JSON) here every second and at exit")
    args, overrides = ap.parse_known_args(argv)
    from diloco.checkpoint import CheckpointError
    from diloco.config import load_config
    from diloco.rundir import atomic_write_json

    try:
        token = common.read_token(args.token_file)
        if args.learner_token is not None:
            print(proto.learner_token(token, args.learner_token))
            return 0
        syncer = Synchronizer(load_config(args.config, overrides), args.quorum, args.grace, args.workdir,
                              args.answer)
        tls = common.read_tls(args.tls_cert, args.tls_key, args.host, args.insecure)
        if args.tls_ca and tls is None:
            raise ConfigError("tls_ca", "client certificates are checked over TLS only: give --tls_cert/--tls_key too")
        ca = None if args.tls_ca is None else common.read_file(args.tls_ca, "tls_ca")
        server, port = serve(syncer, token, args.host, args.port, tls=tls, client_ca=ca)
    except (ConfigError, ValueError, CheckpointError) as e:
        print(f"diloco syncer: bad input: {e}", file=sys.stderr)
        return 2
    print(f"diloco syncer: listening on {args.host}:{port} ({syncer.learners} learners, quorum "
          f"{syncer.rounds.quorum}, grace {args.grace})", flush=True)
    try:
        while syncer.failed is None:
            time.sleep(1.0)
            if args.stats:
                atomic_write_json(args.stats, syncer.stats())
    except KeyboardInterrupt:
        pass
    finally:
        server.stop(grace=1.0)
        if args.stats:
            atomic_write_json(args.stats, syncer.stats())
    if syncer.failed:
        print(f"diloco syncer: {syncer.failed}", file=sys.stderr)
        return 3
    return 0
