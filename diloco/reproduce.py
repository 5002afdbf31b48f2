"""`diloco reproduce`: the paper in miniature, into results/.

With no arguments (embedded corpus, CPU): the toy scaling comparison (DP, DiLoCo H=30, Streaming
DiLoCo overlapped FP4 at H=30 and H=100, at scales tiny and toy), the bytes-exchanged tables, the
simulator's Table 4 and a τ×α ablation (scale tiny), then `diloco tables`. Every training run is a
sweep point under --root, so an interrupted reproduce picks up where it stopped.

  diloco reproduce                                   # ≈ 15 min on 2 CPU cores
  diloco reproduce --data c4 --data_dir ~/tensorflow_datasets --scale 35M+100M --root gs://…
"""
from __future__ import annotations

import argparse
import io
import json
import os
import shlex
import sys
import time
from contextlib import redirect_stdout
from pathlib import Path

from diloco.errors import ConfigError

REPO = Path(__file__).resolve().parents[1]


def _say(msg: str) -> None:
    print(f"[reproduce {time.strftime('%H:%M:%S')}] {msg}", flush=True)


def bytes_analytic(out: Path) -> Path:
    """`diloco bytes` for the paper's 1B Dolma run (Table 1's 441 TB vs 1.10 TB)."""
    from diloco.outer import bytes_calc

    runs = [["--scale", "1B", "--tokens", "25B", "--method", "dp"],
            ["--scale", "1B", "--tokens", "25B", "--method", "diloco", "--H", "100"],
            ["--scale", "1B", "--tokens", "25B", "--method", "streaming", "--H", "100"]]
    text = ["# Analytic bytes, paper scale (1B, 25B tokens, M=2, H=100)", "",
            "Made by `diloco bytes` (docs/codecs.md); compare [SD] Table 1: DP 441 TB vs Streaming FP4 1.10 TB "
            "(≈400×), peak 8× below DiLoCo.", ""]
    for a in runs:
        buf = io.StringIO()
        with redirect_stdout(buf):
            bytes_calc.main(a)
        text += [f"## `diloco bytes {' '.join(a)}`", "", "```", buf.getvalue().rstrip(), "```", ""]
    p = out / "bytes_analytic_1B.md"
    p.write_text("\n".join(text))
    return p


def simulator(out: Path) -> list[Path]:
    """[SD] Table 4 by the compute-utilisation simulator (≈15 s); its full table is in paper_table.md."""
    from diloco.simulate import cli as sim_cli

    sim = out / "simulator"
    buf = io.StringIO()
    with redirect_stdout(buf):
        rc = sim_cli.main(["--paper-table", "--out", str(sim)])
    if rc:
        print(buf.getvalue())
        raise RuntimeError(f"diloco simulate --paper-table failed (exit {rc})")
    return [sim / f"paper_table.{e}" for e in ("md", "csv", "json")]


def _ratio(a, b) -> float | None:
    return float(a) / float(b) if b and a == a and b == b else None  # None for 0 or NaN (a run without syncs)


def headline(root: Path) -> dict:
    """The acceptance numbers: Streaming's gap to DP, bytes ratio, peak ratio; τ/α trends."""
    from diloco.report import load_runs

    df = load_runs(root)
    df = df[df.status == "done"]
    out: dict = {"scaling": [], "tau_alpha": {}}
    sc = df[df.sweep.str.startswith("c4_scaling")]
    for scale, g in sc.groupby("scale", sort=False):
        by = {r.label: r for r in g.itertuples()}
        dp, dil = by.get("data_parallel"), next((r for k, r in by.items() if k.startswith("diloco")), None)
        for lab, r in by.items():
            if not lab.startswith("streaming") or dp is None:
                continue
            out["scaling"].append({
                "scale": scale, "method": lab, "H": r.H, "eval_loss": r.final_eval_loss, "dp_eval_loss": dp.final_eval_loss,
                "diloco_eval_loss": dil.final_eval_loss if dil else None,
                "gap_to_dp_pct": 100 * (r.final_eval_loss / dp.final_eval_loss - 1),
                "bytes_ratio_to_dp": _ratio(r.bytes_exchanged_total, dp.bytes_exchanged_total),
                "peak_ratio_to_diloco": _ratio(r.bytes_peak_per_sync, dil.bytes_peak_per_sync) if dil else None})
    ta = df[df.sweep.str.startswith("tau_alpha")]
    for r in ta.itertuples():
        out["tau_alpha"].setdefault(f"alpha={float(r.alpha):g}", {})[int(r.tau)] = r.final_eval_loss
    return out


def headline_text(h: dict) -> str:
    lines = []
    for s in h["scaling"]:
        peak = f"×{s['peak_ratio_to_diloco']:.3f} (1/{1 / s['peak_ratio_to_diloco']:.1f})" \
            if s["peak_ratio_to_diloco"] else "n/a (no sync)"
        b = s["bytes_ratio_to_dp"] or 0.0
        lines.append(f"  {s['scale']:>5} {s['method']:<24} eval {s['eval_loss']:.4f} (DP {s['dp_eval_loss']:.4f}): "
                     f"gap to DP {s['gap_to_dp_pct']:+.2f}%, total bytes vs DP "
                     f"{f'×{b:.4f} (1/{1 / b:.0f})' if b else '0 (no sync)'}, peak vs DiLoCo {peak}")
    for a, d in sorted(h["tau_alpha"].items()):
        if not d:
            continue
        base = d.get(0, d[min(d)])
        pts = ", ".join(f"τ={t}: {v:.4f} ({100 * (v / base - 1):+.2f}%)" for t, v in sorted(d.items()))
        lines.append(f"  τ×α {a}: {pts}")
    al = h["tau_alpha"]
    if "alpha=0" in al and "alpha=0.5" in al:
        common = sorted(set(al["alpha=0"]) & set(al["alpha=0.5"]))
        diff = ", ".join(f"τ={t}: {al['alpha=0.5'][t] - al['alpha=0'][t]:+.4f}" for t in common)
        lines.append(f"  α=0.5 minus α=0 (negative = α=0.5 better): {diff}")
    return "\n".join(lines)


def _md(rows: list[dict]) -> str:
    import pandas as pd

    from diloco.report import markdown

    return markdown(pd.DataFrame(rows)).rstrip("\n")


def write_readme(out: Path, root: Path, argv: list[str], steps: list[tuple[str, str, float]], h: dict,
                 files: list[Path], history: list[dict]) -> Path:
    cmd = "diloco reproduce" + (" " + shlex.join(argv) if argv else "")
    lines = ["# results/ — generated", "",
             f"Made by `{cmd}` (run records under `{root}`), {time.strftime('%Y-%m-%d %H:%M')} ; regenerate the "
             f"tables alone with `diloco tables --root {root} --out {out}`. `results/paper/` holds the paper's "
             "numbers these are compared with (not generated).", "", "## Steps", "",
             _md([{"step": name, "command": f"`{c}`", "seconds": f"{secs:.0f}"} for name, c, secs in steps])]
    if history:
        lines += ["", "## Invocations on this root", "",
                  "Every `diloco reproduce` on this root (a rerun skips finished runs, so only a run that trained "
                  "them measures the job):", "",
                  _md([{"started": e["started"], "command": f"`{e['command']}`", "runs trained": e["trained"],
                        "skipped": e["skipped"], "failed": e["failed"], "minutes": f"{e['minutes']:.1f}"}
                       for e in history])]
    sweeps = {}
    for p in sorted(root.glob("*/*/point.json")):
        try:
            pt = json.loads(p.read_text())
        except ValueError:
            continue
        f = Path(pt.get("sweep_file", ""))
        rel = f.relative_to(REPO) if f.is_absolute() and REPO in f.parents else f
        sweeps.setdefault(pt.get("sweep", p.parent.parent.name), f"{rel}{':' + pt['sweep_arg'] if pt.get('sweep_arg') else ''}")
    if sweeps:
        lines += ["", "## Sweeps in the records", "",
                  "Every run folder under the root, by sweep (each run's exact command is in its `point.json`):", ""]
        lines += [f"- `{name}`: `diloco sweep {spec} --root {root}`" for name, spec in sorted(sweeps.items())]
    lines += ["", "## Headline (toy scale)", "", "```", headline_text(h), "```", "",
              "## Files", ""]
    for f in sorted(set(files)):
        try:
            rel = f.relative_to(out)
        except ValueError:
            rel = f
        lines.append(f"- `{rel}`")
    lines += ["", "Per-run records: `runs.csv` (one row per run: config, summary, status, workdir); "
              "each run's exact command is in `<workdir>/point.json`.", ""]
    p = out / "README.md"
    p.write_text("\n".join(lines))
    return p


def main(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(prog="diloco reproduce", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--root", default="runs/reproduce", help="where the runs go (resumable; default runs/reproduce)")
    ap.add_argument("--out", default="results", help="tables, plots and README.md (default results/)")
    ap.add_argument("--scale", default="tiny+toy", help="'+'-joined scales of the scaling comparison "
                    "(default tiny+toy; paper scales 35M…4B need --data c4)")
    ap.add_argument("--ablation_scale", "--ablation-scale", default="tiny", help="scale of the τ×α ablation")
    ap.add_argument("--data", default="", help="stdlib (default, embedded) | c4 | dolma:<glob> | jsonl:<glob> …")
    ap.add_argument("--data_dir", "--data-dir", default="", help="TFDS data_dir for --data c4")
    ap.add_argument("--workers", "-j", type=int, default=2, help="training processes at once (default 2)")
    ap.add_argument("--skip", default="", help="comma list of steps to skip: scaling,tau_alpha,simulator,bytes")
    ap.add_argument("--taus", default="0,1,2,5,10,20", help="τ values of the τ×α ablation (< H = 30)")
    ap.add_argument("--alphas", default="0,0.5", help="α values of the τ×α ablation")
    ap.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                    help="extra --config.KEY=VALUE for every run (e.g. steps=20 for a smoke test; use a new --root)")
    ap.add_argument("--process_per_run", "--process-per-run", action="store_true",
                    help="one process per run (slower start-up) instead of --workers long-lived worker processes")
    args = ap.parse_args(argv)
    from diloco import report, sweep as sw

    root, out = Path(args.root), Path(args.out)
    skip = {s for s in args.skip.split(",") if s}
    extra = []
    if args.data:
        extra.append(f"--config.data={args.data}")
    if args.data_dir:
        extra.append(f"--config.data_dir={args.data_dir}")
    for kv in args.set:
        k, eq, v = kv.partition("=")
        if not (k and eq):
            print(f"diloco reproduce: bad input: --set {kv!r} must look like KEY=VALUE", file=sys.stderr)
            return 2
        extra.append(f"--config.{k}={v}")
    try:
        taus = [int(t) for t in args.taus.split(",") if t]
        alphas = [float(a) for a in args.alphas.split(",") if a]
    except ValueError:
        print("diloco reproduce: bad input: --taus/--alphas must be comma-separated numbers, e.g. --taus 0,1,5", file=sys.stderr)
        return 2
    # Runs of one sweep compile the same functions: share them through JAX's persistent cache.
    jax_cache = {k: os.environ.get(k, v) for k, v in (
        ("JAX_COMPILATION_CACHE_DIR", str((root / ".jax_cache").resolve())),
        ("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0"), ("JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES", "-1"))}
    t_start = time.time()
    steps: list[tuple[str, str, float]] = []
    files: list[Path] = []
    try:
        plan = [("scaling", f"sweeps/c4_scaling.py:{args.scale}"), ("tau_alpha", f"sweeps/tau_alpha.py:{args.ablation_scale}")]
        loaded = [(name, spec, sw.load_sweep(str(REPO / spec))) for name, spec in plan if name not in skip]
        for name, _, s in loaded:
            if name == "tau_alpha":
                s["points"] = [p for p in s["points"] if int(p["point"]["tau"]) in taus
                               and float(p["point"]["alpha"]) in alphas]
        n = sum(len(s["points"]) for *_, s in loaded)
        counts = ", ".join(f"{s['name']}: {len(s['points'])}" for *_, s in loaded)
        _say(f"{n} training runs ({counts}), "
             f"{args.workers} at a time, under {root}; then bytes, simulator, tables → {out}/")
        failed = trained = skipped = 0
        for name, spec, s in loaded:
            t0 = time.time()
            _say(f"{name}: diloco sweep {spec} --root {root} -j {args.workers}")
            res = sw.run_sweep(s, root, args.workers, extra, in_process=not args.process_per_run, env=jax_cache)
            print(sw.format_table(res), flush=True)
            failed += sum(r["status"] == "failed" for r in res)
            trained += sum(r["status"] == "done" for r in res)
            skipped += sum(r["status"] == "skipped" for r in res)
            steps.append((name, shlex.join(["diloco", "sweep", spec, "--root", str(root), "-j", str(args.workers),
                                            *([] if args.process_per_run else ["--in-process"]),
                                            *[f"--set={e[len('--config.'):]}" for e in extra]]), time.time() - t0))
        out.mkdir(parents=True, exist_ok=True)
        if "bytes" not in skip:
            t0 = time.time()
            _say("bytes: analytic paper-scale check (diloco bytes --scale 1B …)")
            files.append(bytes_analytic(out))
            steps.append(("bytes (analytic, 1B)", "diloco bytes --scale 1B --tokens 25B --method dp|diloco|streaming --H 100",
                          time.time() - t0))
        if "simulator" not in skip:
            t0 = time.time()
            _say("simulator: diloco simulate --paper-table --out results/simulator  ([SD] Table 4)")
            files += simulator(out)
            steps.append(("simulator Table 4", f"diloco simulate --paper-table --out {out / 'simulator'}", time.time() - t0))
        t0 = time.time()
        _say(f"tables: diloco tables --root {root} --out {out}")
        files += report.build(root, out)
        steps.append(("tables and plots", f"diloco tables --root {root} --out {out}", time.time() - t0))
        h = headline(root)
        (out / "headline.json").write_text(json.dumps(h, indent=1) + "\n")
        files.append(out / "headline.json")
        hist_path = root / "reproduce_history.jsonl"
        with open(hist_path, "a") as f:
            f.write(json.dumps({"started": time.strftime("%Y-%m-%d %H:%M", time.localtime(t_start)),
                                "command": "diloco reproduce" + (" " + shlex.join(argv) if argv else ""),
                                "trained": trained, "skipped": skipped, "failed": failed,
                                "minutes": round((time.time() - t_start) / 60, 2)}) + "\n")
        history = [json.loads(l) for l in hist_path.read_text().splitlines() if l.strip()]
        readme = write_readme(out, root, argv, steps, h, files, history)
    except ConfigError as e:
        print(f"diloco reproduce: bad input: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print(f"\ndiloco reproduce: interrupted; run the same command to resume (finished runs under {root} are kept)",
              file=sys.stderr)
        return 130
    mins = (time.time() - t_start) / 60
    print("\n" + "=" * 78)
    print(f"diloco reproduce: done in {mins:.1f} min; {readme} lists every generated file")
    print(headline_text(h))
    if failed:
        print(f"{failed} run(s) failed: see {out / 'failed_runs.md'} and each run's failed.json")
    print("=" * 78)
    return 1 if failed else 0
