"""One backward kernel under Nsight Compute, and a summary of its SASS page: flexgen's or cuDNN's.

    # on the GPU machine (ncu reads counters on its Firecracker machines; leave the clocks alone):
    ncu --clock-control none --kernel-name regex:backward_gluon --launch-skip 3 --launch-count 1 \\
        --set full --import-source no -o $OUT/fused python3 benchmarks/profile_backward.py run flexgen
    ncu --clock-control none --launch-skip 12 --launch-count 4 --set full -o $OUT/cudnn \\
        python3 benchmarks/profile_backward.py run cudnn
    ncu --import $OUT/fused.ncu-rep --page source --csv --print-source sass > $OUT/fused_sass.csv
    # anywhere:
    python3 benchmarks/profile_backward.py sass $OUT/fused_sass.csv [--kernel bprop] [--loop 1000000]

``run WHO [--dim D] [--length L] [--heads H] [--kv-heads HKV] [--variant causal|full]``: bf16 inputs,
one forward, 3 backwards to warm up (ncu's --launch-skip passes them), then 10 timed ones (CUDA
events; the mean is printed: with ncu attached it is the profiler's time, not the kernel's).
B = 16k tokens / L where the heads are equal, else 1. WHO: flexgen (AUTO's kernels) or cudnn
(SDPA's cuDNN backend).

``sass CSV``: from ncu's source page (SASS, CSV): the stall reasons of the whole kernel, the
executed instructions by opcode, and the stall samples of the instructions executed at least
``--loop`` times (the hot loop), by opcode; the page's first kernel whose name holds
``--kernel``. benchmarks/NOTES.md (2026-11-28, fourth session) reads one.
"""
from __future__ import annotations

import argparse
import collections
import csv
import os
import sys

os.environ.pop("FLEXGEN_POISON", None)      # timings must not include NaN fills


def run(args) -> int:
    import torch
    import torch.nn.functional as F
    from torch.nn.attention import SDPBackend, sdpa_kernel

    import flexgen
    from flexgen import mods

    dev = torch.device("cuda")
    D, L, H, HKV = args.dim, args.length, args.heads, args.kv_heads
    B = max(1, 16384 // L) if H == HKV else 1
    gen = torch.Generator(device=dev).manual_seed(0)
    q = torch.randn(B, H, L, D, device=dev, dtype=torch.bfloat16, generator=gen).requires_grad_()
    k, v = (torch.randn(B, HKV, L, D, device=dev, dtype=torch.bfloat16, generator=gen).requires_grad_()
            for _ in range(2))
    dout = torch.randn_like(q)
    causal = args.variant == "causal"
    if args.who == "flexgen":
        bm = flexgen.create_block_mask(mods.causal_mask, None, None, L, L, device=dev) if causal else None
        out = flexgen.flex_attention(q, k, v, block_mask=bm, enable_gqa=H != HKV)
    else:
        with sdpa_kernel([SDPBackend.CUDNN_ATTENTION]):
            out = F.scaled_dot_product_attention(q, k, v, is_causal=causal, enable_gqa=H != HKV)
    for _ in range(3):
        torch.autograd.grad(out, (q, k, v), dout, retain_graph=True)
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(10):
        torch.autograd.grad(out, (q, k, v), dout, retain_graph=True)
    end.record()
    torch.cuda.synchronize()
    print(f"{args.who} D={D} L={L} H={H}/{HKV} {args.variant}: backward {start.elapsed_time(end) / 10:.3f} ms")
    return 0


def _kernel_rows(path, name_part):
    """(header, rows) of the first kernel on ncu's CSV source page whose name holds name_part."""
    header, rows, take = None, [], False
    for row in csv.reader(open(path)):
        if row and row[0] == "Kernel Name":
            if take:
                break
            take, header = name_part in row[1], None
        elif take and header is None:
            header = row
        elif take and len(row) >= len(header):
            rows.append(row)
    if header is None:
        raise SystemExit(f"no kernel named like {name_part!r} in {path}")
    return header, rows


def _opcode(source: str) -> str:
    words = source.split()
    word = words[1] if words and words[0].startswith("@") else (words[0] if words else "?")
    return word.split(".")[0]


def sass(args) -> int:
    header, rows = _kernel_rows(args.csv, args.kernel)
    col = {name: i for i, name in enumerate(header)}
    stalls = [h for h in header if h.startswith("stall_") and "Not Issued" not in h]
    samples = "Warp Stall Sampling (All Samples)"
    by_reason, executed, in_loop = collections.Counter(), collections.Counter(), collections.Counter()
    for row in rows:
        for reason in stalls:
            by_reason[reason] += int(row[col[reason]] or 0)
        count = int(row[col["Instructions Executed"]] or 0)
        executed[_opcode(row[col["Source"]])] += count
        if count >= args.loop:
            in_loop[_opcode(row[col["Source"]])] += int(row[col[samples]] or 0)
    for title, counter, top in (("stall reasons, whole kernel (% of samples)", by_reason, 12),
                                ("executed instructions by opcode (%)", executed, 25),
                                (f"samples in the loop (instructions executed >= {args.loop}) by opcode (%)",
                                 in_loop, 20)):
        total = sum(counter.values()) or 1
        print(f"{title}; total {total:,}")
        for key, value in counter.most_common(top):
            print(f"  {key:26s} {value:14,d} {100 * value / total:5.1f}")
    return 0


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = ap.add_subparsers(dest="command", required=True)
    r = sub.add_parser("run")
    r.add_argument("who", choices=["flexgen", "cudnn"])
    r.add_argument("--dim", type=int, default=128)
    r.add_argument("--length", type=int, default=16384)
    r.add_argument("--heads", type=int, default=16)
    r.add_argument("--kv-heads", type=int, default=16)
    r.add_argument("--variant", choices=["causal", "full"], default="causal")
    s = sub.add_parser("sass")
    s.add_argument("csv")
    s.add_argument("--kernel", default="", help="a part of the kernel's name (default: the first)")
    s.add_argument("--loop", type=int, default=1_000_000)
    args = ap.parse_args(argv)
    return run(args) if args.command == "run" else sass(args)


if __name__ == "__main__":
    sys.exit(main())
