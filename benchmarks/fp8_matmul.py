"""The FP8 reference engine's linears on one GPU: every FP8 weight of a model's engine rank (its
shapes, as many of each as the model has), multiplied by ``M`` tokens three ways, side by side:
bf16 weights (``F.linear``), FP8 weights dequantized first (what the engine did before, and still
does where the GEMM does not apply) and torch's blockwise FP8 GEMM (``models.fp8_gemm.scaled_linear``,
the activations quantized per token group included).  Sums over the model's linears: one forward
pass's GEMM time; the error of each FP8 way against the bf16 product is printed beside it.

    python benchmarks/fp8_matmul.py --model Qwen3-4B --tokens 1,64,2048 --out fp8_matmul.json
"""

from __future__ import annotations

import argparse
import collections
import json
from typing import Any

import torch
import torch.nn.functional as F
from gpu_update import cuda_ms

from shardsync.layout import EngineParallel, engine_layout
from shardsync.models.fp8_gemm import gemm_scales, quantize_activations, scaled, scaled_linear
from shardsync.presets import load_spec
from shardsync.quant import dequantize, fp8_format, quantize, quantized


def shapes(model: str, tp: int, fmt_name: str) -> collections.Counter[tuple[int, int]]:
    """(N, K) of every FP8 matrix of engine rank 0 (an expert stack counts each expert)."""
    spec = load_spec(model, dtype="bfloat16")
    rank = engine_layout(spec, EngineParallel(tp=tp, dtype="bfloat16")).ranks[0]
    out: collections.Counter[tuple[int, int]] = collections.Counter()
    for target in quantized(rank, spec, fp8_format(fmt_name)).values():
        n, k = target.shape[-2:]
        out[(n, k)] += target.shape[0] if len(target.shape) == 3 else 1
    return out


def measure(n: int, k: int, m: int, fmt_name: str) -> dict[str, Any]:
    fmt = fp8_format(fmt_name)
    g = torch.Generator(device="cuda").manual_seed(n * k + m)
    w = (torch.randn(n, k, device="cuda", generator=g) * 0.02).to(torch.bfloat16)
    x = torch.randn(m, k, device="cuda", generator=g).to(torch.bfloat16)
    q, s = quantize(w, fmt)
    row: dict[str, Any] = {"n": n, "k": k, "m": m, "gemm": scaled(fmt, (n, k), q.device)}
    ref = F.linear(x, w).float()
    row["bf16_ms"] = cuda_ms(lambda: F.linear(x, w))
    row["dequantize_ms"] = cuda_ms(lambda: F.linear(x, dequantize(q, s, fmt, torch.bfloat16)))
    row["dequantize_err"] = float((F.linear(x, dequantize(q, s, fmt, torch.bfloat16)).float() - ref).abs().mean())
    if row["gemm"]:
        row["gemm_ms"] = cuda_ms(lambda: scaled_linear(x, q, s))
        row["gemm_err"] = float((scaled_linear(x, q, s).float() - ref).abs().mean())
        # where its time goes: the activations' quantization alone, torch's GEMM alone
        row["activations_ms"] = cuda_ms(lambda: quantize_activations(x))
        xq, xs = quantize_activations(x)
        sb = gemm_scales(s).t()
        row["scaled_mm_ms"] = cuda_ms(lambda: F.scaled_mm(xq, q.t(), xs, F.ScalingType.BlockWise1x128, sb,
                                                          F.ScalingType.BlockWise128x128, output_dtype=x.dtype))
    row["ref_mean_abs"] = float(ref.abs().mean())
    return row


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="Qwen3-4B")
    ap.add_argument("--engine-tp", type=int, default=1)
    ap.add_argument("--tokens", default="1,64,2048", help="M values (tokens in one forward), comma separated")
    ap.add_argument("--format", default="fp8")
    ap.add_argument("--out", default="fp8_matmul.json")
    args = ap.parse_args()
    counts = shapes(args.model, args.engine_tp, args.format)
    rows = [measure(n, k, int(m), args.format) for m in args.tokens.split(",") for (n, k) in counts]
    total: dict[int, dict[str, float]] = {}
    for r in rows:
        t = total.setdefault(r["m"], collections.defaultdict(float))
        c = counts[(r["n"], r["k"])]
        for key in ("bf16_ms", "dequantize_ms"):
            t[key] += c * r[key]
        t["gemm_ms"] += c * r.get("gemm_ms", r["dequantize_ms"])  # the engine dequantizes the others
        t["activations_ms"] += c * r.get("activations_ms", 0.0)
        t["scaled_mm_ms"] += c * r.get("scaled_mm_ms", 0.0)
    print(f"{args.model} engine TP {args.engine_tp}, {sum(counts.values())} FP8 matrices in {len(counts)} shapes, "
          f"{torch.cuda.get_device_name()}")
    print("| tokens | bf16 ms | FP8 dequantized ms | FP8 GEMM ms | activations / scaled_mm alone | GEMM x bf16 |")
    print("|---|---|---|---|---|---|")
    for m, t in total.items():
        print(f"| {m} | {t['bf16_ms']:.2f} | {t['dequantize_ms']:.2f} | {t['gemm_ms']:.2f} | "
              f"{t['activations_ms']:.2f} / {t['scaled_mm_ms']:.2f} | {t['gemm_ms'] / t['bf16_ms']:.2f} |")
    for r in rows:
        if r["m"] == max(total):
            gemm_err = r.get("gemm_err", float("nan"))
            print(f"  {r['n']}x{r['k']} (x{counts[(r['n'], r['k'])]}): mean |err| vs bf16 dequantized "
                  f"{r['dequantize_err']:.2e}, GEMM {gemm_err:.2e} (|y| {r['ref_mean_abs']:.2e})")
    with open(args.out, "w") as f:
        json.dump({"model": args.model, "engine_tp": args.engine_tp, "format": args.format,
                   "device": torch.cuda.get_device_name(), "torch": torch.__version__,
                   "shapes": {f"{n}x{k}": c for (n, k), c in counts.items()},
                   "totals": {str(m): dict(t) for m, t in total.items()}, "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
