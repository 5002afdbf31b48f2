"""`diloco bytes`: analytic bytes exchanged by Data-Parallel, DiLoCo and Streaming DiLoCo.

Counting convention (what sets the absolute numbers):
  * "bytes per replica" = the payload one replica puts on the wire per sync: N·(DP gradient dtype)
    per step for DP, encoded_nbytes(codec, fragment) per fragment sync for (Streaming) DiLoCo.
    A bandwidth-optimal ring all-reduce moves 2(M-1)/M times that per replica (= 1x at M = 2).
    "summed over replicas" multiplies by M.
  * steps T = tokens // (global_batch · seq_len); the global batch (sequences) is split over replicas,
    so DP and DiLoCo see the same T.
  * DP syncs every step. Fragment p (P fragments, offset t_p = round(p·H/P)) sends at t_p + k·H ≤ T,
    k ≥ 1 (DiLoCo: P = 1), so fragments with a late offset may send one fewer time than T // H.
  * Parameters are spread evenly over the L blocks (embeddings included), fragments are strided
    (block l -> fragment l mod P): a fragment of |p| blocks carries N·|p|/L elements. "Peak" is the
    largest single-fragment payload per replica.
  * TB = 1e12 bytes.
Ratios do not depend on batch size or N; absolute TB scale with N·tokens/(batch·seq_len). The paper's
Table 1 (1B, 25B tokens, seq 2048, H = 100) prints 441 TB for DP and 1.10 TB for Streaming with FP4:
441/1.10 ≈ 400 = H · 16/4 (bf16 gradients vs 4 bits, no scale overhead). Its batch size is not stated;
`--match-tb 441` prints the global batch that would reproduce it under these assumptions (≈70.5
sequences of 2048 for DP with the 1.27B-parameter "1B" model, i.e. ~144k tokens). With
`--codec e3m0` the per-block float32 scales cost 32/block_size extra bits (4.125 bits at 256), so
the ratio is 100·16/4.125 ≈ 388; `--bits 4` gives the paper's idealised 400.
"""
from __future__ import annotations

import argparse
import json
import math
import re

from diloco.errors import ConfigError
from diloco.outer import codecs
from diloco.outer.methods import METHODS, num_fragments
from diloco.outer.schedule import fragment_offset

DTYPE_BYTES = {"fp32": 4, "bf16": 2, "fp16": 2, "fp8": 1}
DEFAULT_CODEC = {"diloco": "none", "streaming": "e3m0"}

ASSUMPTIONS = [
    "bytes per replica = the payload one replica sends per sync (ring all-reduce: x 2(M-1)/M, = 1 at M=2)",
    "summed over replicas = M x per replica",
    "steps = tokens // (global batch x seq_len); global batch in sequences, split over replicas",
    "DP: every step, N x DP gradient dtype; (Streaming) DiLoCo: fragment p sends at t_p + kH <= steps",
    "parameters spread evenly over blocks (embeddings included); strided fragments",
    "absolute TB scale with N x tokens / (batch x seq_len); the paper's batch size is unknown",
    "TB = 1e12 bytes",
]


def parse_count(s: str | int | float) -> int:
    """'25B' -> 25_000_000_000, '700M', '1.5e9', '1,000' -> int."""
    if isinstance(s, (int, float)):
        return int(s)
    m = re.fullmatch(r"\s*([0-9.,eE+-]+)\s*([kKmMbBtT]?)\s*", str(s))
    if not m:
        raise ConfigError("tokens", f"cannot read {s!r} as a count; use e.g. 25B, 700M, 2.5e10")
    mult = {"": 1, "k": 1e3, "m": 1e6, "b": 1e9, "t": 1e12}[m.group(2).lower()]
    return int(round(float(m.group(1).replace(",", "")) * mult))


def fragment_sizes(params: int, layers: int, fragments: int) -> list[int]:
    """Elements per fragment: strided blocks (l -> l mod P), N spread evenly over L blocks."""
    blocks = [len(range(p, layers, fragments)) for p in range(fragments)]
    sizes, cum = [], 0
    for b in blocks:
        sizes.append(params * (cum + b) // layers - params * cum // layers)
        cum += b
    return sizes


def fragment_offsets(H: int, fragments: int) -> list[int]:
    return [fragment_offset(p, H, fragments) for p in range(fragments)]


def sync_counts(steps: int, H: int, fragments: int) -> list[int]:
    """Sends per fragment: t_p + k·H <= steps, k >= 1."""
    return [max(0, (steps - t) // H) for t in fragment_offsets(H, fragments)]


def payload_bytes(n: int, codec: str | None, bits: float | None, block_size: int) -> int:
    if bits is not None:
        return math.ceil(n * bits / 8)
    return codecs.encoded_nbytes(codecs.make_codec(codec, block_size=block_size), n)


def calc(*, params: int, layers: int, tokens: int, batch: int, seq_len: int, method: str,
         H: int = 100, fragments: int | None = None, layers_per_fragment: int = 3,
         replicas: int = 2, codec: str | None = None, bits: float | None = None,
         block_size: int = 256, dp_dtype: str = "bf16") -> dict:
    """Bytes exchanged for one run; see the module docstring for the conventions."""
    if method not in METHODS:
        raise ConfigError("method", f"unknown method {method!r}; valid: {', '.join(METHODS)}")
    if dp_dtype not in DTYPE_BYTES:
        raise ConfigError("dp_dtype", f"unknown dtype {dp_dtype!r}; valid: {', '.join(DTYPE_BYTES)}")
    for field, v in (("params", params), ("layers", layers), ("tokens", tokens), ("batch", batch),
                     ("seq_len", seq_len), ("H", H), ("replicas", replicas),
                     ("layers_per_fragment", layers_per_fragment),
                     *((("fragments", fragments),) if fragments is not None else ())):
        if v < 1:
            raise ConfigError(field, f"{field}={v} must be >= 1")
    steps = tokens // (batch * seq_len)
    if steps < 1:
        raise ConfigError("tokens", f"tokens={tokens} is less than one global batch ({batch}x{seq_len})")
    if bits is not None and bits <= 0:
        raise ConfigError("bits", f"bits={bits} must be > 0")

    dp_step = params * DTYPE_BYTES[dp_dtype]
    dp_total = steps * dp_step
    out = dict(method=method, params=params, layers=layers, tokens=tokens, batch=batch,
               seq_len=seq_len, steps=steps, replicas=replicas, dp_dtype=dp_dtype)
    if method == "dp":
        out.update(H=1, fragments=1, codec=dp_dtype, bits_per_element=8.0 * DTYPE_BYTES[dp_dtype],
                   syncs=steps, bytes_per_sync=[dp_step], peak_bytes_per_sync=dp_step,
                   total_bytes_per_replica=dp_total)
    else:
        P = 1 if method == "diloco" else num_fragments(
            layers, layers_per_fragment if fragments is None else 0, fragments or 0)
        name = codec if codec is not None else DEFAULT_CODEC[method]
        if bits is None and name not in codecs.FORMATS:  # the codec registry
            raise ConfigError("codec", f"unknown codec {name!r}; valid: {', '.join(codecs.FORMATS)}")
        sizes = fragment_sizes(params, layers, P)
        per_sync = [payload_bytes(n, name, bits, block_size) for n in sizes]
        counts = sync_counts(steps, H, P)
        total = sum(c * b for c, b in zip(counts, per_sync))
        out.update(H=H, fragments=P, codec=(f"{bits:g} bits" if bits is not None else name),
                   bits_per_element=8.0 * sum(per_sync) / params, fragment_elements=sizes,
                   syncs=sum(counts), syncs_per_fragment=counts, bytes_per_sync=per_sync,
                   peak_bytes_per_sync=max(per_sync), total_bytes_per_replica=total)
    out["total_bytes_all_replicas"] = replicas * out["total_bytes_per_replica"]
    out["total_tb_per_replica"] = out["total_bytes_per_replica"] / 1e12
    out["dp_total_bytes_per_replica"] = dp_total
    out["ratio_dp_over_this"] = dp_total / out["total_bytes_per_replica"] if out["total_bytes_per_replica"] else math.inf
    out["peak_ratio_dp_over_this"] = dp_step / out["peak_bytes_per_sync"]
    out["assumptions"] = ASSUMPTIONS
    return out


def batch_to_match(result: dict, target_tb: float) -> float:
    """Global batch (sequences) that would make this run's per-replica total equal target_tb.

    Totals scale as 1/batch (steps = tokens/(batch·seq_len)); the answer ignores the integer
    rounding of steps and of the last partial round.
    """
    return result["batch"] * result["total_bytes_per_replica"] / (target_tb * 1e12)


def _resolve_params(scale: str | None, params: str | None, layers: int | None,
                    vocab_size: int) -> tuple[int, int, str]:
    if params is not None:
        if layers is None:
            raise ConfigError("layers", "--params needs --layers (blocks, to size fragments)")
        return parse_count(params), layers, f"--params {params}"
    if scale is None:
        raise ConfigError("scale", "give --scale NAME or --params N --layers L")
    from diloco.model import scales, sizes  # lazy: pulls in jax/flax

    if scale not in scales.SCALES:
        raise ConfigError("scale", f"unknown scale {scale!r}; valid: {', '.join(scales.SCALES)}")
    return sizes.param_count(scale, vocab_size=vocab_size), scales.SCALES[scale].layers, f"scale {scale}"


def _fmt_bytes(b: float) -> str:
    for unit, f in (("TB", 1e12), ("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if b >= f:
            return f"{b / f:,.3f} {unit}"
    return f"{b:,.0f} B"


def _underscore(arg: str) -> str:
    """Accept --layers-per-fragment as well as --layers_per_fragment."""
    if not arg.startswith("--"):
        return arg
    name, eq, value = arg.partition("=")
    return "--" + name[2:].replace("-", "_") + eq + value


def main(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(prog="diloco bytes", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--scale", default=None, help="named model scale (diloco.model.scales); default 1B")
    ap.add_argument("--params", default=None, help="parameter count instead of --scale (e.g. 1.27B)")
    ap.add_argument("--layers", type=int, default=None, help="transformer blocks (with --params)")
    ap.add_argument("--vocab_size", type=int, default=32_000)
    ap.add_argument("--tokens", default="25B", help="training tokens (default 25B, paper Table 1)")
    ap.add_argument("--batch", type=int, default=256, help="global batch in sequences (paper: unknown)")
    ap.add_argument("--seq_len", type=int, default=2048)
    ap.add_argument("--method", choices=METHODS, default="streaming")
    ap.add_argument("--H", type=int, default=100)
    ap.add_argument("--fragments", type=int, default=None, help="P (default: ceil(layers / layers_per_fragment))")
    ap.add_argument("--layers_per_fragment", type=int, default=3)
    ap.add_argument("--replicas", "-M", type=int, default=2)
    ap.add_argument("--codec", default=None, help="outer-gradient codec (default: none for diloco, e3m0 for streaming)")
    ap.add_argument("--bits", type=float, default=None, help="idealised bits/element instead of a codec (e.g. 4)")
    ap.add_argument("--block_size", type=int, default=256, help="codec scale block")
    ap.add_argument("--dp_dtype", choices=tuple(DTYPE_BYTES), default="bf16")
    ap.add_argument("--match_tb", type=float, default=None, help="print the batch that gives this many TB")
    ap.add_argument("--json", action="store_true", help="one JSON object for machines")
    args = ap.parse_args([_underscore(a) for a in argv])
    try:
        scale = args.scale if (args.scale or args.params) else "1B"
        params, layers, source = _resolve_params(scale, args.params, args.layers, args.vocab_size)
        r = calc(params=params, layers=layers, tokens=parse_count(args.tokens), batch=args.batch,
                 seq_len=args.seq_len, method=args.method, H=args.H, fragments=args.fragments,
                 layers_per_fragment=args.layers_per_fragment, replicas=args.replicas,
                 codec=args.codec, bits=args.bits, block_size=args.block_size, dp_dtype=args.dp_dtype)
    except ConfigError as e:
        print(f"diloco bytes: {e}", flush=True)
        return 2
    r["model"] = source
    if args.match_tb is not None:
        r["match_tb"] = args.match_tb
        r["batch_to_match"] = batch_to_match(r, args.match_tb)
    if args.json:
        print(json.dumps(r, indent=1))
        return 0
    print(f"{r['method']}: {source}, N = {params:,} params, {layers} blocks, {r['fragments']} fragment(s), "
          f"H = {r['H']}, M = {r['replicas']}, payload = {r['codec']} ({r['bits_per_element']:.3f} bits/elem)")
    print(f"  steps            {r['steps']:,}  (tokens {r['tokens']:,} / (batch {r['batch']} x seq {r['seq_len']}))")
    print(f"  syncs / replica  {r['syncs']:,}")
    print(f"  peak per sync    {_fmt_bytes(r['peak_bytes_per_sync'])}  (DP / this: {r['peak_ratio_dp_over_this']:,.1f}x)")
    print(f"  total / replica  {_fmt_bytes(r['total_bytes_per_replica'])}")
    print(f"  total, {r['replicas']} replicas {_fmt_bytes(r['total_bytes_all_replicas'])}")
    print(f"  vs data-parallel ({r['dp_dtype']} gradients every step, same run): "
          f"{_fmt_bytes(r['dp_total_bytes_per_replica'])} per replica = {r['ratio_dp_over_this']:,.1f}x this")
    if args.match_tb is not None:
        print(f"  to reach {args.match_tb:g} TB per replica: global batch ≈ {r['batch_to_match']:,.1f} sequences "
              f"of {r['seq_len']} (≈{r['batch_to_match'] * r['seq_len']:,.0f} tokens)")
    print("assumptions (these set the absolute TB; ratios depend only on H, P, bits):")
    for a in ASSUMPTIONS:
        print(f"  - {a}")
    print("  - paper Table 1 (1B, 25B tok): DP 441 TB vs Streaming FP4 1.10 TB = ~400x = H x 16/4 bits")
    return 0


if __name__ == "__main__":
    import sys

    sys.exit(main(sys.argv[1:]))
