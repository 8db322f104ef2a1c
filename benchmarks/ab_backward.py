"""A/B of flexgen backward variants in one process, on the same inputs, against torch's compiled flex.

    python benchmarks/ab_backward.py                       # the arms below, D=128, 16k and 2k x 8
    python benchmarks/ab_backward.py --variants causal --lengths 16k --smoke   # CPU: checks the script

An arm is a name, flexgen ``kernel_options`` and, optionally, tiles for the tuning
table row of the dK/dV kernel that also sums dQ (``backward.dkdv:dq_atomic``, set
in-process for that arm). Per case (bf16, H=16, B x L = 16k tokens): torch's
compiled flex_attention backward (fresh compile per case after
``torch._dynamo.reset()``), then each arm's backward; every arm's gradients are
checked against torch's (max |g - g_torch| / max |g_torch|, FAIL above 5e-2).
Times are ``do_bench`` medians of the backward alone, inputs rotated as in
bench_backward.py. Prints a table of ms and speed-ups vs torch; writes
``ab_backward.json`` to --out ($OUT, else benchmarks/results).
"""
from __future__ import annotations

import os

os.environ.pop("FLEXGEN_POISON", None)

import argparse  # noqa: E402
import json  # noqa: E402
import sys  # noqa: E402

import torch  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_backward import CHECK_TOL, compare, worst  # noqa: E402
from bench_forward import make_mods, make_sets, rotating  # noqa: E402
from common import Timer  # noqa: E402

import flexgen  # noqa: E402
from flexgen import tuning  # noqa: E402

ARMS = [
    ("two kernels", {}, None),
    ("atomic 64x64/4/2", {"DQ_ATOMIC": True}, None),
    ("atomic 64x128/8/2", {"DQ_ATOMIC": True}, dict(BLOCK_M=64, BLOCK_N=128, num_warps=8, num_stages=2)),
    ("atomic 64x128/4/2", {"DQ_ATOMIC": True}, dict(BLOCK_M=64, BLOCK_N=128, num_warps=4, num_stages=2)),
]
LENGTHS = {"1k": 1024, "2k": 2048, "4k": 4096, "8k": 8192, "16k": 16384}


def backward_ms(attn, sets, timer):
    graphs = [(attn(q, k, v), q, k, v, dout) for q, k, v, dout in sets]
    return timer(rotating(lambda out, q, k, v, dout: torch.autograd.grad(out, (q, k, v), dout,
                                                                         retain_graph=True), graphs))


def run_case(variant, D, L, args, timer, cuda):
    dev = "cuda" if cuda else "cpu"
    H = args.heads
    B = max(1, args.tokens // L)
    gen = torch.Generator().manual_seed(0)
    score_mod, mask_mod, mask_batch = make_mods(variant, B, H, L, dev, gen)
    sets = [(q.requires_grad_(), k.requires_grad_(), v.requires_grad_(),
             torch.randn(B, H, L, D, generator=gen).to(device=dev, dtype=torch.bfloat16))
            for q, k, v in make_sets(B, H, L, D, torch.bfloat16, dev, gen)]
    r = dict(variant=variant, D=D, L=L, B=B, H=H, arms={})
    q0, k0, v0, d0 = sets[0]
    ref = None
    if cuda and not args.skip_torch:
        from torch.nn.attention.flex_attention import create_block_mask as torch_cbm
        from torch.nn.attention.flex_attention import flex_attention as torch_flex
        torch._dynamo.reset()
        th_mask = None if mask_mod is None else torch_cbm(mask_mod, mask_batch, None, L, L, device=dev)
        compiled = torch.compile(torch_flex, dynamic=False, fullgraph=True)

        def tf(q, k, v):
            return compiled(q, k, v, score_mod=score_mod, block_mask=th_mask)
        ref = torch.autograd.grad(tf(q0, k0, v0), (q0, k0, v0), d0)
        r["torch_ms"] = backward_ms(tf, sets, timer)
    fg_mask = None if mask_mod is None else flexgen.create_block_mask(mask_mod, mask_batch, None, L, L,
                                                                     device=dev)
    row_key = ("backward.dkdv:dq_atomic", tuning.gpu_name(torch.device(dev)) if cuda else "cpu",
               "bfloat16", D)
    for name, options, tiles in ARMS:
        if tiles is not None and not cuda:
            continue                      # the table is not read on CPU
        old = tuning.TUNED.pop(row_key, None)
        if tiles is not None:
            tuning.TUNED[row_key] = tiles
        try:
            def fg(q, k, v):
                return flexgen.flex_attention(q, k, v, score_mod=score_mod, block_mask=fg_mask,
                                              kernel_options=options or None)
            got = torch.autograd.grad(fg(q0, k0, v0), (q0, k0, v0), d0)
            arm = dict(ms=backward_ms(fg, sets, timer))
            if ref is not None:
                arm["check_rel"] = worst(compare(got, ref))
                arm["check"] = "PASS" if arm["check_rel"] <= CHECK_TOL else "FAIL"
            if r.get("torch_ms"):
                arm["vs_torch"] = r["torch_ms"] / arm["ms"]
        except Exception as e:          # an arm that fails to compile or run is reported, not fatal
            arm = dict(error=f"{type(e).__name__}: {str(e)[:300]}")
        finally:
            tuning.TUNED.pop(row_key, None)
            if old is not None:
                tuning.TUNED[row_key] = old
        r["arms"][name] = arm
        print(f"{variant:<14} D={D} L={L:<6} {name:<20} {arm}", flush=True)
    return r


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--variants", default="full,causal,sliding_window,alibi,softcap,document")
    ap.add_argument("--lengths", default="16k,2k")
    ap.add_argument("--dims", default="128")
    ap.add_argument("--tokens", type=int, default=16384)
    ap.add_argument("--heads", type=int, default=16)
    ap.add_argument("--skip-torch", action="store_true")
    ap.add_argument("--smoke", action="store_true", help="tiny sizes on CPU: checks the script")
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    cuda = torch.cuda.is_available() and not args.smoke
    if args.smoke:
        args.tokens, args.heads, args.lengths, args.dims = 64, 2, "1k", "64"
        LENGTHS["1k"] = 64
    timer = Timer(cuda)
    # The backward alone replays one graph (retain_graph=True), which AOTAutograd refuses for
    # a backward compiled with donated buffers (as bench_backward.py does: memory reuse only).
    import torch._functorch.config as functorch_config
    if hasattr(functorch_config, "donated_buffer"):
        functorch_config.donated_buffer = False
    rows = [run_case(v, int(d), LENGTHS[L], args, timer, cuda)
            for d in args.dims.split(",") for L in args.lengths.split(",") for v in args.variants.split(",")]
    names = [a[0] for a in ARMS]
    lines = ["backward A/B (ms; x = torch ms / arm ms)",
             f"{'case':<28}{'torch':>9}" + "".join(f"{n:>22}" for n in names)]
    for r in rows:
        cells = []
        for n in names:
            a = r["arms"].get(n, {})
            cell = "err" if "error" in a else "-" if "ms" not in a else \
                f"{a['ms']:.3f} {a.get('vs_torch', float('nan')):.2f}x{'' if a.get('check', 'PASS') == 'PASS' else ' FAIL'}"
            cells.append(f"{cell:>22}")
        torch_ms = f"{r['torch_ms']:.3f}" if r.get("torch_ms") else "-"
        lines.append(f"{r['variant'] + ' D=' + str(r['D']) + ' L=' + str(r['L']):<28}{torch_ms:>9}" + "".join(cells))
    text = "\n".join(lines)
    print(text)
    out = args.out or os.environ.get("OUT") or os.path.join(os.path.dirname(os.path.abspath(__file__)), "results")
    os.makedirs(out, exist_ok=True)
    with open(os.path.join(out, "ab_backward.json"), "w") as fh:
        json.dump(dict(device=torch.cuda.get_device_name() if cuda else "cpu", torch=torch.__version__,
                       rows=rows), fh, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
