"""Quick GPU smoke test: correctness of a few variants and one timing row each.

    python benchmarks/smoke.py
"""
import math
import os
import time

os.environ.setdefault("FLEXGEN_POISON", "0")
import torch
import torch.nn.functional as F
import triton

import flexgen
from flexgen.mods import alibi, causal_mask, sliding_window, tanh_softcap
from flexgen.reference import flex_attention_reference


def tflops(B, H, L, D, ms, density):
    return 4 * B * H * L * L * D * density / (ms * 1e-3) / 1e12


def main():
    dev = "cuda"
    torch.manual_seed(0)
    print(torch.cuda.get_device_name(), torch.__version__, triton.__version__)
    # correctness at a realistic size
    B, H, L, D = 2, 8, 2048, 128
    q, k, v = (torch.randn(B, H, L, D, device=dev, dtype=torch.bfloat16) for _ in range(3))
    for name, sm, mm in [("full", None, None), ("causal", None, causal_mask),
                         ("softcap+causal", tanh_softcap(30.0), causal_mask),
                         ("swa1024", None, sliding_window(1024)), ("alibi", alibi(H), None)]:
        bm = None if mm is None else flexgen.create_block_mask(mm, None, None, L, L, device=dev)
        t0 = time.perf_counter()
        out = flexgen.flex_attention(q, k, v, score_mod=sm, block_mask=bm)
        torch.cuda.synchronize()
        first = time.perf_counter() - t0
        ref = flex_attention_reference(q, k, v, sm, mm, dtype=torch.float32)
        err = (out.float() - ref).abs().max().item()
        print(f"check {name:16s} max err {err:.3e} first call {first:.2f}s nan={out.isnan().any().item()}")
    # timing at 16k tokens
    from torch.nn.attention.flex_attention import create_block_mask as t_cbm, flex_attention as t_flex
    for D in (64, 128):
        B, H, L = 1, 16, 16384
        q, k, v = (torch.randn(B, H, L, D, device=dev, dtype=torch.bfloat16) for _ in range(3))
        for name, mm in [("full", None), ("causal", causal_mask)]:
            bm = None if mm is None else flexgen.create_block_mask(mm, None, None, L, L, device=dev)
            tbm = None if mm is None else t_cbm(mm, None, None, L, L, device=dev)
            density = 1.0 if mm is None else 0.5
            ms_fg = triton.testing.do_bench(lambda: flexgen.flex_attention(q, k, v, block_mask=bm), return_mode="median")
            torch._dynamo.reset()
            cf = torch.compile(t_flex)
            cf(q, k, v, block_mask=tbm)
            ms_tf = triton.testing.do_bench(lambda: cf(q, k, v, block_mask=tbm), return_mode="median")
            ms_sd = triton.testing.do_bench(lambda: F.scaled_dot_product_attention(q, k, v, is_causal=mm is not None), return_mode="median")
            print(f"D={D} {name:7s} flexgen {tflops(B,H,L,D,ms_fg,density):6.1f} TF/s  torch-flex {tflops(B,H,L,D,ms_tf,density):6.1f}  sdpa {tflops(B,H,L,D,ms_sd,density):6.1f}")


if __name__ == "__main__":
    main()
