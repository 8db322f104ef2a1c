"""flexgen's backward, kernel by kernel: GPU time of the dQ and dK/dV kernels per case.

    python benchmarks/backward_kernels.py                                   # D=128, six variants, 16k
    python benchmarks/backward_kernels.py --cases 128:causal:16384,64:full:16384
    python benchmarks/backward_kernels.py --row backward.dkdv=64,64,4,2 --row backward.dq=128,64,8,3
    python benchmarks/backward_kernels.py --options '{"USE_TMA": false}' --label pointer

For A/B runs of backward kernel changes (benchmarks/NOTES.md): flexgen only, no
peers (bench_backward.py compares with torch and SDPA). Each case (bf16, H=16,
B x L = 16k tokens) runs ``torch.autograd.grad`` on one saved forward, 5 times to
warm up and then 30 times with CUDA events around each kernel launch and around the
whole backward; the medians are printed per kernel (dq, dkdv) and for the whole
call ("all": with the host work and the small ops between the kernels). ``--row KERNEL=BLOCK_M,BLOCK_N,WARPS,STAGES``
replaces that kernel's row of the tile table (``flexgen.runtime.tuning.TUNED``) for
this GPU's name; ``--options`` passes kernel_options to every call; ``--fused`` runs the
fused Gluon backward wherever it can (one "fused" kernel in place of dq and dkdv).
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys

os.environ.pop("FLEXGEN_POISON", None)      # timings must not include NaN fills

import torch  # noqa: E402

import flexgen  # noqa: E402
from flexgen.kernels import backward
from flexgen.runtime import tuning  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_forward import make_mods  # noqa: E402

DEFAULT_CASES = "".join(f"128:{v}:16384," for v in
                        ("full", "causal", "sliding_window", "alibi", "softcap", "document"))[:-1]


def parse_row(text):
    kernel, _, values = text.partition("=")
    m, n, warps, stages = (int(x) for x in values.split(","))
    return kernel, dict(BLOCK_M=m, BLOCK_N=n, num_warps=warps, num_stages=stages)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--cases", default=DEFAULT_CASES, help="comma list of D:variant:L")
    ap.add_argument("--row", action="append", default=[], type=parse_row,
                    help="KERNEL=BLOCK_M,BLOCK_N,WARPS,STAGES (repeatable)")
    ap.add_argument("--label", default="flexgen")
    ap.add_argument("--options", type=json.loads, default=None, help="kernel_options as JSON")
    ap.add_argument("--fused", action="store_true", help="the fused Gluon backward (plan.GLUON_FUSED)")
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        print("backward_kernels.py times GPU kernels: it needs a CUDA device", file=sys.stderr)
        return 2
    device = torch.device("cuda")
    for kernel, row in args.row:
        for head_dim in (64, 128, 256):
            tuning.TUNED[(kernel, tuning.gpu_name(device), "bfloat16", head_dim)] = row

    events: dict = {}
    launch_run = backward.launch.run

    def timed(spec, *a, **kw):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        result = launch_run(spec, *a, **kw)
        end.record()
        events.setdefault(getattr(spec, "part", spec.template), []).append((start, end))
        return result

    # flexgen.runtime.launch.run launches every kernel (the forward's too, timed under "forward"):
    # only the two backward parts are printed. No replays (they skip launch.run, not the GPU work).
    backward.launch.run = timed
    if args.fused:
        from flexgen.runtime import plan
        plan.GLUON_FUSED = True
    backward.remember = lambda *args: None
    for case in args.cases.split(","):
        D, variant, L = case.split(":")
        D, L = int(D), int(L)
        B, H = max(1, 16384 // L), 16
        gen = torch.Generator(device=device).manual_seed(L + D)
        q, k, v = (torch.randn(B, H, L, D, device=device, dtype=torch.bfloat16, generator=gen)
                   .requires_grad_() for _ in range(3))
        score_mod, mask_mod, mask_batch = make_mods(variant, B, H, L, device, torch.Generator().manual_seed(L))
        block_mask = (flexgen.create_block_mask(mask_mod, mask_batch, None, L, L, device=device)
                      if mask_mod else None)
        dout = torch.randn_like(q)
        out = flexgen.flex_attention(q, k, v, score_mod=score_mod, block_mask=block_mask,
                                     kernel_options=args.options)
        for _ in range(5):
            torch.autograd.grad(out, (q, k, v), dout, retain_graph=True)
        torch.cuda.synchronize()
        events.clear()
        for _ in range(30):
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            torch.autograd.grad(out, (q, k, v), dout, retain_graph=True)
            end.record()
            events.setdefault("all", []).append((start, end))
        torch.cuda.synchronize()
        ms = {part: statistics.median(s.elapsed_time(e) for s, e in pairs) for part, pairs in events.items()}
        parts = "  ".join(f"{p.removeprefix('backward_')} {ms[p]:7.3f}" for p in ("dq", "dkdv", "backward_delta", "fused", "all")
                          if p in ms)
        print(f"[{args.label}] D={D} {variant:15s} L={L:6d} {parts} ms", flush=True)
        del out
    return 0


if __name__ == "__main__":
    sys.exit(main())
