"""`diloco compile --config SPEC --topology v5e:2x2 [--slices K] [--json]`: prove a run fits a TPU slice.

On this CPU machine, libtpu describes a real TPU topology (`jax.experimental.topologies`); the
project's own Trainer is built on those devices and each of its programs is lowered and compiled
ahead of time with abstract arguments (nothing is allocated, no TPU is needed):

  inner           one AdamW step per replica (Trainer.inner_step)
  send/update/merge p   every fragment's outer operations (OuterDriver.program)
  eval            the evaluation loss on θᵍ (Trainer.eval_fn)

For each: per-chip HBM (arguments, temporaries, outputs, peak) from `memory_analysis()`, FLOPs from
`cost_analysis()`, compile seconds, and every collective parsed from the compiled HLO (kind, operand
bytes, the mesh axes its groups span, whether it crosses slices). Exit 1 when the run does not fit.
"""
from __future__ import annotations

import argparse
import json
import os
import re
import sys
import time
from typing import Any
from pathlib import Path

import numpy as np

from diloco.errors import ConfigError

GiB = 1 << 30
# HBM per chip (Cloud TPU system architecture pages): v4 32 GiB, v5e 16 GiB, v5p 95 GiB, v6e 32 GiB.
# XLA keeps a little for itself (the usable limit it reports is ≈ 0.25 GiB lower).
CHIP_HBM_BYTES = {"v4": 32 * GiB, "v5e": 16 * GiB, "v5p": 95 * GiB, "v6e": 32 * GiB}
INSTALL_HINT = "diloco compile needs libtpu (it compiles for TPU on this machine): pip install -e '.[tpu]'"

_DTYPE_BYTES = {"pred": 1, "s8": 1, "u8": 1, "s16": 2, "u16": 2, "f16": 2, "bf16": 2, "s32": 4, "u32": 4,
                "f32": 4, "s64": 8, "u64": 8, "f64": 8, "c64": 8, "c128": 16, "s4": 0.5, "u4": 0.5}
_COLLECTIVES = ("all-reduce", "all-gather", "reduce-scatter", "all-to-all", "collective-permute")
_DEF = re.compile(r"^\s*(?:ROOT\s+)?%?([\w.\-]+)\s*=\s*(.+?)\s+([a-z][\w\-]*)\((.*)$")
# computations an instruction calls: fusions, reducers, while bodies (× trip count), conditional branches
_CALLS = re.compile(r"\b(calls|to_apply|body|branch_computations)=\{?([%\w.\-, ]+)\}?")


# -- topology ------------------------------------------------------------------------------------
def tpu_devices(topology: str, slices: int = 1) -> list:
    """The devices of a TPU topology described by libtpu (no TPU needed), slice by slice."""
    os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")  # other processes may hold libtpu's lock
    os.environ.setdefault("TPU_SKIP_MDS_QUERY", "1")          # no GCE metadata server here
    chip = topology.split(":")[0]
    if chip not in CHIP_HBM_BYTES:
        raise ConfigError("--topology", f"{topology!r}: unknown chip {chip!r}; use NAME:SHAPE with NAME one of "
                          f"{sorted(CHIP_HBM_BYTES)}, e.g. v5e:2x2, v5p:2x2x2, v4:2x2x2")
    try:
        import libtpu  # noqa: F401
    except ImportError:
        raise ConfigError("--topology", INSTALL_HINT) from None
    from jax.experimental import topologies

    try:
        desc = topologies.get_topology_desc(platform="tpu", topology_name=topology, num_slices=slices)
    except Exception as e:  # libtpu's own message, on one line
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise ConfigError("--topology", f"libtpu does not know {topology!r} (slices={slices}): {first}") from None
    return sorted(desc.devices, key=lambda d: (getattr(d, "slice_index", 0), d.id))


# -- HLO parsing ---------------------------------------------------------------------------------
def shape_bytes(shape: str) -> int:
    """Bytes of an HLO shape string (tuples summed, tokens 0): 'f32[2,128]{1,0}' → 1024."""
    total = 0.0
    for dt, dims in re.findall(r"\b([a-z]+\d*(?:e\d+m\d+\w*)?)\[([\d,]*)\]", shape):
        size = _DTYPE_BYTES.get(dt, 1 if dt.startswith("f8") else None)
        if size is None:
            continue
        total += size * int(np.prod([int(d) for d in dims.split(",") if d] or [1]))
    return int(total)


def _groups(attrs: str) -> list[list[int]] | None:
    m = re.search(r"replica_groups=mesh\[([^\]]*)\](?:<=\[([\d,]+)\](?:T\(([\d,]+)\))?)?\s*\{([^}]*)\}", attrs)
    if m:  # mesh form: mesh['axis_0'=2,'axis_1'=4] {'axis_1'}: groups vary along the named axes
        axes = [(a, int(n)) for a, n in re.findall(r"'([^']+)'=(\d+)", m.group(1))]
        sizes = [n for _, n in axes]
        ids = np.arange(int(np.prod(sizes)))
        if m.group(2):
            ids = ids.reshape([int(x) for x in m.group(2).split(",")])
            if m.group(3):
                ids = ids.transpose([int(x) for x in m.group(3).split(",")])
        ids = ids.reshape(sizes)
        names = [a for a, _ in axes]
        grouped = [names.index(a) for a in re.findall(r"'([^']+)'", m.group(4))]
        rest = [k for k in range(len(names)) if k not in grouped]
        ids = ids.transpose(rest + grouped)
        return ids.reshape(-1, int(np.prod([sizes[k] for k in grouped] or [1]))).tolist()
    m = re.search(r"replica_groups=\[([\d,]+)\]<=\[([\d,]+)\](?:T\(([\d,]+)\))?", attrs)
    if m:  # iota form: [G,S]<=[dims]T(perm)
        gshape = [int(x) for x in m.group(1).split(",")]
        dims = [int(x) for x in m.group(2).split(",")]
        ids = np.arange(int(np.prod(dims))).reshape(dims)
        if m.group(3):
            ids = ids.transpose([int(x) for x in m.group(3).split(",")])
        return ids.reshape(gshape[0], -1).tolist()
    m = re.search(r"(?:replica_groups|source_target_pairs)=\{((?:\{[\d,]*\},?)*)\}", attrs)
    if m:
        groups = [[int(x) for x in g.split(",") if x] for g in re.findall(r"\{([\d,]*)\}", m.group(1))]
        return groups or None  # {}: every device in one group
    return None


def parse_collectives(hlo: str, mesh=None) -> list[dict]:
    """Every collective of a compiled HLO module: kind, operand bytes, groups → mesh axes, slices.

    Async pairs (`all-gather-start` … `all-gather-done`) are one entry with async=True; cross-slice
    transfers that XLA lowers to DCN send/recv (`_xla_megascale_transfer_type`) are counted once
    (the send), with crosses_slices=True."""
    shapes: dict[str, str] = {}
    rows = []
    for line in hlo.splitlines():
        m = _DEF.match(line)
        if not m:
            continue
        name, shape, op, rest = m.groups()
        shapes[name] = shape
        base = op[:-len("-start")] if op.endswith("-start") else op
        dcn = re.search(r'_xla_megascale_transfer_type="(\w+)"', rest)
        if base not in _COLLECTIVES and not (op == "send" and dcn):
            continue
        args = rest.split(")", 1)[0]
        operands = re.findall(r"%([\w.\-]+)", args)
        nbytes = sum(shape_bytes(shapes.get(o, "")) for o in operands)
        row: dict[str, Any] = {"kind": base if not dcn else "dcn-" + dcn.group(1).lower().replace("_", "-"),
                               "operand_bytes": nbytes, "async": op.endswith("-start"), "name": name}
        groups = _groups(rest)
        if groups is None and mesh is not None and base in _COLLECTIVES and "replica_groups={}" in rest:
            groups = [list(range(mesh.devices.size))]
        row["group_size"] = len(groups[0]) if groups else None
        row["axes"], row["crosses_slices"] = _span(groups, mesh) if (groups and mesh is not None) else ([], False)
        if dcn:
            row["axes"], row["crosses_slices"] = slice_axes(mesh) if mesh is not None else [], True
        rows.append(row)
    runs = instruction_runs(hlo)
    for row in rows:  # a collective inside a scanned layer loop runs once per layer
        row["count"] = runs.get(row["name"], 1)
    return rows


def while_trips(rest: str, comps: dict) -> int:
    """Iterations of a while loop: XLA's known_trip_count when the backend config has it; else (libtpu's
    scheduled text drops it) the N of a condition `counter < N` with N a constant, as lax.scan/fori_loop
    count from 0; else 1."""
    n = re.search(r'"known_trip_count":\{"n":"(\d+)"', rest)
    if n:
        return int(n.group(1))
    cond = re.search(r"\bcondition=%?([\w.\-]+)", rest)
    body = comps.get(cond.group(1), []) if cond else []
    consts = {name: int(m.group(1)) for name, _, op, r in body if op == "constant" and (m := re.match(r"(-?\d+)\)", r))}
    for _, _, op, r in body:
        if op == "compare" and "direction=LT" in r:
            args = re.findall(r"%([\w.\-]+)", r.split(")", 1)[0])
            if len(args) == 2 and args[1] in consts:
                return max(consts[args[1]], 1)
    return 1


def instruction_runs(hlo: str) -> dict[str, int]:
    """{instruction: times it runs per execution of the program}: 1 in the entry computation, × the
    known trip count of every while loop around it (e.g. one gradient reduction per scanned layer)."""
    comps, entry = hlo_computations(hlo)
    runs: dict[str, int] = {}

    def visit(c: str, k: int, seen: tuple) -> None:
        if c in seen:
            return
        for name, _, _, rest in comps.get(c, []):
            runs[name] = runs.get(name, 0) + k
            for key, called in _CALLS.findall(rest):
                n = while_trips(rest, comps) if key == "body" else 1
                for sub in re.findall(r"%?([\w.\-]+)", called):
                    visit(sub, k * n, seen + (c,))

    if entry is not None:
        visit(entry, 1, ())
    return runs


def _span(groups: list[list[int]], mesh) -> tuple[list[str], bool]:
    """Mesh axes along which a group's members differ, and whether a group spans two slices.
    Group ids are positions in the mesh's flattened device order (the program's device assignment)."""
    devs = mesh.devices.reshape(-1)
    axes: set[str] = set()
    cross = False
    for g in groups:
        coords = np.array([np.unravel_index(i, mesh.devices.shape) for i in g if i < devs.size])
        if coords.size == 0:
            continue
        axes |= {a for k, a in enumerate(mesh.axis_names) if len(set(coords[:, k])) > 1}
        cross |= len({getattr(devs[i], "slice_index", 0) for i in g if i < devs.size}) > 1
    return [a for a in mesh.axis_names if a in axes], cross


def slice_axes(mesh) -> list[str]:
    """Mesh axes along which the slice index changes (those that cross DCN)."""
    sl = np.vectorize(lambda d: getattr(d, "slice_index", 0))(mesh.devices)
    return [a for k, a in enumerate(mesh.axis_names) if (np.diff(sl, axis=k) != 0).any()]


# -- what the scheduled HLO runs under each collective (exchange=in_step overlap) -----------------
# A collective is asynchronous when the scheduled entry computation issues it and waits for it at two
# points: `X-start … X-done` inside a slice, `send/recv … send-done/recv-done` (libtpu's megascale form)
# across slices. The compute under it is the FLOPs of the dots/convolutions scheduled in between
# (into fusions and called computations; while bodies × their known trip count).
_COMP = re.compile(r"^(ENTRY\s+)?%?([\w.\-]+)\s.*\{\s*$")


def hlo_computations(hlo: str) -> tuple[dict[str, list[tuple[str, str, str, str]]], str | None]:
    """{computation: [(name, shape, op, rest) in text order]}, entry name. The text of a scheduled
    module lists each computation's instructions in its schedule order."""
    comps: dict[str, list] = {}
    entry, cur = None, None
    for line in hlo.splitlines():
        if cur is None:
            m = _COMP.match(line)
            if m and not line.startswith(" ") and "=" not in line.split("(")[0]:
                cur = m.group(2)
                comps[cur] = []
                if m.group(1):
                    entry = cur
            continue
        if line.rstrip() == "}":
            cur = None
            continue
        m = _DEF.match(line)
        if m:
            comps[cur].append(m.groups())
        elif comps[cur]:  # a string attribute with a newline in it (a Pallas kernel's metadata, whose
            n, shape, op, rest = comps[cur][-1]  # next line may start with "}}"): still that instruction
            comps[cur][-1] = (n, shape, op, rest + "\n" + line)
    return comps, entry


def _dims(shape: str) -> list[int]:
    m = re.search(r"\[([\d,]*)\]", shape)
    return [int(d) for d in m.group(1).split(",") if d] if m else []


def op_flops(shape: str, op: str, rest: str, shapes: dict[str, str]) -> float:
    """FLOPs of one dot or convolution from its shapes (2 per multiply-add; padded and dilated
    positions of a convolution's window are not counted, as XLA's cost analysis does); 0 otherwise."""
    if op not in ("dot", "convolution"):
        return 0.0
    ops = re.findall(r"%([\w.\-]+)", rest.split(")", 1)[0])
    if len(ops) < 2:
        return 0.0
    out, lhs, rhs = _dims(shape), _dims(shapes.get(ops[0], "")), _dims(shapes.get(ops[1], ""))
    if op == "dot":
        m = re.search(r"lhs_contracting_dims=\{([\d,]*)\}", rest)
        k = [lhs[int(i)] for i in m.group(1).split(",") if i] if m and lhs else []
        return 2.0 * float(np.prod(out or [1])) * float(np.prod(k or [1]))
    m = re.search(r"dim_labels=(\w+)_(\w+)->(\w+)", rest)
    if not m or not (out and lhs and rhs):
        return 0.0
    ll, rl, ol = m.groups()
    win = re.search(r"window=\{([^}]*)\}", rest)
    attrs = dict(re.findall(r"(\w+)=([\dx_\-]+)", win.group(1))) if win else {}
    spatial = sorted(c for c in ol if c.isdigit())

    def field(key, default, i):
        v = attrs.get(key)
        return default if v is None else v.split("x")[i]

    macs = float(out[ol.index("b")] * out[ol.index("f")] * rhs[rl.index("i")])
    for i, d in enumerate(spatial):
        n_in, n_out = lhs[ll.index(d)], out[ol.index(d)]
        k = int(field("size", "1", i))
        stride, rdil, ldil = int(field("stride", "1", i)), int(field("rhs_dilate", "1", i)), int(field("lhs_dilate", "1", i))
        lo = int(field("pad", "0_0", i).split("_")[0])
        pos = np.arange(n_out)[:, None] * stride + np.arange(k)[None, :] * rdil - lo
        macs *= float(((pos >= 0) & (pos <= (n_in - 1) * ldil) & (pos % ldil == 0)).sum())
    return 2.0 * macs


def computation_flops(hlo: str) -> tuple[dict[str, float], dict, str | None]:
    """(FLOPs of each instruction of every computation, including what it calls), computations, entry."""
    comps, entry = hlo_computations(hlo)
    shapes = {n: s for body in comps.values() for n, s, _, _ in body}
    memo: dict[str, float] = {}

    def comp(c: str, seen=()) -> float:
        if c not in memo:
            memo[c] = 0.0 if c in seen else sum(inst(i, seen + (c,)) for i in comps.get(c, []))
        return memo[c]

    per: dict[str, float] = {}

    def inst(i, seen) -> float:
        name, shape, op, rest = i
        f = op_flops(shape, op, rest, shapes)
        for key, called in _CALLS.findall(rest):
            for c in re.findall(r"%?([\w.\-]+)", called):
                sub = comp(c, seen)
                if key == "body":
                    sub *= while_trips(rest, comps)
                f += sub
        per[name] = f
        return f

    for c in comps:
        comp(c)
    return per, comps, entry


def entry_flops(hlo: str) -> float:
    """Dot/convolution FLOPs of the entry computation (what it calls included; loop bodies × their known
    trip count): the denominator for the share of a program scheduled under a collective."""
    per, comps, entry = computation_flops(hlo)
    return float(sum(per.get(i[0], 0.0) for i in comps.get(entry, [])))


def scheduled_overlap(hlo: str) -> dict[str, dict]:
    """For each collective of the entry computation, by the name its row has in `parse_collectives`
    (the start, the plain op, or the DCN send): async (issued and waited at different points of the
    schedule), done (the last instruction that waits: the received data is in hand), overlapped_ops / overlapped_flops / overlapped_cycles
    (libtpu's `estimated_cycles`) of the instructions scheduled strictly between issue and wait.
    A DCN transfer's window runs from the later of its send/recv to the earlier of their dones."""
    per, comps, entry = computation_flops(hlo)
    body = comps.get(entry, [])
    pos = {n: k for k, (n, _, _, _) in enumerate(body)}
    first_operand = {n: (re.findall(r"%([\w.\-]+)", r.split(")", 1)[0]) or [None])[0] for n, _, _, r in body}
    rendezvous = {n: m.group(1) for n, _, _, r in body
                  if (m := re.search(r'_xla_host_transfer_rendezvous="([^"]+)"', r))}
    done_of = {first_operand[n]: n for n, _, op, _ in body if op.endswith("-done")}
    out: dict[str, dict] = {}
    for n, _, op, rest in body:
        base = op[:-len("-start")] if op.endswith("-start") else op
        if op == "send" and n in rendezvous:
            peers = [r for r, _, o, _ in body if o == "recv" and rendezvous.get(r) == rendezvous[n]]
            starts = [n] + peers
        elif base in _COLLECTIVES:
            starts = [n]
        else:
            continue
        dones = [done_of[s] for s in starts if s in done_of]
        if len(dones) < len(starts):  # synchronous: nothing runs under it
            out[n] = {"async": False, "done": None, "overlapped_ops": 0, "overlapped_flops": 0.0,
                      "overlapped_cycles": 0, "window": [pos[n], pos[n]]}
            continue
        a, b = max(pos[s] for s in starts), min(pos[d] for d in dones)
        between = [body[k] for k in range(a + 1, b)
                   if body[k][2] not in ("send", "recv", "send-done", "recv-done") and not body[k][2].endswith(("-start", "-done"))]
        cyc = sum(int(m.group(1)) for _, _, _, r in between if (m := re.search(r'"estimated_cycles":"(\d+)"', r)))
        out[n] = {"async": True, "done": max(dones, key=pos.get), "overlapped_ops": len(between),
                  "overlapped_flops": float(sum(per.get(i[0], 0.0) for i in between)), "overlapped_cycles": cyc,
                  "window": [a, b]}  # positions in the schedule: issue … wait
    return out


def annotate_overlap(rows: list[dict], hlo: str) -> list[dict]:
    """`parse_collectives` rows with async, overlapped_flops, overlapped_ops, overlapped_cycles from the schedule."""
    sched = scheduled_overlap(hlo)
    for r in rows:
        s = sched.get(r["name"])
        if s is not None:
            r["async"] = s["async"]
            r["overlapped_flops"], r["overlapped_ops"], r["overlapped_cycles"], r["window"] = (
                s["overlapped_flops"], s["overlapped_ops"], s["overlapped_cycles"], s["window"])
        else:
            r.setdefault("overlapped_flops", 0.0)
            r.setdefault("overlapped_ops", 0)
            r.setdefault("overlapped_cycles", 0)
    return rows


# -- XLA settings for overlap on TPU -------------------------------------------------------------
# libtpu reads LIBTPU_INIT_ARGS once, when it initialises: these must be set before JAX touches the
# TPU. The latency-hiding scheduler (default on in libtpu, made explicit) orders the program so an
# async collective's start is issued early and its done late; the async-collective flags keep the
# in-slice all-gathers/all-reduces/permutes asynchronous so they can sit under compute too. The
# cross-slice (DCN) exchange is lowered to megascale send/recv + send-done/recv-done, which libtpu
# schedules apart with or without these flags (tests/test_compile.py compiles both ways).
TPU_OVERLAP_FLAGS = (
    "--xla_tpu_enable_latency_hiding_scheduler=true",
    "--xla_tpu_enable_async_collective_fusion=true",
    "--xla_tpu_enable_async_collective_fusion_fuse_all_gather=true",
    "--xla_tpu_enable_async_collective_fusion_multiple_steps=true",
    "--xla_tpu_overlap_compute_collective_tc=true",
    "--xla_enable_async_all_gather=true",
    "--xla_enable_async_collective_permute=true",
)


def use_tpu_overlap_flags(env=None) -> list[str]:
    """Add TPU_OVERLAP_FLAGS to LIBTPU_INIT_ARGS (a flag the user already set, by name, is kept as
    they set it) when libtpu is installed; return the flags now in LIBTPU_INIT_ARGS. Only libtpu
    reads that variable, so on CPU/GPU this changes nothing; call it before JAX initialises."""
    import importlib.util

    env = os.environ if env is None else env
    if importlib.util.find_spec("libtpu") is None:
        return env.get("LIBTPU_INIT_ARGS", "").split()
    have = env.get("LIBTPU_INIT_ARGS", "").split()
    names = {f.split("=")[0] for f in have}
    added = [f for f in TPU_OVERLAP_FLAGS if f.split("=")[0] not in names]
    env["LIBTPU_INIT_ARGS"] = " ".join(have + added)
    return have + added


# -- predicted compute utilisation from the compiled schedule -------------------------------------
# Peak dense bf16 TFLOP/s per chip (Cloud TPU system architecture pages).
CHIP_PEAK_TFLOPS = {"v4": 275.0, "v5e": 197.0, "v5p": 459.0, "v6e": 918.0}


def parse_bandwidth(text: str) -> list[float]:
    """'1Gbit,10,100Gbit/s' → [1.0, 10.0, 100.0] (Gbit/s)."""
    out = []
    for tok in str(text).split(","):
        t = tok.strip().lower().replace("gbit/s", "").replace("gbps", "").replace("gbit", "").strip()
        try:
            v = float(t)
        except ValueError:
            raise ConfigError("--bandwidth", f"{tok.strip()!r} is not a bandwidth; use Gbit/s, e.g. 1Gbit,10,100") from None
        if v <= 0:
            raise ConfigError("--bandwidth", f"{tok.strip()!r} must be > 0 Gbit/s")
        out.append(v)
    return out


def exchange_collectives(rep: dict) -> dict[str, list[dict]]:
    """The collectives that cross slices, by the program they run in: the outer exchange of a
    multislice Streaming/DiLoCo run (replicas across slices) or DP's gradient reduction. With
    exchange=in_step the sends' own programs are skipped (the step+send programs carry them)."""
    names = {r["program"] for r in rep["programs"] if r["compiled"]}
    out: dict[str, list[dict]] = {}
    for r in rep["programs"]:
        if not r["compiled"] or (r["program"].startswith("send ") and "step+" + r["program"] in names):
            continue
        cs = [c for c in r["collectives"] if c["crosses_slices"]]
        if cs and not r["program"].startswith("eval"):
            out[r["program"]] = cs
    return out


def overlapping(cs: list[dict]) -> list[list[dict]]:
    """Collectives grouped by overlapping schedule windows (`window`: issue … wait positions); one
    group each when no window is known (a report from before windows were recorded: one group)."""
    if any("window" not in c for c in cs):
        return [cs]
    groups: list[list[dict]] = []
    end = -1
    for c in sorted(cs, key=lambda c: c["window"][0]):
        if groups and c["window"][0] < end:
            groups[-1].append(c)
            end = max(end, c["window"][1])
        else:
            groups.append([c])
            end = c["window"][1]
    return groups


def predict_cu(rep: dict, gbit_per_s: float, mfu: float = 0.6, peak_tflops: float | None = None) -> dict:
    """Compute utilisation at a DCN bandwidth between the slices, from the compiled schedule.

    Compute time of a program = its FLOPs per chip / (mfu × peak). A chip's cross-slice transfer of b
    bytes puts b × (chips per slice) bytes on the link between the slices (every chip of a slice
    sends its shard at once); a program's transfers share that link:
        exposed = Σ over groups of transfers whose schedule windows overlap of
                  max over the group's transfers j, in the order they are waited for, of
                  max(0, (bytes of j and of those waited for before it) / bandwidth − compute under j)
    (the link carries a group's transfers one after the other; a wait stalls by what has not arrived
    beyond the compute scheduled under that transfer). A transfer waited for before the step's compute
    (FP4's block scales at 4B) is thus exposed whole, and one scheduled apart is a group of its own. Per round of H inner steps,
    Streaming runs H steps and each fragment's exchange program once; DP exposes its gradient
    reduction every step:
        CU = H · t_step / (H · t_step + Σ_programs exposed)
    With `model_flops_per_chip` in the report (a scanned model: XLA's cost analysis counts the layer
    loop once), t_step = model FLOPs per chip / (mfu × peak), and the compute under a transfer is the
    share of the program's own dot/convolution FLOPs scheduled under it (`hlo_flops`, the same HLO
    count, loop bodies × trip count) times t_step."""
    peak = (peak_tflops or CHIP_PEAK_TFLOPS[rep["topology"].split(":")[0]]) * 1e12 * mfu
    progs = {r["program"]: r for r in rep["programs"] if r["compiled"]}
    step = progs.get("inner") or next((r for n, r in progs.items() if n.startswith("step+send")), None)
    if step is None:  # nothing to time (not asked for, or did not compile): no prediction
        return {"gbit_per_s": gbit_per_s, "mfu": mfu, "cu": None, "exchanges": [],
                "why": "no inner step compiled (include 'inner' or 'step+send p' in --programs)"}
    model = rep.get("model_flops_per_chip")
    t_step = (model or step["flops"]) / peak
    per_slice = rep["chips"] // rep["slices"]
    H = 1 if rep["method"] == "dp" else rep["H"]
    rows, exposed_total = [], 0.0
    for name, cs in exchange_collectives(rep).items():
        prog_flops = progs.get(name, {}).get("hlo_flops", 0.0)
        link_bytes = comm = under = exposed = 0.0
        def seconds(flops: float) -> float:
            return t_step * min(1.0, flops / prog_flops) if model and prog_flops > 0 else flops / peak

        for group in overlapping(cs):  # transfers whose windows overlap share the link
            # the link serves them in the order they are waited for; a wait stalls by what has not
            # arrived yet beyond the compute scheduled under that transfer
            cum = worst = 0.0
            for c in sorted(group, key=lambda c: (c.get("window") or [0, 0])[1]):
                cum += c["operand_bytes"] * c.get("count", 1) * per_slice * 8 / (gbit_per_s * 1e9)
                worst = max(worst, cum - seconds(c.get("overlapped_flops", 0.0)))
            link_bytes += sum(c["operand_bytes"] * c.get("count", 1) for c in group) * per_slice
            comm += cum
            under += seconds(max(c.get("overlapped_flops", 0.0) for c in group))
            exposed += worst
        exposed_total += exposed
        rows.append({"program": name, "link_bytes": link_bytes, "comm_s": comm, "overlapped_s": under,
                     "exposed_s": exposed})
    cu = H * t_step / (H * t_step + exposed_total) if t_step > 0 else 0.0
    return {"gbit_per_s": gbit_per_s, "mfu": mfu, "peak_tflops": peak / mfu / 1e12, "step_s": t_step, "H": H,
            "cu": cu, "exchanges": rows}


def overlap_report(rep: dict) -> str:
    """Lines for the text report: each cross-slice collective, async or not, and the compute under it."""
    lines = []
    for name, cs in exchange_collectives(rep).items():
        for c in cs:
            runs = f" ×{c['count']}" if c.get("count", 1) > 1 else ""
            lines.append(f"  {name:<12} {c['kind']:<16} {c['operand_bytes']:>14,} B/chip{runs}  "
                         f"{'async' if c['async'] else 'SYNC '}  under it: {c.get('overlapped_ops', 0)} ops, "
                         f"{c.get('overlapped_flops', 0.0) / 1e9:.3f} GFLOP, {c.get('overlapped_cycles', 0):,} cycles")
    for p in rep.get("predictions", []):
        if p["cu"] is None:
            lines.append(f"  at {p['gbit_per_s']:g} Gbit/s: no prediction: {p['why']}")
            continue
        lines.append(f"  at {p['gbit_per_s']:g} Gbit/s (MFU {p['mfu']:g}, {p['peak_tflops']:g} TFLOP/s peak, "
                     f"step {p['step_s'] * 1e3:.2f} ms, H {p['H']}): predicted CU {100 * p['cu']:.2f}%")
    return "\n".join(["cross-slice collectives (outer exchange / DP reduction):"] + lines) if lines else ""


# -- compiling the trainer's programs ------------------------------------------------------------
def per_chip_bytes(tree) -> int:
    """Bytes one chip holds of a tree of sharded ShapeDtypeStructs (the largest shard per leaf)."""
    import jax

    total = 0
    for x in jax.tree_util.tree_leaves(tree):
        shard = x.sharding.shard_shape(x.shape) if getattr(x, "sharding", None) is not None else x.shape
        total += int(np.prod(shard)) * np.dtype(x.dtype).itemsize
    return total


HLO_DIR: str | None = None  # set by `diloco compile --hlo-dir`


def compile_one(name: str, jitted, args, mesh) -> dict:
    t0 = time.time()
    lowered = jitted.lower(*args)
    try:
        compiled = lowered.compile()
    except Exception as e:  # XLA's RESOURCE_EXHAUSTED: does not fit
        msg = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        return {"program": name, "compiled": False, "error": msg[:500], "compile_seconds": time.time() - t0,
                "fits": False}
    secs = time.time() - t0
    ma = compiled.memory_analysis()
    cost = compiled.cost_analysis()
    cost = cost[0] if isinstance(cost, (list, tuple)) else (cost or {})
    mem = {"argument_bytes": int(ma.argument_size_in_bytes), "output_bytes": int(ma.output_size_in_bytes),
           "alias_bytes": int(ma.alias_size_in_bytes), "temp_bytes": int(ma.temp_size_in_bytes),
           "code_bytes": int(ma.generated_code_size_in_bytes)}
    peak = int(getattr(ma, "peak_memory_in_bytes", 0) or 0)
    mem["peak_bytes"] = max(peak, mem["argument_bytes"] + mem["output_bytes"] - mem["alias_bytes"]
                            + mem["temp_bytes"])
    hlo = compiled.as_text()
    if HLO_DIR:  # `--hlo-dir`: the scheduled program, to read what the report summarises
        Path(HLO_DIR).mkdir(parents=True, exist_ok=True)
        (Path(HLO_DIR) / (re.sub(r"[^\w.+-]+", "_", name) + ".hlo.txt")).write_text(hlo)
    return {"program": name, "compiled": True, "compile_seconds": round(secs, 3), "memory": mem,
            "flops": float(cost.get("flops", 0.0)),  # XLA's cost analysis: a while body (nn.scan) counted once
            "hlo_flops": entry_flops(hlo),  # dots/convolutions from the HLO, loop bodies × trip count
            # custom kernels in the program (tpu_custom_call: a Pallas/Mosaic kernel such as splash attention)
            "custom_calls": sorted(set(re.findall(r'custom_call_target="([\w.\-]+)"', hlo))),
            "collectives": annotate_overlap(parse_collectives(hlo, mesh), hlo)}


def compile_trainer(cfg, devices, only: set[str] | None = None) -> dict:
    """Build the Trainer on `devices` and compile its programs (all, or those named in `only`)."""
    import jax
    import jax.numpy as jnp
    from jax.sharding import NamedSharding, PartitionSpec as P

    from diloco.trainer import Trainer

    tr = Trainer(cfg, devices=devices)
    mesh = tr.mesh
    repl = NamedSharding(mesh, P())
    state = tr.abstract_state()
    L = cfg.seq_len
    batch = jax.ShapeDtypeStruct((tr.R, cfg.batch_size // tr.R, L), jnp.int32, sharding=tr.batch_sharding)
    todo = [("inner", jax.jit(tr.inner_step(), donate_argnums=(0,)), (state, batch))]
    if tr.driver is not None:
        key = jax.ShapeDtypeStruct((2,), jnp.uint32, sharding=repl)
        contrib = jax.ShapeDtypeStruct((tr.R,), jnp.float32, sharding=repl)
        mask = jax.ShapeDtypeStruct((tr.R,), jnp.bool_, sharding=repl)
        for p in range(tr.driver.P):
            if tr.driver.in_step:  # the send's exchange rides on the next inner step (OuterDriver.step_program)
                todo.append((f"step+send {p}", tr.driver.step_program(tr.inner_step(), p), (state, batch, key, contrib)))
            todo += [(f"send {p}", tr.driver.program("send", p), (state, key, contrib)),
                     (f"update {p}", tr.driver.program("update", p), (state,)),
                     (f"merge {p}", tr.driver.program("merge", p), (state, mask))]
    eparams = state.outer.params if state.outer is not None else jax.tree_util.tree_map_with_path(
        lambda path, x: jax.ShapeDtypeStruct(x.shape[1:], x.dtype, sharding=eval_param_sharding(tr, x, path)),
        state.params)
    ebatch = jax.ShapeDtypeStruct((cfg.batch_size // tr.R * tr.R, L), jnp.int32, sharding=eval_batch_sharding(tr))
    todo.append(("eval", tr.eval_fn(), (eparams, ebatch)))
    state_bytes = per_chip_bytes(state)
    eval_param_bytes = per_chip_bytes(todo[-1][2][0])
    out = []
    for name, fn, args in todo:
        if only is not None and name not in only:
            continue
        r = compile_one(name, fn, args, mesh)
        if r["compiled"]:
            # programs run one after another while the whole state stays resident: eval's arguments
            # are only θᵍ, so the rest of the state is added to its peak.
            resident = state_bytes - eval_param_bytes if name == "eval" else 0
            r["memory"]["resident_bytes"] = resident
            r["peak_bytes_per_chip"] = r["memory"]["peak_bytes"] + resident
        out.append(r)
    return {"trainer": tr, "state_bytes_per_chip": state_bytes, "programs": out}


def eval_batch_sharding(tr):
    """The eval batch's sharding (the Trainer's if it has one, else replicated)."""
    return getattr(tr, "eval_batch_sharding", tr.repl_sharding)


def eval_param_sharding(tr, x, path=None):
    """DP's evaluated parameters (one replica's, no replica axis): laid out by the logical rules like θᵍ
    (before 2026-11-30 the names were not passed, so they were compiled whole on every chip)."""
    fn = getattr(tr, "outer_param_sharding", None)
    names = tr.names_at(path) if path is not None and hasattr(tr, "names_at") else None
    return fn(x.shape[1:], names) if fn else tr.repl_sharding


def report(cfg, topology: str, slices: int = 1, only: set[str] | None = None) -> dict:
    from diloco.config import validate

    devices = tpu_devices(topology, slices)
    validate(cfg, check_data=False, num_devices=len(devices))
    hbm = CHIP_HBM_BYTES[topology.split(":")[0]]
    got = compile_trainer(cfg, devices, only)
    tr, progs = got["trainer"], got["programs"]
    for r in progs:
        if r["compiled"]:
            r["fits"] = r["peak_bytes_per_chip"] <= hbm
    peak = max((r.get("peak_bytes_per_chip", 0) for r in progs), default=0)
    colls = [dict(c, program=r["program"]) for r in progs for c in r.get("collectives", [])]
    return {"topology": topology, "slices": slices, "chips": len(devices), "chip_kind": devices[0].device_kind,
            "chip_hbm_bytes": hbm, "mesh": dict(tr.mesh.shape), "params": tr.n_params, "method": cfg.method,
            "H": cfg.H, "tau": cfg.tau, "exchange": tr.driver.exchange if tr.driver is not None else "dp",
            "libtpu_init_args": os.environ.get("LIBTPU_INIT_ARGS", ""),
            "scale": cfg.scale, "state_bytes_per_chip": got["state_bytes_per_chip"], "peak_bytes_per_chip": peak,
            "model_flops_per_chip": (model_flops_per_step(cfg, tr.n_params) / len(devices)
                                     if tr.mcfg.scan else None),  # cost analysis undercounts a scan
            "fits": all(r["fits"] for r in progs), "programs": progs, "collectives": colls,
            "bytes_per_replica": ({p: tr.driver.bytes_per_replica(p) for p in range(tr.driver.P)}
                                  if tr.driver is not None else {}),
            "wire_bytes_per_replica": ({p: tr.sync.wire_bytes_per_replica(p) for p in range(tr.driver.P)}
                                       if tr.driver is not None else {}),
            # chips of a replica that split each fragment's exchange (1: every chip moves all of it)
            "exchange_shards": ({p: tr.sync.shards(tr.sync.frags.sizes[p]) for p in range(tr.driver.P)}
                                if tr.driver is not None else {})}


def _gb(n: float) -> str:
    return f"{n / GiB:.2f} GiB" if n >= GiB / 4 else f"{n / (1 << 20):.2f} MiB"


def text_report(rep: dict) -> str:
    lines = [f"{rep['method']} {rep['scale']} ({rep['params']:,} params) on {rep['topology']}"
             f"{' ×' + str(rep['slices']) + ' slices' if rep['slices'] > 1 else ''}: {rep['chips']} chips "
             f"({rep['chip_kind']}, {_gb(rep['chip_hbm_bytes'])} HBM each), mesh {rep['mesh']}",
             f"state per chip {_gb(rep['state_bytes_per_chip'])}; peak per chip {_gb(rep['peak_bytes_per_chip'])} "
             f"→ {'fits' if rep['fits'] else 'DOES NOT FIT'}", "",
             f"{'program':<10} {'args':>10} {'temp':>10} {'out':>10} {'peak':>10} {'fits':>5} {'compile s':>9} "
             f"{'GFLOP':>10}  collectives"]
    for r in rep["programs"]:
        if not r["compiled"]:
            lines.append(f"{r['program']:<10} did not compile: {r['error']}")
            continue
        m = r["memory"]
        agg: dict[tuple, list[int]] = {}
        for c in r["collectives"]:
            k = (c["kind"], "×".join(c["axes"]) or "-", c["crosses_slices"], c["async"])
            agg.setdefault(k, [0, 0])
            agg[k][0] += c.get("count", 1)  # runs per step (a collective in a layer loop: once per layer)
            agg[k][1] += c["operand_bytes"] * c.get("count", 1)
        cs = "; ".join(f"{n}× {kind}{' async' if asy else ''} over {ax}{' (DCN)' if dcn else ''}: {b:,} B"
                       for (kind, ax, dcn, asy), (n, b) in agg.items())
        lines.append(f"{r['program']:<10} {_gb(m['argument_bytes']):>10} {_gb(m['temp_bytes']):>10} "
                     f"{_gb(m['output_bytes']):>10} {_gb(r['peak_bytes_per_chip']):>10} {'yes' if r['fits'] else 'NO':>5} "
                     f"{r['compile_seconds']:>9.1f} {r['flops'] / 1e9:>10.2f}  {cs or '-'}")
    ov = overlap_report(rep)
    if ov:
        lines += ["", ov]
    lines += ["", f"exchange {rep.get('exchange')}; LIBTPU_INIT_ARGS: {rep.get('libtpu_init_args') or '(none)'}"]
    return "\n".join(lines)


def main(argv: list[str]) -> int:
    if "--paper-table" in argv:
        return paper_table_main(argv)
    ap = argparse.ArgumentParser(prog="diloco compile",
                                 description="Compile a run's programs for a TPU topology on this machine; "
                                             "report per-chip memory, FLOPs and collectives.")
    ap.add_argument("--config", required=True, help="experiments/<file>.py[:arg], e.g. experiments/toy.py:streaming")
    ap.add_argument("--topology", required=True, help="TPU topology, e.g. v5e:2x2, v5p:2x2x2, v4:2x2x2")
    ap.add_argument("--slices", type=int, default=1, help="number of slices (multislice over DCN)")
    ap.add_argument("--json", action="store_true", help="print one JSON object")
    ap.add_argument("--programs", default="", help="comma-separated subset, e.g. 'inner,send 0,eval' (default: all)")
    ap.add_argument("--bandwidth", default="", help="DCN Gbit/s between slices, e.g. 1Gbit,10,100: predict compute "
                    "utilisation from the compute scheduled under each cross-slice collective")
    ap.add_argument("--mfu", type=float, default=0.6, help="model FLOPs utilisation for compute time (default 0.6)")
    ap.add_argument("--peak-tflops", type=float, default=None, help="peak TFLOP/s per chip (default: the chip's bf16 peak)")
    ap.add_argument("--no-overlap-flags", action="store_true",
                    help="do not add the project's overlap flags to LIBTPU_INIT_ARGS (TPU_OVERLAP_FLAGS)")
    ap.add_argument("--hlo-dir", default=None, help="write each compiled (scheduled) program's HLO text here")
    args, overrides = ap.parse_known_args(argv)
    global HLO_DIR
    HLO_DIR = args.hlo_dir
    if not args.no_overlap_flags:
        use_tpu_overlap_flags()
    from diloco.config import load_config

    try:
        if args.slices < 1:
            raise ConfigError("--slices", f"{args.slices} must be ≥ 1")
        cfg = load_config(args.config, overrides, check_data=False)
        bws = parse_bandwidth(args.bandwidth) if args.bandwidth else []
        rep = report(cfg, args.topology, args.slices,
                     {p.strip() for p in args.programs.split(",")} if args.programs else None)
        rep["predictions"] = [predict_cu(rep, bw, args.mfu, args.peak_tflops) for bw in bws]
    except ConfigError as e:
        print(f"diloco compile: {e}", file=sys.stderr)
        return 2
    print(json.dumps(rep, default=str) if args.json else text_report(rep))
    return 0 if rep["fits"] else 1


# -- the paper-scale memory table (`diloco compile --paper-table`) ---------------------------------
PAPER_SCALES = ("35M", "100M", "200M", "300M", "500M", "1B", "4B", "10B")
PAPER_METHODS = {"DP": "dp", "DiLoCo": "diloco_h30", "Streaming": "streaming_ovl_fp4_h100"}
# Slices a user can ask for, smallest first (v4/v5p are 3-D tori; libtpu's names).
SLICES = {"v5e": ("v5e:2x2", "v5e:2x4", "v5e:4x4", "v5e:4x8", "v5e:8x8", "v5e:8x16", "v5e:16x16"),
          "v5p": ("v5p:2x2x1", "v5p:2x2x2", "v5p:2x2x4", "v5p:2x4x4", "v5p:4x4x4", "v5p:4x4x8", "v5p:4x8x8"),
          "v4": ("v4:2x2x1", "v4:2x2x2", "v4:2x2x4", "v4:2x4x4", "v4:4x4x4", "v4:4x4x8", "v4:4x8x8")}
# Peak bf16 FLOP/s per chip (Cloud TPU system architecture pages) and the MFU the step time is stated at.
PEAK_FLOPS = {"v4": 275e12, "v5e": 197e12, "v5p": 459e12, "v6e": 918e12}
TABLE_MFU = 0.4
TABLE_HEADROOM = 0.10
CSV_FIELDS = ("scale", "method", "chip", "topology", "chips", "devices", "mesh", "params", "global_batch",
              "seq_len", "scan", "remat", "attention", "device_hbm_gib", "state_gib", "inner_peak_gib", "eval_peak_gib", "peak_gib",
              "headroom", "fits", "step_tflop", "step_seconds", "compile_seconds", "note")


def paper_config(scale: str, method: str, spm: str, seq_len: int = 2048):
    """The paper-scale spec (experiments/c4_scaling.py) at seq 2048, T5 32k vocabulary."""
    from diloco.config import load_config

    cfg = load_config(f"experiments/c4_scaling.py:{scale},{PAPER_METHODS[method]}",
                      [f"--config.vocab=sentencepiece:{spm}"], check_data=False)
    cfg.batch_size = max(1, cfg.batch_size * cfg.seq_len // seq_len)  # the spec's tokens per step
    cfg.seq_len = seq_len
    return cfg


def estimate_bytes(cfg, n_params: int, devices: int) -> float:
    """A first guess of the per-device peak (to pick the slice to compile): fp32 params + AdamW moments
    per replica over its devices (+ θᵍ, outer momentum, pending for DiLoCo), bf16 activations under
    full remat (one residual per layer, one block's working set, fp32 logits ×3); no attention scores
    (the splash kernel on TPU keeps them in VMEM)."""
    from diloco.model.scales import SCALES

    s = SCALES[cfg.scale]
    R = 1 if cfg.method == "dp" else cfg.replicas
    per_rep = devices // R
    state = 12 * n_params / per_rep + (12 * n_params / per_rep if R > 1 else 0)
    T = cfg.batch_size * cfg.seq_len / devices  # tokens per device
    act = 2 * T * (s.layers * s.d_model + 6 * s.d_model + 3 * s.mlp_dim) + 12 * T * 32_128
    return state + act


def model_flops_per_step(cfg, n_params: int) -> float:
    """Model FLOPs of one training step (the MFU convention: 6 per parameter per token, plus the
    attention scores' 12·layers·d_model·seq per token; rematerialisation is not counted)."""
    from diloco.model.scales import SCALES

    s = SCALES[cfg.scale]
    return float(cfg.batch_size * cfg.seq_len) * (6.0 * n_params + 12.0 * s.layers * s.d_model * cfg.seq_len)


def devices_per_chip(chip: str) -> int:
    """JAX devices libtpu describes per chip: v4's two TensorCores are two devices."""
    return 2 if chip == "v4" else 1


def slice_devices(topology: str) -> int:
    chip, shape = topology.split(":")
    return int(np.prod([int(x) for x in shape.split("x")])) * devices_per_chip(chip)


def table_row(scale: str, method: str, chip: str, spm: str, topology: str | None = None, log=None) -> dict:
    """Compile inner + eval on the smallest slice of `chip` that fits with ≥10% headroom (or on
    `topology`), FSDP over every device of a replica; the row of results/pod/memory.csv. The rough
    estimate (`estimate_bytes`) only skips slices that cannot fit by a wide margin (2×); the rest are
    compiled smallest first until one fits."""
    cfg = paper_config(scale, method, spm)
    from diloco.model.scales import formula_params

    n = float(formula_params(scale))
    R = 1 if cfg.method == "dp" else cfg.replicas
    hbm = device_hbm(chip)
    if topology is not None:
        todo = [topology]
    else:
        usable = [t for t in SLICES[chip] if cfg.batch_size % slice_devices(t) == 0 and slice_devices(t) % R == 0]
        if not usable:
            raise ConfigError("batch_size", f"{cfg.batch_size} sequences split over no {chip} slice of "
                              f"{', '.join(SLICES[chip])} with {R} replicas")
        first = next((i for i, t in enumerate(usable)
                      if estimate_bytes(cfg, n, slice_devices(t)) <= 2 * (1 - TABLE_HEADROOM) * hbm), len(usable) - 1)
        todo = usable[first:]
    tried = []
    for topology in todo:
        row = compile_row(cfg, scale, method, chip, topology, R, hbm)
        if row["fits"] or topology == todo[-1]:
            break
        tried.append(f"{topology} {row['peak_gib'] or 'did not compile'}")
        if log:
            log(f"  {topology}: does not fit ({row['peak_gib'] or row['note'][:80]}); next slice")
    if tried:
        row["note"] = ("smaller: " + ", ".join(tried) + ("; " + row["note"] if row["note"] else ""))[:300]
    return row


def compile_row(cfg, scale, method, chip, topology, R, hbm) -> dict:
    from diloco.config import validate

    devices = tpu_devices(topology)
    cfg.mesh.replica_axis, cfg.mesh.data, cfg.mesh.fsdp = R if R > 1 else 0, 1, -1
    validate(cfg, check_data=False, num_devices=len(devices))
    t0 = time.time()
    got = compile_trainer(cfg, devices, {"inner", "eval"})
    tr, progs = got["trainer"], {r["program"]: r for r in got["programs"]}
    peak = lambda p: progs[p].get("peak_bytes_per_chip") if progs[p]["compiled"] else None
    ip, ep = peak("inner"), peak("eval")
    ok = ip is not None and ep is not None
    worst = max(ip, ep) if ok else None
    flops = model_flops_per_step(cfg, tr.n_params)
    chips = len(devices) // devices_per_chip(chip)
    note = "; ".join(f"{p}: {progs[p]['error'][:120]}" for p in progs if not progs[p]["compiled"])
    return {"scale": scale, "method": method, "chip": chip, "topology": topology, "chips": chips,
            "devices": len(devices), "mesh": "×".join(f"{k}{v}" for k, v in tr.mesh.shape.items()),
            "params": tr.n_params, "global_batch": cfg.batch_size, "seq_len": cfg.seq_len,
            "scan": tr.mcfg.scan, "remat": tr.mcfg.checkpoint_policy, "attention": tr.mcfg.attention,
            "device_hbm_gib": round(hbm / GiB, 2), "state_gib": round(got["state_bytes_per_chip"] / GiB, 3),
            "inner_peak_gib": round(ip / GiB, 3) if ip is not None else "",
            "eval_peak_gib": round(ep / GiB, 3) if ep is not None else "",
            "peak_gib": round(worst / GiB, 3) if ok else "", "headroom": round(1 - worst / hbm, 3) if ok else "",
            "fits": bool(ok and worst <= (1 - TABLE_HEADROOM) * hbm),
            "step_tflop": round(flops / 1e12, 1),
            "step_seconds": round(flops / (chips * PEAK_FLOPS[chip] * TABLE_MFU), 3),
            "compile_seconds": round(time.time() - t0, 1), "note": note}


def device_hbm(chip: str) -> int:
    """HBM of one JAX device: libtpu describes v4 with its two TensorCores as two devices (16 GiB each)."""
    return CHIP_HBM_BYTES[chip] // devices_per_chip(chip)


def read_table(path) -> list[dict]:
    import csv

    if not os.path.exists(path):
        return []
    with open(path) as f:
        return list(csv.DictReader(f))


def write_table(rows: list[dict], out_dir: str) -> None:
    """results/pod/memory.csv (every row) and memory.md (the table, sorted by scale, method, chip)."""
    import csv

    order = lambda r: (PAPER_SCALES.index(r["scale"]), list(PAPER_METHODS).index(r["method"]),
                       list(SLICES).index(r["chip"]))
    rows = sorted(rows, key=order)
    with open(os.path.join(out_dir, "memory.csv.tmp"), "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=CSV_FIELDS)
        w.writeheader()
        w.writerows(rows)
    os.replace(os.path.join(out_dir, "memory.csv.tmp"), os.path.join(out_dir, "memory.csv"))
    lines = ["# Per-device memory at paper scale (`diloco compile --paper-table`)", "",
             f"Seq {rows[0]['seq_len'] if rows else 2048}, T5 32k vocabulary, the spec's global batch "
             "(experiments/common.py BATCH, same tokens per step at seq 2048), bf16 compute, fp32 params + AdamW; "
             "every spec default left on `auto` (blocks under nn.scan, remat full, Pallas splash attention on "
             "TPU); mesh data=1, fsdp = every device of a replica. The slice is the smallest of the chip that "
             "compiles with ≥10% headroom (smaller slices tried and failed are in the note). Compiled for the "
             "TPU topology with libtpu on a CPU host: inner step and eval; peak = the larger of the two per "
             "device (eval adds the rest of the resident state). Headroom = 1 − peak / device HBM. "
             "TFLOP/step = model FLOPs (6·params + 12·layers·d_model·seq per token); "
             f"step time = that / (chips × peak bf16 FLOP/s × {TABLE_MFU:.0%} MFU). "
             "v4: libtpu describes each chip as 2 devices of 16 GiB.", "",
             "| scale | method | slice | chips | mesh | params | peak GiB/dev | HBM GiB | headroom | fits ≥10% | "
             "TFLOP/step | step s | note |", "|" + "---|" * 13]
    for r in rows:
        hr = f"{float(r['headroom']):.0%}" if r["headroom"] not in ("", None) else "–"
        lines.append(f"| {r['scale']} | {r['method']} | {r['topology']} | {r['chips']} | {r['mesh']} | "
                     f"{int(r['params']) / 1e6:,.0f}M | {r['peak_gib'] or '–'} | {r['device_hbm_gib']} | {hr} | "
                     f"{'yes' if str(r['fits']) == 'True' else 'NO'} | {r['step_tflop']} | {r['step_seconds'] or '–'} | "
                     f"{(r['note'] or '')[:80]} |")
    with open(os.path.join(out_dir, "memory.md"), "w") as f:
        f.write("\n".join(lines) + "\n")


def paper_table(out_dir: str, spm: str, scales=PAPER_SCALES, methods=tuple(PAPER_METHODS), chips=tuple(SLICES),
                log=print) -> list[dict]:
    """Every (scale, method, chip) row, resumable: rows already in memory.csv are kept and skipped."""
    os.makedirs(out_dir, exist_ok=True)
    rows = read_table(os.path.join(out_dir, "memory.csv"))
    done = {(r["scale"], r["method"], r["chip"]) for r in rows}
    for scale in scales:
        for method in methods:
            for chip in chips:
                if (scale, method, chip) in done:
                    continue
                t0 = time.time()
                log(f"{scale} {method} {chip} ...")
                row = table_row(scale, method, chip, spm, log=log)
                log(json.dumps(row) + f"  ({time.time() - t0:.0f} s)")
                rows.append(row)
                write_table(rows, out_dir)
    return rows


def paper_table_main(argv: list[str]) -> int:
    """`diloco compile --paper-table --out results/pod [--scales 35M,1B] [--chips v5e] [--methods DP]`."""
    ap = argparse.ArgumentParser(prog="diloco compile --paper-table")
    ap.add_argument("--paper-table", action="store_true")
    ap.add_argument("--out", default="results/pod")
    ap.add_argument("--scales", default=",".join(PAPER_SCALES))
    ap.add_argument("--methods", default=",".join(PAPER_METHODS))
    ap.add_argument("--chips", default=",".join(SLICES))
    ap.add_argument("--spm", default=os.environ.get("DILOCO_SPM", "/work/shared/data/vocab/"
                                                    "sentencepiece_cc_all.32000.100extra-sentencepiece.model"),
                    help="the T5 SentencePiece model (only its size is used)")
    args = ap.parse_args(argv)
    split = lambda s, allowed, field: [x for x in s.split(",") if x and (x in allowed or _bad(field, x, allowed))]
    try:
        rows = paper_table(args.out, args.spm, split(args.scales, PAPER_SCALES, "--scales"),
                           split(args.methods, PAPER_METHODS, "--methods"), split(args.chips, SLICES, "--chips"))
    except ConfigError as e:
        print(f"diloco compile: {e}", file=sys.stderr)
        return 2
    return 0 if all(str(r["fits"]) == "True" for r in rows) else 1


def _bad(field: str, x: str, allowed) -> bool:
    raise ConfigError(field, f"{x!r} is not one of {', '.join(allowed)}")
