"""One plan of every choice a run's config leaves to `auto`, resolved once from the config and the
devices: the platform, the mesh, attention, rematerialisation, nn.scan, the exchange placement and the
outer schedule (the mesh's arithmetic is here: `mesh_shape`).

    plan = resolve(cfg, devices, comm_devices)   # nothing compiled, nothing allocated
    plan.to_json()                               # summary.json["resolved"], printed by `diloco compile`

The Trainer builds its mesh, model and outer placement from the plan only (the model never sees
"auto"); `diloco sweep` compares a finished run's recorded plan with the plan its point resolves to
now (a run is stale when they differ). Each choice carries the reason it was made (`why`).
"""
from __future__ import annotations

import dataclasses
import os
from typing import Any

from diloco.axes import mesh_rules
from diloco.errors import ConfigError
from diloco.model.scales import SCALES, TOY_SCALES, formula_params
from diloco.model.transformer import SPLASH_BLOCK

# cuDNN's fused attention (jax.nn.dot_product_attention(implementation="cudnn")): half-precision
# inputs, a head dimension that is a multiple of 8 up to 128 (jax checks the same and raises otherwise).
CUDNN_DTYPES = ("bfloat16", "float16")
CUDNN_MAX_HEAD_DIM = 128


@dataclasses.dataclass(frozen=True)
class Plan:
    platform: str                 # "cpu" | "gpu" | "tpu": what the programs compile for
    devices: int                  # compute devices of the mesh
    mesh: tuple[int, int, int, int]  # (replica, data, fsdp, tensor)
    attention: str                # xla | dot_product | cudnn | splash
    remat: str                    # none | full | save_dots
    scan: bool                    # nn.scan over the blocks
    exchange: str                 # none (dp) | blocking | in_step | comm_device
    matmul_precision: str = "default"  # default | high | highest (or JAX_DEFAULT_MATMUL_PRECISION's): float32 matmuls
    why: dict = dataclasses.field(default_factory=dict, compare=False)  # choice → the reason, in words
    schedule: Any = dataclasses.field(default=None, compare=False)  # the outer Schedule (None for DP)
    # GPU only: the XLA_FLAGS of XLA's GPU compiler this process compiles with (diloco/compile/gpu.py's
    # overlap flags, or the user's); recorded, not compared (the programs' numbers do not depend on them)
    xla_flags: tuple = dataclasses.field(default=(), compare=False)
    # GPU only: bytes one program may hold on a device (devmem.device_limit), what remat `auto` was chosen against
    device_limit: int = dataclasses.field(default=0, compare=False)

    def to_json(self) -> dict[str, Any]:
        return {"platform": self.platform, "devices": self.devices,
                "mesh": mesh_dict(self.mesh), "attention": self.attention,
                "matmul_precision": self.matmul_precision,
                "remat": self.remat, "scan": self.scan, "exchange": self.exchange, "why": dict(self.why),
                **({"xla_flags": list(self.xla_flags)} if self.xla_flags else {}),
                **({"device_limit_bytes": self.device_limit} if self.device_limit else {})}

    def lines(self) -> list[str]:
        """The plan as `diloco compile` prints it: one choice a line, with its reason."""
        j = self.to_json()
        return [f"resolved {k}: {j[k]}" + (f"  ({self.why[k]})" if k in self.why else "")
                for k in ("platform", "mesh", "attention", "remat", "scan", "exchange")] + (
            [f"resolved tensor: {self.mesh[3]}  ({self.why['tensor']})"] if "tensor" in self.why else [])


def mesh_dict(shape) -> dict[str, int]:
    """{axis: size} of a mesh shape (a tuple, or a Mesh's `.shape`) as recorded (summary.json "resolved"): `tensor` only when it splits (> 1),
    so plans recorded before the tensor axis compare equal to a tensor-1 plan."""
    d = dict(zip(("replica", "data", "fsdp", "tensor"), (int(x) for x in getattr(shape, "values", lambda: shape)())))
    if d.get("tensor", 1) == 1:
        d.pop("tensor", None)
    return d


def replica_axis_size(cfg, n_dev: int) -> int:
    """Devices on the `replica` mesh axis: M when M divides the device count, else 1 (all replicas
    live on each device, still a leading array axis). DP puts every device on `data`."""
    if cfg.method == "dp":
        return 1
    want = cfg.mesh.replica_axis or cfg.replicas
    if n_dev % want == 0 and cfg.replicas % want == 0:
        return want
    if cfg.mesh.replica_axis:
        raise ConfigError("mesh.replica_axis", f"{want} must divide both the {n_dev} devices and replicas={cfg.replicas}")
    return 1


def mesh_shape(cfg, n_dev: int, platform: str = "cpu", hbm: int = 0) -> tuple[int, int, int, int]:
    """(replica, data, fsdp, tensor) axis sizes for n_dev devices (ConfigError when they or the batch do not fit).
    mesh.tensor: the chips of a replica splitting heads/MLP/vocabulary (`tensor_size`; 0 = auto). mesh.data /
    mesh.fsdp: a size, or -1 for the devices of a replica left over by the others; mesh.fsdp = 0 is "auto" (the
    default): 1 at the toy scales (every device on data), and at the paper's scales FSDP over every device of a
    replica left by tensor (data 1 unless given), so the parameters and optimizer state of a large model are split
    over its chips."""
    r_axis = replica_axis_size(cfg, n_dev)
    tensor = tensor_size(cfg, n_dev // r_axis, platform, hbm, replicas_here(cfg, r_axis))[0]
    per = n_dev // r_axis // tensor  # the devices of one replica's data × fsdp axes
    where = f"({n_dev} devices / replica axis {r_axis}" + (f" / tensor {tensor})" if tensor > 1 else ")")
    data, fsdp = data_fsdp(cfg, per, where)
    per_dev = cfg.batch_size // cfg.replicas if cfg.method != "dp" else cfg.batch_size
    if per_dev % per:
        raise ConfigError("batch_size", f"per-replica batch {per_dev} is not divisible by the {per} devices of the "
                          f"data×fsdp axes {where}; use a multiple of {per}")
    return r_axis, data, fsdp, tensor


def replicas_here(cfg, r_axis: int) -> int:
    """Replicas whose state each device holds (all of them when the `replica` axis is 1; DP: one)."""
    return 1 if cfg.method == "dp" else cfg.replicas // r_axis


def data_fsdp(cfg, per: int, where: str = "") -> tuple[int, int]:
    """(data, fsdp) sizes for the `per` devices of one replica's data × fsdp axes (mesh_shape's rules)."""
    data, fsdp = int(cfg.mesh.get("data", -1)), int(cfg.mesh.get("fsdp", 1))
    if fsdp == 0:  # auto
        if cfg.scale in TOY_SCALES:
            fsdp = 1
        else:
            data, fsdp = (1 if data == -1 else data), -1
    for field, v in (("mesh.data", data), ("mesh.fsdp", fsdp)):
        if v == 0 or v < -1:
            raise ConfigError(field, f"{v} must be ≥ 1, or -1 for the remaining devices" +
                              (", or 0 (auto)" if field == "mesh.fsdp" else ""))
        if v > 0 and per % v:
            raise ConfigError(field, f"{v} does not divide the {per} devices of one replica {where}; "
                              f"use a divisor of {per}")
    if data == -1 and fsdp == -1:
        raise ConfigError("mesh.fsdp", "mesh.data and mesh.fsdp are both -1; give one of them a size")
    data = per // fsdp if data == -1 else data
    fsdp = per // data if fsdp == -1 else fsdp
    if data * fsdp != per:
        raise ConfigError("mesh.fsdp", f"mesh.data={data} × mesh.fsdp={fsdp} = {data * fsdp} ≠ the {per} devices of "
                          f"one replica {where}; set one of them to -1")
    return data, fsdp


def tensor_size(cfg, per: int, platform: str = "cpu", hbm: int = 0, here: int = 1) -> tuple[int, str]:
    """(`mesh.tensor` resolved for `per` devices of a replica, why). A size is checked (`check_tensor`); 0 is
    auto: the smallest size `check_tensor` allows whose mesh takes the batch and whose estimated inner-step peak
    (devmem.estimate_peak under the platform's remat, `here` replicas on each device) fits `hbm` (bytes per
    device); 1 on CPU, at the toy scales (memory is not the limit there) and where the device's memory is unknown."""
    want = int(cfg.mesh.get("tensor", 1))
    if want:
        check_tensor(cfg, want, per)
        return want, "set in the config"
    if platform == "cpu" or cfg.scale in TOY_SCALES:
        return 1, "auto: CPU or a toy scale, memory is not the limit"
    if not hbm:
        return 1, f"auto: {platform} device memory unknown"
    ok = []
    for t in (d for d in range(1, per + 1) if per % d == 0):
        try:
            check_tensor(cfg, t, per)
            need = inner_peak(cfg, per, t, remat(cfg, platform)[0], here)
        except ConfigError:
            continue
        ok.append(t)
        if need <= hbm:
            return t, (f"auto: the smallest tensor whose estimated peak, {need / 2**30:.1f} GiB per chip, fits "
                       f"{hbm / 2**30:.1f} GiB")
    t = ok[-1] if ok else 1
    return t, f"auto: no tensor size fits {hbm / 2**30:.1f} GiB per chip by the estimate; the largest that splits: {t}"


def inner_peak(cfg, per: int, t: int, policy: str, here: int = 1) -> int:
    """devmem.estimate_peak of a replica of `per` devices split tensor `t` × data × fsdp, `here` replicas on each
    device (ConfigError when that mesh does not take the per-replica batch)."""
    from diloco.devmem import estimate_peak

    data, fsdp = data_fsdp(cfg, per // t)
    if (cfg.batch_size if cfg.method == "dp" else cfg.batch_size // cfg.replicas) % (data * fsdp):
        raise ConfigError("batch_size", f"the per-replica batch does not split over data × fsdp = {data * fsdp}")
    R = 1 if cfg.method == "dp" else cfg.replicas
    return estimate_peak(cfg, policy, (max(R // here, 1), data, fsdp, t), *params_and_rows(cfg))


def params_and_rows(cfg) -> tuple[int, int]:
    """(parameters, padded vocabulary rows) of the run's scale and vocabulary: what devmem's estimate takes."""
    from diloco.model.scales import BYTE_VOCAB, padded_vocab, run_vocab

    V = padded_vocab(BYTE_VOCAB if cfg.vocab == "byte" else run_vocab(cfg.scale)[1])
    return formula_params(cfg.scale, V), V


def device_hbm(device) -> int:
    """Bytes one device offers: its allocator's limit where it reports one (GPU, a TPU VM), else the HBM of its
    TPU kind (TPU_HBM_BYTES: compiling for a topology on this CPU), else 0 (unknown)."""
    try:
        stats = device.memory_stats() or {}
    except Exception:  # a topology's device (AOT) or a backend without statistics
        stats = {}
    if stats.get("bytes_limit"):
        return int(stats["bytes_limit"])
    kind = str(getattr(device, "device_kind", "")).lower()
    return next((v for k, v in TPU_HBM_BYTES.items() if k in kind), 0)


# HBM per TPU device by device_kind (Cloud TPU system architecture pages; libtpu's v4 device is one chip).
TPU_HBM_BYTES = {"v5p": 95 * 2**30, "v5 lite": 16 * 2**30, "v5e": 16 * 2**30, "v6": 32 * 2**30, "v4": 32 * 2**30}


def check_tensor(cfg, t: int, per: int) -> None:
    """ConfigError in one line when `mesh.tensor`=t cannot split this model on `per` devices of a replica
    (t must divide them, the heads, the MLP width and the embedding rows, padded to VOCAB_PAD), naming the
    value and the nearest size that can."""
    from diloco.model.scales import VOCAB_PAD, padded_vocab

    s = SCALES[cfg.scale]
    limits = {"devices of one replica": per, "heads": s.heads, "mlp dim": s.mlp_dim}
    if VOCAB_PAD % t:  # the padded rows divide any t that divides VOCAB_PAD
        from diloco.data import get_vocabulary

        limits["padded vocab rows"] = padded_vocab(get_vocabulary(cfg.vocab).vocab_size)
    if "tensor" in (dict(mesh_rules(cfg)).get("sequence") or ()):  # sequence parallelism (diloco/axes.py)
        limits["positions (mesh.rules sequence=tensor)"] = cfg.seq_len
    bad = next(((k, v) for k, v in limits.items() if v % t), None)
    if bad is None:
        return
    ok = [d for d in range(1, per + 1) if all(v % d == 0 for v in (VOCAB_PAD, *limits.values()))]
    near = min(ok, key=lambda d: (abs(d - t), d))
    raise ConfigError("mesh.tensor", f"{t} does not divide the {bad[1]} {bad[0]} ({cfg.scale}: heads {s.heads}, "
                      f"mlp dim {s.mlp_dim}, {per} devices per replica); use mesh.tensor={near}")


def head_dim(cfg) -> int:
    s = SCALES[cfg.scale]
    return s.d_model // s.heads


def attention(cfg, platform: str) -> tuple[str, str]:
    """(`model.attention` resolved, why). auto: the Pallas splash kernel on TPU when the sequence is whole
    128-token tiles; on GPU cuDNN's fused kernel when dtype and head size allow, else XLA's einsum +
    softmax; XLA's on CPU (the fused jax call costs ~15% more CPU time at toy scale, benchmarks/)."""
    want = cfg.model.attention
    if want != "auto":
        return want, "set in the config"
    if platform == "tpu":
        if cfg.seq_len % SPLASH_BLOCK == 0:
            return "splash", f"TPU, seq_len {cfg.seq_len} is whole {SPLASH_BLOCK}-token tiles"
        return "xla", f"TPU, but seq_len {cfg.seq_len} is not a multiple of splash's {SPLASH_BLOCK}-token tile"
    if platform == "gpu":
        K, dt = head_dim(cfg), cfg.model.dtype
        if dt not in CUDNN_DTYPES:
            return "xla", f"GPU, but cuDNN's fused attention needs {' or '.join(CUDNN_DTYPES)} (model.dtype={dt})"
        if K % 8 or K > CUDNN_MAX_HEAD_DIM:
            return "xla", f"GPU, but cuDNN's fused attention needs a head dim ≤ {CUDNN_MAX_HEAD_DIM}, a multiple of 8 (got {K})"
        return "cudnn", f"GPU, {dt}, head dim {K}: cuDNN's fused kernel"
    return "xla", f"{platform}: einsum + softmax"


def remat(cfg, platform: str, shape: tuple | None = None, limit: int | None = None) -> tuple[str, str]:
    """(`model.remat_policy` resolved, why): nothing at the toy scales (memory is not the limit there); at the
    paper's scales on a GPU whose memory is known (`limit` bytes per device, the mesh `shape`) the least recompute
    whose estimated peak fits (devmem.choose_remat: none, save_dots, else full), elsewhere (TPU, CPU) every block
    recomputed (activations dominate a chip's memory, docs/distributed.md; what the paper specs always ran)."""
    want = cfg.model.remat_policy
    if want != "auto":
        return want, "set in the config"
    if cfg.model.remat:
        return "full", "model.remat=true"
    if cfg.scale in TOY_SCALES:
        return "none", "a toy scale: memory is not the limit"
    if platform == "gpu" and shape is not None and limit:
        from diloco.devmem import choose_remat

        return choose_remat(cfg, shape, limit, *params_and_rows(cfg))
    return "full", f"{platform}, a paper scale" + (" (the GPU's memory unknown)" if platform == "gpu" else "") + \
        ": recompute every block"


def scan(cfg) -> tuple[bool, str]:
    """(`model.scan` resolved, why): the paper's scales stack their blocks under nn.scan (one compiled
    block: a 4B compile takes a minute, not an hour; FSDP gathers one layer at a time); the toy scales
    keep one module per block (their committed results and hashes)."""
    want = str(cfg.model.scan).lower()
    if want != "auto":
        return want in ("true", "1"), "set in the config"
    if cfg.scale in TOY_SCALES:
        return False, "toy scale: one module per block"
    return True, "paper scale: one compiled block under nn.scan"


def outer_schedule(cfg):
    """The run's outer Schedule (H, P, τ per replica: diloco/outer/schedule.py); None for DP."""
    if cfg.method == "dp":
        return None
    from diloco.outer.methods import num_fragments
    from diloco.outer.schedule import make_schedule

    P = num_fragments(SCALES[cfg.scale].layers, cfg.layers_per_fragment, cfg.fragments, cfg.embed_fragment)
    return make_schedule(cfg.H, P, cfg.tau, cfg.replicas, cfg.replica_tau)


def exchange(cfg, platform: str, mesh=None, comm_devices=None, schedule=None) -> tuple[str, str]:
    """(where each send's exchange runs, why): `none` for DP; a comm device per process when one is
    given and the mesh can use it (diloco/outer/overlap.py); else `in_step` (inside the next inner
    step's program) when asked, or by `auto` on TPU/GPU, and τ ≥ 1 or eager (whose average is read D rounds
    later); else `blocking` (its own program)."""
    from diloco.outer.overlap import overlap_unsupported

    if cfg.method == "dp":
        return "none", "data-parallel: gradients are reduced inside every step"
    why_not = ""
    if comm_devices:
        why_not = overlap_unsupported(mesh, comm_devices) if mesh is not None else "no mesh"
        if not why_not:
            return "comm_device", "a comm device per process (diloco launch --comm_device)"
        why_not = f"the comm devices cannot serve this mesh: {why_not}; "
    tau_min = (schedule or outer_schedule(cfg)).tau_min
    from diloco.outer.rules import make_rule

    later = make_rule(cfg).round_in_send  # eager: a round's average is applied D rounds later, whatever τ
    asked = cfg.exchange == "in_step" or (cfg.exchange == "auto" and platform in ("tpu", "gpu"))
    if asked and (tau_min >= 1 or later):
        return "in_step", why_not + ("set in the config" if cfg.exchange == "in_step"
                                     else f"{platform}, eager: the exchange rides on the next step" if later
                                     else f"{platform}, τ ≥ 1: the exchange rides on the next step")
    if asked:
        return "blocking", why_not + "τ = 0: the average is applied right after the send"
    return "blocking", why_not + ("set in the config" if cfg.exchange == "blocking" else f"{platform}: its own program")


def matmul_precision(cfg, platform: str) -> tuple[str, str]:
    """The precision of float32 matmuls: `auto` keeps JAX's (JAX_DEFAULT_MATMUL_PRECISION, else its default: TF32
    on an NVIDIA GPU, full float32 on CPU); `highest` makes a GPU run's losses match CPU's (docs/gpu.md)."""
    want = cfg.model.get("matmul_precision", "auto")
    if want != "auto":
        return want, "set in the config"
    import jax

    now = jax.config.jax_default_matmul_precision
    if now:
        return str(now), "JAX_DEFAULT_MATMUL_PRECISION"
    return "default", {"gpu": "GPU: float32 matmuls in TF32 (model.matmul_precision=highest for CPU parity)",
                       "cpu": "CPU: float32 matmuls in full precision"}.get(platform, f"{platform}: JAX's default")


def apply_matmul_precision(cfg, plan: Plan) -> None:
    """Set JAX's matmul precision to the plan's when the config names one (`auto` leaves JAX's setting alone)."""
    if cfg.model.get("matmul_precision", "auto") != "auto":
        import jax

        jax.config.update("jax_default_matmul_precision",
                          None if plan.matmul_precision == "default" else plan.matmul_precision)


def resolve(cfg, devices, comm_devices=None) -> Plan:
    """The plan of a run of `cfg` on `devices` (the mesh's compute devices), with `comm_devices` (one
    per process, or None)."""
    from jax.sharding import Mesh

    from diloco.distributed import device_grid

    devices = list(devices)
    platform = devices[0].platform
    shape = mesh_shape(cfg, len(devices), platform, device_hbm(devices[0]))
    mesh = Mesh(device_grid(devices, shape), ("replica", "data", "fsdp", "tensor")) if comm_devices else None
    att, att_why = attention(cfg, platform)
    from diloco.devmem import device_limit

    limit = device_limit(devices[0]) or 0
    rem, rem_why = remat(cfg, platform, shape, limit)
    sc, sc_why = scan(cfg)
    mp, mp_why = matmul_precision(cfg, platform)
    sched = outer_schedule(cfg)
    ex, ex_why = exchange(cfg, platform, mesh, comm_devices, sched)
    mesh_why = ("mesh.* set" if int(cfg.mesh.get("fsdp", 1)) != 0 else
                "fsdp auto: " + ("every device on data (toy scale)" if cfg.scale in TOY_SCALES
                                 else "FSDP over every device of a replica"))
    tensor_why = {} if int(cfg.mesh.get("tensor", 1)) else {  # auto: how it was chosen
        "tensor": tensor_size(cfg, len(devices) // shape[0], platform, device_hbm(devices[0]),
                              replicas_here(cfg, shape[0]))[1]}
    gpu_flags = tuple(f for f in os.environ.get("XLA_FLAGS", "").split() if f.startswith("--xla_gpu_"))
    return Plan(platform=platform, devices=len(devices), mesh=tuple(int(x) for x in shape),
                attention=att, remat=rem, scan=sc, exchange=ex, matmul_precision=mp,
                why={"mesh": mesh_why, "attention": att_why, "remat": rem_why, "scan": sc_why, "exchange": ex_why,
                     "matmul_precision": mp_why, **tensor_why},
                schedule=sched, xla_flags=gpu_flags if platform == "gpu" else (), device_limit=limit)


# The config fields the plan resolves: `diloco sweep` compares the plans, not these fields' text.
PLANNED_FIELDS = ("model.attention", "model.remat_policy", "model.remat", "model.scan", "exchange",
                  "mesh.replica_axis", "mesh.data", "mesh.fsdp", "mesh.tensor")


def choices(cfg, platform: str, n_devices: int, limit: int = 0) -> dict[str, Any]:
    """The plan's choices (what `Plan.to_json` records) a config resolves to on `n_devices` of
    `platform` (`limit`: a GPU's bytes per program, as recorded), without devices at hand (no comm devices: the
    exchange as without them)."""
    shape = mesh_shape(cfg, n_devices, platform)
    return {"mesh": mesh_dict(shape),
            "attention": attention(cfg, platform)[0], "remat": remat(cfg, platform, shape, limit)[0],
            "scan": scan(cfg)[0],
            "exchange": exchange(cfg, platform)[0]}


def stale_choices(recorded: dict, cfg) -> list[str]:
    """The choices of a run's recorded plan (summary.json "resolved") that `cfg` resolves differently
    now, on the platform and device count the run had: ["resolved.attention", …]; [] when they agree or
    the record cannot be compared. A recorded comm-device exchange is not compared (it depends on the
    launch, not the config)."""
    try:
        now = choices(cfg, recorded["platform"], int(recorded["devices"]),
                      int(recorded.get("device_limit_bytes", 0)))
    except Exception:  # an older or foreign record, or a config this device count refuses
        return []
    return sorted(f"resolved.{k}" for k, v in now.items()
                  if k in recorded and recorded[k] != v and not (k == "exchange" and recorded[k] == "comm_device"))


def stale_against_record(stale: list[str], summary_path, load_cfg) -> list[str]:
    """`diloco sweep`'s stale fields of a finished run, with its recorded plan (summary.json "resolved")
    in place of the config fields the plan resolves: `stale` less PLANNED_FIELDS, plus the plan's
    choices `load_cfg()` now resolves differently. Without a recorded plan, `stale` as it is."""
    import json
    from pathlib import Path

    try:
        plan = json.loads(Path(summary_path).read_text()).get("resolved")
    except (OSError, ValueError, AttributeError):
        plan = None
    if not plan:
        return stale
    return sorted([k for k in stale if k not in PLANNED_FIELDS] + stale_choices(plan, load_cfg()))
