"""The overlap model of the cross-slice exchange: the XLA flags that keep collectives asynchronous on
TPU, and compute utilisation predicted at a DCN bandwidth from the compute scheduled under each
cross-slice collective of a compile report."""
from __future__ import annotations

import os

from diloco.errors import ConfigError


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
