"""`diloco sweep … --launch tpu`: the sweep's points on a Cloud TPU queued resource (its options and the
step that checks everything and writes the launch bundle; docs/distributed.md)."""
from __future__ import annotations

import shlex
import sys
from pathlib import Path

from diloco.config import REPO_ROOT
from diloco.errors import ConfigError


def add_arguments(ap) -> None:
    tpu = ap.add_argument_group("--launch tpu (Cloud TPU queued resource; docs/distributed.md)")
    tpu.add_argument("--tpu", help="queued resource name (also the node name, or the node prefix with --slices > 1)")
    tpu.add_argument("--zone", help="its zone, e.g. us-east5-a")
    tpu.add_argument("--project", default="", help="GCP project (default: gcloud's)")
    tpu.add_argument("--accelerator", help="TPU type of one slice, e.g. v5p-16, v5litepod-16, v6e-8")
    tpu.add_argument("--slices", type=int, default=1, help="slices (> 1: multislice, the replicas across them)")
    tpu.add_argument("--runtime", default="", help="TPU software version (default: the generation's)")
    cap = tpu.add_mutually_exclusive_group()
    cap.add_argument("--spot", dest="capacity", action="store_const", const="spot", default="",
                     help="Spot capacity (cheaper, preemptible: the agents resume the point after a repair)")
    cap.add_argument("--reserved", dest="capacity", action="store_const", const="reserved",
                     help="your reservation's capacity")
    cap.add_argument("--best-effort", dest="capacity", action="store_const", const="best-effort",
                     help="best-effort tier (gcloud alpha)")
    tpu.add_argument("--valid-until", default="", metavar="DURATION",
                     help="withdraw the request if not provisioned within this, e.g. 6h (--valid-until-duration)")
    tpu.add_argument("--service-account", default="", help="the VMs' service account (default: Compute Engine's)")
    tpu.add_argument("--network", default="", help="VPC network (default: default)")
    tpu.add_argument("--subnetwork", default="", help="subnetwork")
    tpu.add_argument("--internal-ips", action="store_true",
                     help="no external IPs (the subnetwork then needs Cloud NAT and Private Google Access; ssh via IAP)")
    tpu.add_argument("--max-attempts", type=int, default=3, help="failed attempts per point before it counts as "
                     "failed (a preemption, repair, reboot, maintenance or stop is not one)")
    tpu.add_argument("--max-preemptions", type=int, default=20,
                     help="attempts per point ended by a replaced or rebooted VM (Spot, repair) before it counts as failed")
    tpu.add_argument("--teardown", action="store_true", help="delete the queued resource when every point is done")
    tpu.add_argument("--check-fit", default="table", metavar="{table,compile,off}",
                     help="each point's fit in HBM: from results/pod/memory.csv (default), by compiling, or not")
    tpu.add_argument("--out", default="", help="local folder for the launch bundle (default: "
                     "build/tpu/<sweep>/<queued resource>; a non-empty folder that is not its bundle is refused)")
    tpu.add_argument("--ship", action="append", default=[], metavar="PATH",
                     help="an untracked file to ship too (the tree is the tracked files as on disk)")


def launch_tpu(sweep: dict, args, extra: list[str], argv: list[str]) -> int:
    """`--launch tpu`: every check before anything is created (diloco/tpu/preflight.py), then the launch
    bundle in a local folder (diloco/tpu/bundle.py); `launch_tpu.sh up` in it uploads and creates."""
    from diloco.tpu import bundle, preflight

    if not (args.tpu and args.zone and args.accelerator):
        raise ConfigError("--tpu", "--launch tpu needs --tpu <name>, --zone <zone> and --accelerator <type, e.g. v5p-16>")
    if args.max_attempts < 1:
        raise ConfigError("--max-attempts", f"{args.max_attempts} must be ≥ 1")
    if args.max_preemptions < 0:
        raise ConfigError("--max-preemptions", f"{args.max_preemptions} must be ≥ 0")
    preflight.check_names(args.tpu, args.root, sweep["name"])
    out = Path(args.out or REPO_ROOT / "build" / "tpu" / sweep["name"] / args.tpu).resolve()
    bundle.check_out(out, args.tpu)
    sweep = {**sweep, "points": [p for p in sweep["points"] if args.only in p["name"]]}
    tree = set(bundle.tree_files(exclude=out, ship=tuple(args.ship)))
    left = bundle.untracked(exclude=out, ship=tuple(args.ship))
    if left:
        print(f"diloco sweep: warning: {len(left)} untracked file(s) not shipped to the pod: {', '.join(left[:5])}"
              f"{', …' if len(left) > 5 else ''}; `git add` what the run needs, or --ship PATH", file=sys.stderr)
    checked = preflight.check(sweep, args.root, args.accelerator, args.slices, extra, tree, args.check_fit,
                              remote=not args.dry_run)
    for w in dict.fromkeys(checked.warnings):
        print(f"diloco sweep: warning: {w}", file=sys.stderr)
    for note in checked.notes:
        print(f"diloco sweep: {note}")
    plan = bundle.write(out, sweep, checked, args.root, args.tpu, args.zone, args.project, extra, args.capacity,
                        args.valid_until, args.service_account, args.network, args.subnetwork, args.internal_ips,
                        args.max_attempts, args.teardown, args.runtime, generated_by=shlex.join(["diloco", "sweep", *argv]),
                        ship=tuple(args.ship), max_preemptions=args.max_preemptions)
    script = out / "launch_tpu.sh"
    if args.dry_run:
        print(script.read_text(), end="")
        print(f"# dry run: nothing created, the bucket not touched (its checks skipped); the bundle is in {out}")
        return 0
    print(f"{len(plan['points'])} point(s) checked for {checked.slices}× {checked.slice.name}; bundle in {out}\n"
          f"  bash {script} up       # upload it to {plan['base']}/_launch, create the queued resource, wait for ACTIVE\n"
          f"  bash {script} status   # then: logs POINT, stop, start, down")
    return 0
