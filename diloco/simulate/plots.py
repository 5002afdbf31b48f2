"""The paper's simulator figures: CU vs bandwidth (Fig. 4), CU vs τ (Fig. 9), Gantt (Fig. 3)."""
from __future__ import annotations

import dataclasses
from pathlib import Path

import numpy as np

from diloco.outer import methods
from diloco.simulate.dag import Assumptions, Method, Model, compute_utilisation, simulate
from diloco.simulate.presets import MODELS, PAPER, make_method

COLORS = {"fwd": "#4c72b0", "bwd_act": "#8fd18f", "bwd_param": "#2a7a2a", "reduce": "#8e44ad"}


def _plt():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def cu_curve(model: Model, method: Method, bandwidths: np.ndarray, a: Assumptions = PAPER) -> np.ndarray:
    """CU at each bandwidth (Gbit/s)."""
    return np.array([compute_utilisation(model, method, float(b), a) for b in bandwidths])


def plot_cu_vs_bandwidth(path: str | Path, models=("1B", "10B", "100B"), h: int = 100, a: Assumptions = PAPER) -> Path:
    """Fig. 4: one panel per model, one curve per method."""
    plt = _plt()
    bws = np.logspace(-1, 3, 50)
    fig, axes = plt.subplots(1, len(models), figsize=(5 * len(models), 3.8), sharey=True)
    for ax, name in zip(np.atleast_1d(axes), models):
        m = MODELS[name]
        for kind in methods.PAPER_VARIANTS:
            ax.plot(bws, cu_curve(m, make_method(kind, m.layers, h=h), bws, a), label=methods.VARIANTS[kind].title)
        ax.set(xscale="log", xlabel="WAN bandwidth (Gbit/s)", title=f"{name} ({m.layers} layers, {m.step_time_s} s/step)")
        ax.grid(True, which="both", alpha=0.3)
    np.atleast_1d(axes)[0].set_ylabel("compute utilisation")
    np.atleast_1d(axes)[0].legend(fontsize=7, loc="lower right")
    fig.tight_layout()
    return _save(fig, path)


def plot_cu_vs_tau(
    path: str | Path, model: str = "100B", fp4_bandwidths=(0.5, 0.8, 1.0), bf16_bandwidths=(2.0, 3.0, 4.0),
    taus=range(0, 11), h: int = 100, a: Assumptions = PAPER,
) -> Path:
    """Fig. 9: CU of Streaming DiLoCo (FP4 and bf16) as the overlap τ grows."""
    plt = _plt()
    m = MODELS[model]
    fig, ax = plt.subplots(figsize=(5.5, 3.8))
    for kind, style, bandwidths in (("streaming_ovl_fp4", "-", fp4_bandwidths), ("streaming_ovl", "--", bf16_bandwidths)):
        for bw in bandwidths:
            cus = [compute_utilisation(m, make_method(kind, m.layers, h=h, tau=t), bw, a) for t in taus]
            ax.plot(list(taus), cus, style, marker="o", ms=3, label=f"{'FP4' if 'fp4' in kind else 'bf16'}, {bw:g} Gbit/s")
    ax.set(xlabel="overlap τ (inner steps)", ylabel="compute utilisation", title=f"{model}, H={h}")
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize=7, ncol=2)
    fig.tight_layout()
    return _save(fig, path)


def plot_gantt(
    path: str | Path, runs: list[tuple[str, Model, Method, float]], a: Assumptions = PAPER, steps: int = 4, first: int = 1
) -> Path:
    """Fig. 3: one row pair (compute, link) per (title, model, method, Gbit/s), steps first…first+steps−1."""
    plt = _plt()
    fig, axes = plt.subplots(len(runs), 1, figsize=(10, 1.5 * len(runs)), squeeze=False)
    for ax, (title, model, method, bw) in zip(axes[:, 0], runs):
        last = first + steps - 1
        res = simulate(model, method, bw, a, periods=max(1, -(-last // method.h)), warmup_periods=0, trace=True)
        nodes = [n for n in res.nodes if first <= n.step <= last]
        t0 = min(n.start for n in nodes if n.resource == "compute")
        nodes = [dataclasses.replace(n, start=n.start - t0, end=n.end - t0) for n in nodes]
        for n in nodes:
            y = 1 if n.resource == "compute" else 0
            ax.barh(y, n.end - n.start, left=n.start, color=COLORS[n.kind], edgecolor="white",
                    linewidth=0.5 if len(nodes) < 80 else 0)
            if n.end - n.start > 0.04 * model.step_time_s * steps / 2:
                ax.text((n.start + n.end) / 2, y, str(n.layer), ha="center", va="center", fontsize=6, color="white")
        ax.set(yticks=[0, 1], yticklabels=["link", "compute"], title=title)
        ax.title.set_fontsize(9)
    axes[-1, 0].set_xlabel(f"time (s) from the start of step {first}")
    handles = [plt.Rectangle((0, 0), 1, 1, color=c) for c in COLORS.values()]
    fig.legend(handles, list(COLORS), loc="upper right", fontsize=7, ncol=4)
    fig.tight_layout(rect=(0, 0, 1, 0.96))
    return _save(fig, path)


def toy_gantt_runs() -> list[tuple[str, Model, Method, float]]:
    """Fig. 3's toy settings: 2 layers, 1 s steps, a link that needs 0.6 s per layer."""
    m = Model("toy", layers=2, params=2 * 0.6e9 / 16, step_time_s=1.0)
    return [
        ("Data-Parallel", m, Method("dp"), 1.0),
        ("DiLoCo, H=2", m, Method("diloco", h=2), 1.0),
        ("Streaming DiLoCo, 2 fragments of 1 layer, H=2", m, Method("streaming", h=2, fragments=2), 1.0),
        ("Streaming DiLoCo + overlap τ=1", m, Method("streaming_ovl", h=2, fragments=2, tau=1), 1.0),
    ]


def _save(fig, path: str | Path) -> Path:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
    _plt().close(fig)
    return path
