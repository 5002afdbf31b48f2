"""`diloco fragments --config SPEC`: which parameter goes to which fragment, with sizes and bytes, and
which fragments share one compiled program (`Fragments.groups`)."""
from __future__ import annotations

import argparse

from diloco.config import load_config
from diloco.model.scales import SCALES
from diloco.outer.codecs import codec_from_config, encoded_nbytes
from diloco.outer.fragments import make_fragments
from diloco.trainer import abstract_params


def main(argv: list[str]) -> int:
    """`diloco fragments --config experiments/toy.py:streaming [--config.key=value …]`."""
    ap = argparse.ArgumentParser(prog="diloco fragments", description="Which parameter goes to which fragment.")
    ap.add_argument("--config", required=True, help="experiments/<file>.py[:arg]")
    ap.add_argument("--codec", default=None, help="bytes column for this codec (default: the config's)")
    args, overrides = ap.parse_known_args(argv)
    cfg = load_config(args.config, overrides)
    if cfg.method == "dp":
        print("method=dp has no fragments (gradients are averaged every step); use :diloco or :streaming")
        return 2
    params = abstract_params(cfg)
    frags = make_fragments(params, SCALES[cfg.scale].layers, cfg.layers_per_fragment, cfg.fragments,
                           cfg.pattern, cfg.embed_fragment)
    codec = codec_from_config(cfg, args.codec)
    total = sum(frags.sizes)
    print(f"{frags.P} fragments, pattern={cfg.pattern}, embed_fragment={cfg.embed_fragment}, codec={codec.name}")
    for p in range(frags.P):
        nb = encoded_nbytes(codec, frags.sizes[p])
        print(f"fragment {p}: {frags.sizes[p]:,} params ({100 * frags.sizes[p] / total:.1f}%), "
              f"{nb:,} bytes per replica per sync ({codec.name}), fp32 {4 * frags.sizes[p]:,}")
        for n in frags.names[p]:
            print(f"    {n}")
    groups = frags.groups()
    print(f"compiled programs: one per fragment layout, {len(groups)} for {frags.P} fragments"
          + ("" if any(rows is not None for part in frags.parts for _, rows in part) else
             " (blocks are separate leaves: model.scan=false, so no two fragments share a program)"))
    for g in groups:
        print(f"    fragments {', '.join(map(str, g))}" if len(g) > 1 else f"    fragment {g[0]}")
    return 0
