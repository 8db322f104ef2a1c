"""The Gluon forward kernel (BACKEND="gluon", sm_90) against the tl kernel and its peers.

Forward only, bf16, B=1, 16 heads, 16k tokens by default, head dims 64 and 128, full and
causal attention. Peers in the same run: flexgen's Triton-language kernel (BACKEND="tl"),
torch's compiled ``flex_attention`` and SDPA's cuDNN backend (and its flash backend with
``--peers ...,flash``: the SDPA backend that takes head dim 256 everywhere). Each time is the median of
``triton.testing.do_bench``; TFLOP/s count 4·L²·D per head (half of it under the causal mask).
Before timing, the Gluon output is compared with the tl kernel's (max abs difference).

    python benchmarks/bench_gluon.py [--lengths 16384] [--dims 64,128] [--json PATH]
    python benchmarks/bench_gluon.py --sweep 128/2,128/3,64/3   # Gluon tiles only (BLOCK_N/stages)
    python benchmarks/bench_gluon.py --smoke     # CPU: says what it would run, times nothing
"""
from __future__ import annotations

import argparse
import json
import sys
import time

import torch

import flexgen


def tflops(L, H, D, causal, ms):
    flops = 4 * H * L * L * D * (0.5 if causal else 1.0)
    return flops / (ms * 1e-3) / 1e12


def causal(b, h, q, k):
    return q >= k


def run_case(L, H, D, is_causal, rows, peers=("tl", "torch_flex", "cudnn")):
    import triton
    from torch.nn.attention import SDPBackend, sdpa_kernel
    from torch.nn.attention import flex_attention as torch_flex

    dev = "cuda"
    q, k, v = (torch.randn(1, H, L, D, device=dev, dtype=torch.bfloat16) for _ in range(3))
    bm = flexgen.create_block_mask(causal, None, None, L, L, device=dev) if is_causal else None
    tbm = torch_flex.create_block_mask(causal, None, None, L, L, device=dev) if is_causal else None

    def fg(backend):
        return lambda: flexgen.flex_attention(q, k, v, block_mask=bm, kernel_options={"BACKEND": backend})

    compiled = torch.compile(torch_flex.flex_attention)

    def sdpa(backend):
        def call():
            with sdpa_kernel(backend):
                return torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=is_causal)
        return call
    calls = {"gluon": fg("gluon"), "tl": fg("tl"), "torch_flex": lambda: compiled(q, k, v, block_mask=tbm),
             "cudnn": sdpa(SDPBackend.CUDNN_ATTENTION), "flash": sdpa(SDPBackend.FLASH_ATTENTION)}
    calls = {n: f for n, f in calls.items() if n in ("gluon", "tl") or n in peers}
    calls["gluon"]()                 # the second call takes the direct launch path: check that one
    diff = (calls["gluon"]().float() - calls["tl"]().float()).abs().max().item()
    row = {"L": L, "H": H, "D": D, "variant": "causal" if is_causal else "full",
           "gluon_vs_tl_max_abs": diff}
    for name, fn in calls.items():
        try:
            ms = triton.testing.do_bench(fn, warmup=25, rep=150, return_mode="median")
            row[name] = {"ms": ms, "tflops": tflops(L, H, D, is_causal, ms)}
        except Exception as e:          # a peer that cannot run here: say so, keep the others
            row[name] = {"error": f"{type(e).__name__}: {str(e)[:200]}"}
    rows.append(row)
    return row


def sweep_case(L, H, D, is_causal, configs):
    """TFLOP/s of the Gluon kernel for each (BLOCK_N, num_stages) in ``configs``."""
    import triton
    q, k, v = (torch.randn(1, H, L, D, device="cuda", dtype=torch.bfloat16) for _ in range(3))
    bm = flexgen.create_block_mask(causal, None, None, L, L, device="cuda") if is_causal else None
    found = {}
    for block_n, stages in configs:
        options = {"BACKEND": "gluon", "BLOCK_N": block_n, "num_stages": stages}
        try:
            ms = triton.testing.do_bench(lambda: flexgen.flex_attention(
                q, k, v, block_mask=bm, kernel_options=options), warmup=25, rep=150,
                return_mode="median")
            found[f"BN{block_n}/S{stages}"] = round(tflops(L, H, D, is_causal, ms), 1)
        except Exception as e:
            found[f"BN{block_n}/S{stages}"] = f"{type(e).__name__}: {str(e)[:120]}"
    return found


def show(row) -> str:
    def cell(name):
        r = row.get(name, {})
        return f"{r['tflops']:6.0f}" if "tflops" in r else "   err"
    g = row["gluon"].get("ms")
    peers = [n for n in ("tl", "torch_flex", "cudnn", "flash") if n in row]
    ratios = " ".join(f"{n}/gluon {row[n]['ms'] / g:4.2f}" for n in peers if g and "ms" in row[n])
    return (f"D={row['D']:3d} {row['variant']:6s} L={row['L']}: TFLOP/s gluon {cell('gluon')} "
            + " ".join(f"{n} {cell(n)}" for n in peers) + f" | {ratios} "
            f"| max|gluon-tl| {row['gluon_vs_tl_max_abs']:.1e}")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--lengths", default="16384")
    ap.add_argument("--heads", type=int, default=16)
    ap.add_argument("--dims", default="128,64")
    ap.add_argument("--variants", default="full,causal")
    ap.add_argument("--peers", default="tl,torch_flex,cudnn")
    ap.add_argument("--json", default=None)
    ap.add_argument("--smoke", action="store_true")
    ap.add_argument("--sweep", default=None,
                    help="time only the Gluon kernel at these BLOCK_N/num_stages, e.g. 128/2,64/3")
    ap.add_argument("--budget", type=float, default=None, help="stop starting cases after this many s")
    args = ap.parse_args(argv)
    cases = [(int(L), args.heads, int(D), v == "causal") for L in args.lengths.split(",")
             for D in args.dims.split(",") for v in args.variants.split(",")]
    on_hopper = torch.cuda.is_available() and torch.cuda.get_device_capability() == (9, 0)
    if args.smoke or not on_hopper:
        print(f"bench_gluon: {'smoke' if args.smoke else 'no sm_90 GPU'}: would time {len(cases)} cases")
        return 0
    start, rows = time.time(), []
    if args.sweep:
        configs = [tuple(map(int, c.split("/"))) for c in args.sweep.split(",")]
        for case in cases:
            print(f"sweep D={case[2]} {'causal' if case[3] else 'full'} L={case[0]}:",
                  sweep_case(*case, configs), flush=True)
        return 0
    for case in cases:
        if args.budget and time.time() - start > args.budget:
            print("bench_gluon: budget spent, stopping", flush=True)
            break
        print(show(run_case(*case, rows, peers=args.peers.split(","))), flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"device": torch.cuda.get_device_name(), "torch": torch.__version__,
                       "triton": __import__("triton").__version__, "rows": rows}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
