"""Chaos runs of independent learners on one machine: `diloco syncer` and M learner processes (`diloco train
--config.sync=grpc://…`) on loopback gRPC, real SIGKILLs, a straggler slowed by a sleep per step, throttled links
(tests/test_learners_grpc.py, and `python -m diloco.learners.chaos --out results/learners`: results/learners/chaos.md).

A scenario is a set of faults on one run config:

  kill      SIGKILL learner 1 once it has logged `at` steps; started again at once on its workdir (it resumes
            from its checkpoint and catches up)
  straggle  learner M−1 sleeps 3× as long per step as the others
  syncer    SIGKILL the synchronizer once learner 0 has logged `at` steps of the run's second half; started
            again at once on its workdir (it resumes from its checkpoint)
  throttle  the synchronizer in namespace 0 of scripts/netns.sh, learner m in m+1, every egress LINK (10 mbit;
            100 ms and 1 % loss where netem exists); no fault

Goodput = the tokens of every contribution merged (the synchronizer's counter) / (train seconds × learners),
train seconds from the first step any learner finished to the last (the processes' start-up and first compiles
left out: the same in every run, and most of a toy run's wall; a restarted learner's are in). Compute utilisation
(CU) = 1 − the seconds the learners' loops waited for answers / their loops' seconds: the transfer not hidden by the
overlap. The eval loss is of learner 0's final θᵍ. The table's runs: quorum = all, --grace 2 s; 4 learners, 48
steps, E3M0, H = 4, 3 fragments, τ = 1, 0.2 s of sleep per step.
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

from diloco.launch import free_port
from diloco.rundir import read_jsonl, write_jsonl

REPO = Path(__file__).resolve().parents[2]
TOKEN = "chaos-run-token-0123456789abcdef"
# scripts/netns.sh's names for the throttled runs (never those of a measurement of `diloco launch --netns`)
NETNS = {"DILOCO_NETNS_PREFIX": "dlchaos", "DILOCO_NETNS_BRIDGE": "dlchbr0", "DILOCO_NETNS_SUBNET": "10.79.0"}
LINK = ("10mbit", "100ms", "1%")  # rate, one-way delay, loss of every namespace's egress


def netns_sh(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(["bash", os.fspath(REPO / "scripts" / "netns.sh"), *args], env={**os.environ, **NETNS},
                          capture_output=True, text=True)


def netns_unusable() -> str | None:
    """Why the throttled runs cannot run on this machine, or None."""
    if os.geteuid() != 0 or not (shutil.which("ip") and shutil.which("tc")):
        return "throttled links need root and iproute2 (ip netns, tc)"
    probe = subprocess.run(["ip", "netns", "add", "dlchaosprobe"], capture_output=True, text=True)
    subprocess.run(["ip", "netns", "del", "dlchaosprobe"], capture_output=True)
    return f"ip netns add failed: {probe.stderr.strip()}" if probe.returncode else None


def throttle(n: int) -> str:
    """Namespaces 0 … n−1 (the synchronizer in 0, learner m in m+1), each egress shaped as LINK says; what the
    links got (netem's delay and loss need the sch_netem module: without it the rate alone)."""
    up = netns_sh("up", str(n), *LINK)
    if up.returncode:
        raise RuntimeError(f"scripts/netns.sh up failed (root and iproute2 needed):\n{up.stderr}")
    qdisc = subprocess.run(["ip", "netns", "exec", f"{NETNS['DILOCO_NETNS_PREFIX']}0", "tc", "qdisc", "show", "dev",
                            "eth0"], capture_output=True, text=True).stdout
    return (f"{LINK[0]}, {LINK[1]}, {LINK[2]} loss" if "netem" in qdisc else
            f"{LINK[0]}; no delay or loss: netem (sch_netem) is not in this kernel")


class Cluster:
    """The processes of one run: the synchronizer on a fixed port (so that a restarted one is found again)
    and the learners, each logging to ROOT/<name>.log."""

    def __init__(self, root: Path, flags: list[str], learners: int, quorum: int | None, grace: float | None,
                 answer: str = "fp32", netns: bool = False, devices: dict[int, int] | None = None):
        self.root, self.flags, self.M, self.netns, self.devices = root, flags, learners, netns, devices or {}
        self.port = free_port()
        self.env = {**os.environ, "DILOCO_SYNC_TOKEN": TOKEN, "XLA_FLAGS": "", **(NETNS if netns else {})}
        self.host = f"{NETNS['DILOCO_NETNS_SUBNET']}.1" if netns else "127.0.0.1"  # namespace 0's address
        self.syncer_args = ["--port", str(self.port), "--workdir", os.fspath(root / "syncer"), "--answer", answer,
                            "--host", self.host, "--stats", os.fspath(root / "stats.json")]
        self.syncer_args += ["--insecure"] if netns else []  # plain gRPC between the namespaces (token still checked)
        self.syncer_args += [] if quorum is None else ["--quorum", str(quorum)]
        self.syncer_args += [] if grace is None else ["--grace", str(grace)]
        self.procs: dict[str, subprocess.Popen] = {}
        root.mkdir(parents=True, exist_ok=True)

    def spawn(self, name: str, args: list[str], ns: int = 0, env: dict | None = None) -> subprocess.Popen:
        """`diloco ARGS` (in namespace `ns` of scripts/netns.sh when the links are throttled)."""
        log = open(self.root / f"{name}.log", "a")
        pre = ["ip", "netns", "exec", f"{NETNS['DILOCO_NETNS_PREFIX']}{ns}"] if self.netns else []
        self.procs[name] = subprocess.Popen([*pre, sys.executable, "-m", "diloco.cli", *args], cwd=REPO,
                                            env={**self.env, **(env or {})}, stdout=log, stderr=subprocess.STDOUT)
        return self.procs[name]

    def syncer(self, timeout: float = 240) -> None:
        """Start the synchronizer and wait until it listens."""
        n = (self.root / "syncer.log").read_text().count("listening on") if (self.root / "syncer.log").exists() else 0
        p = self.spawn("syncer", ["syncer", *self.flags, *self.syncer_args])
        deadline = time.time() + timeout
        while (self.root / "syncer.log").read_text().count("listening on") == n:
            if p.poll() is not None or time.time() > deadline:
                raise RuntimeError(f"the synchronizer did not start:\n{self.log('syncer')}")
            time.sleep(0.1)

    def learner(self, m: int, sleep: float) -> None:
        """Learner m, on `devices[m]` local CPU devices when given (its own mesh: learners differ in chip count)."""
        n = self.devices.get(m)
        devices = {"XLA_FLAGS": f"--xla_force_host_platform_device_count={n}"} if n else None
        self.spawn(f"learner{m}", ["train", *self.flags, f"--config.sync=grpc://{self.host}:{self.port}", "--no_progress",
                                   f"--config.learner={m}", "--workdir", os.fspath(self.root / f"learner{m}"),
                                   "--sleep", str(sleep)], ns=m + 1, env=devices)

    def steps(self, m: int) -> int:
        return len(read_jsonl(self.root / f"learner{m}" / "metrics.jsonl"))

    def log(self, name: str) -> str:
        return (self.root / f"{name}.log").read_text()[-3000:]

    def kill(self, name: str) -> None:
        self.procs[name].send_signal(signal.SIGKILL)
        self.procs[name].wait()

    def until(self, m: int, steps: int, deadline: float) -> None:
        """Wait until learner m has logged `steps` steps (its processes alive)."""
        while self.steps(m) < steps:
            for name, p in self.procs.items():
                if p.poll() not in (None, 0):
                    raise RuntimeError(f"{name} exited {p.returncode}:\n{self.log(name)}")
            if time.time() > deadline:
                raise TimeoutError(f"learner {m} did not reach step {steps}:\n{self.log(f'learner{m}')}")
            time.sleep(0.05)

    def stats(self) -> dict:
        """The synchronizer's counters, from its --stats file (written every second: every merge is answered
        before the learners end, so 2 s later it holds them all)."""
        time.sleep(2.0)
        return json.loads((self.root / "stats.json").read_text())

    def close(self) -> None:
        for p in self.procs.values():
            if p.poll() is None:
                p.kill()
                p.wait()


def run(root: Path, faults: set[str], learners: int, steps: int, overrides: dict, quorum: int | None,
        grace: float | None, sleep: float = 0.2, timeout: float = 600, answer: str = "fp32",
        devices: dict[int, int] | None = None) -> dict:
    """One chaos run; its counters and measurements (see the module's docstring)."""
    flags = ["--config", "experiments/toy.py:streaming", f"--config.replicas={learners}", f"--config.steps={steps}",
             *[f"--config.{k}={v}" for k, v in overrides.items()]]
    link = throttle(learners + 1) if "throttle" in faults else "loopback"
    c, events = Cluster(root, flags, learners, quorum, grace, answer, netns="throttle" in faults, devices=devices), {}
    deadline = time.time() + timeout
    try:
        c.syncer()
        t0 = time.time()
        for m in range(learners):
            c.learner(m, 3 * sleep if "straggle" in faults and m == learners - 1 else sleep)
        if "kill" in faults:
            c.until(1, steps // 3, deadline)
            c.kill("learner1")
            events["learner1_killed_after_step"] = c.steps(1)
            events["learner1_killed_at"] = time.time()
            c.learner(1, sleep)
        if "syncer" in faults:
            c.until(0, steps // 2 + steps // 6, deadline)
            c.kill("syncer")
            events["syncer_killed_after_step_of_learner0"] = c.steps(0)
            events["syncer_killed_at"] = t_kill = time.time()
            c.syncer()
            events["syncer_down_seconds"] = round(time.time() - t_kill, 2)
        for m in range(learners):
            p = c.procs[f"learner{m}"]
            if p.wait(timeout=max(deadline - time.time(), 1)) != 0:
                raise RuntimeError(f"learner {m} exited {p.returncode}:\n{c.log(f'learner{m}')}")
        wall = time.time() - t0
        stats = c.stats()
    finally:
        c.close()
        if link != "loopback":
            netns_sh("down", str(learners + 1))
    summaries = [json.loads((root / f"learner{m}" / "summary.json").read_text()) for m in range(learners)]
    unix = [[row["unix"] for row in read_jsonl(root / f"learner{m}" / "metrics.jsonl")] for m in range(learners)]
    train = max(u[-1] for u in unix) - min(u[0] for u in unix)  # first step done → last step done, any learner
    return {"faults": "+".join(sorted(faults)) or "none", "learners": learners, "steps": steps, "quorum": quorum,
            "grace": grace, "wall_seconds": round(wall, 2), "train_seconds": round(train, 2),
            "tokens_merged": stats["tokens_merged"],
            "goodput_tokens_per_s_per_learner": round(stats["tokens_merged"] / train / learners, 1),
            "compute_utilisation": round(1 - sum(s["seconds_waiting"] for s in summaries)
                                         / sum(s["loop_seconds"] for s in summaries), 3), "link": link,
            "eval_loss": summaries[0]["eval_loss"], "stats": stats, "summaries": summaries, "events": events}


def table(results: list[dict]) -> str:
    """chaos.md: one row per run, goodput against the mean of the no-fault runs, bytes per round per learner."""
    base = [r["goodput_tokens_per_s_per_learner"] for r in results if r["faults"] == "none" and r["answer"] == "fp32"]
    band = [r["eval_loss"] for r in results if r["faults"] == "none" and r["answer"] == "fp32"]
    lines = ["# Independent learners under faults (diloco/learners/chaos.py)", "",
             "`python -m diloco.learners.chaos --out results/learners --runs /tmp/learners_chaos --seeds 3` (2 CPU cores, shared; "
             "4 learner processes + the synchronizer; quorum = all, grace 2 s; tiny scale, 48 steps, E3M0, H = 4, "
             "3 fragments, τ = 1, 0.2 s sleep per step, the straggler 0.6 s). B/round: bytes per push and per answer "
             "of one learner, frames with headers; the SPMD path counts the push's codec bytes per replica. "
             "Raw rows: chaos.jsonl.", "",
             "| faults | answer | seed | train s | tokens merged | goodput tok/s/learner | vs no-fault | CU | eval loss "
             "| every round merged once | late dropped | learner retries | push B/round | answer B/round |",
             "|" + " --- |" * 14]
    for r in results:
        st, ss = r["stats"], r["summaries"]
        once = set(st["merges"].values()) == {1} and set(st["merges"]) == {
            f"{p}/{k}" for p, last in enumerate(st["merged_rounds"]) for k in range(1, last + 1)}
        sends = sum(sum(s["rounds"]) for s in ss)
        lines.append(f"| {r['faults']} | {r['answer']} | {r['seed']} | {r['train_seconds']:.1f} | {r['tokens_merged']} | "
                     f"{r['goodput_tokens_per_s_per_learner']:.1f} | "
                     f"{r['goodput_tokens_per_s_per_learner'] / (sum(base) / len(base)):.2f} | "
                     f"{format(r['compute_utilisation'], '.2f') if 'compute_utilisation' in r else '—'} | "
                     f"{r['eval_loss']:.4f} | "
                     f"{'yes' if once else 'NO'} ({sum(st['merges'].values())}) | "
                     f"{sum(int(v) for v in st['dropped_late'].values())} | {sum(s['retries'] for s in ss)} | "
                     f"{sum(s['bytes_sent'] for s in ss) / sends:.0f} | {sum(s['bytes_received'] for s in ss) / sends:.0f} |")
    lines.append(f"\nNo-fault eval loss band (seeds 0 … {len(band) - 1}): {min(band):.4f} … {max(band):.4f}; a run of "
                 f"seed 0 is within it when |its loss − no-fault seed 0's| ≤ max − min = {max(band) - min(band):.4f}. "
                 "CU: compute utilisation, 1 − (seconds the learners' loops waited for an answer) / (their loops' "
                 "seconds). Tokens merged count a restarted learner's steps done again.")
    links = {r["link"] for r in results if r.get("link", "loopback") != "loopback"}
    lines += [f"throttle: the synchronizer and each learner in a network namespace of its own (scripts/netns.sh), "
              f"every egress {link}." for link in sorted(links)]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", required=True, help="folder of the table (chaos.md, chaos.jsonl)")
    ap.add_argument("--learners", type=int, default=4)
    ap.add_argument("--steps", type=int, default=48)
    ap.add_argument("--seeds", type=int, default=2, help="no-fault runs (seeds 0 … n−1): the eval loss band")
    ap.add_argument("--runs", default=None, help="the runs' folders (default OUT/runs; checkpoints: keep it out of git)")
    ap.add_argument("--grace", type=float, default=2.0)
    ap.add_argument("--only", default="", help="run only these rows (faults-answer, e.g. throttle-fp32,throttle-codec) "
                    "and put them into OUT/chaos.jsonl beside the others")
    args = ap.parse_args(argv)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    base = dict(scale="tiny", seq_len=32, batch_size=4 * args.learners, H=4, layers_per_fragment=1, codec="e3m0",
                codec_block_size=64, tau=1, log_every=1, eval_every=1000, checkpoint_every=4, eval_batches=4)
    plan = [(set(), s, "fp32") for s in range(args.seeds)] + [(set(), 0, "codec")]
    plan += [({f}, 0, "fp32") for f in ("kill", "straggle", "syncer")] + [({"kill", "straggle", "syncer"}, 0, "fp32")]
    plan += [({"throttle"}, 0, "fp32"), ({"throttle"}, 0, "codec")]
    name = lambda faults: "+".join(sorted(faults)) or "none"
    only = set(args.only.split(",")) - {""}
    plan = [p for p in plan if not only or f"{name(p[0])}-{p[2]}" in only]
    results = read_jsonl(out / "chaos.jsonl") if only else []
    for faults, seed, answer in plan:
        results = [r for r in results if (r["faults"], r["answer"], r["seed"]) != (name(faults), answer, seed)]
        root = Path(args.runs or out / "runs") / f"{name(faults)}-{answer}-seed{seed}"
        r = run(root, faults, args.learners, args.steps, {**base, "seed": seed}, quorum=None, grace=args.grace,
                answer=answer)
        r.update(seed=seed, answer=answer)
        results.append(r)
        print(json.dumps({k: r[k] for k in ("faults", "answer", "seed", "wall_seconds",
                                            "goodput_tokens_per_s_per_learner", "compute_utilisation",
                                            "eval_loss")}), flush=True)
    write_jsonl(out / "chaos.jsonl", results)
    (out / "chaos.md").write_text(table(results))
    return 0


if __name__ == "__main__":
    sys.exit(main())
