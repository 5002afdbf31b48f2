"""Reading XLA's compiled HLO text: shape bytes, collectives (kind, bytes, replica groups → mesh axes,
slices), how often each instruction runs (while-loop trip counts), dot/convolution FLOPs, and what the
schedule places between an async collective's issue and its wait."""
from __future__ import annotations

import re
from typing import Any

import numpy as np

_DTYPE_BYTES = {"pred": 1, "s8": 1, "u8": 1, "s16": 2, "u16": 2, "f16": 2, "bf16": 2, "s32": 4, "u32": 4,
                "f32": 4, "s64": 8, "u64": 8, "f64": 8, "c64": 8, "c128": 16, "s4": 0.5, "u4": 0.5}
_COLLECTIVES = ("all-reduce", "all-gather", "reduce-scatter", "all-to-all", "collective-permute")
_DEF = re.compile(r"^\s*(?:ROOT\s+)?%?([\w.\-]+)\s*=\s*(.+?)\s+([a-z][\w\-]*)\((.*)$")
# computations an instruction calls: fusions, reducers, while bodies (× trip count), conditional branches
_CALLS = re.compile(r"\b(calls|to_apply|body|branch_computations)=\{?([%\w.\-, ]+)\}?")


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


def custom_calls(hlo: str) -> list[str]:
    """The custom-call targets of a compiled program, sorted: kernels such as `tpu_custom_call` (Pallas/Mosaic)
    or cuDNN's fused attention, whose names carry a `$` (`__cudnn$fmhaSoftmax`)."""
    return sorted(set(re.findall(r'custom_call_target="([^"]+)"', hlo)))


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
