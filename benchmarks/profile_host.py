"""Where a warm flex_attention call spends its host time (tiny inputs, so the GPU is never the limit).

    python benchmarks/profile_host.py            # on a GPU machine
    python benchmarks/profile_host.py --smoke    # CPU: the interpreter, to check the script

Times, per call (median of several rounds of many calls, no synchronization
inside a round, so kernel launches queue asynchronously): the whole call, and
its stages measured separately on the same arguments: tracing the mods and
reading the block mask (``api._mods``), planning (``runtime.plan.plan_attention``,
memoized), the op's implementation alone (``runtime.ops._attention``), the custom
op through the dispatcher (what a call needing gradients or torch.compile takes),
output allocation, the module's ``arguments()`` and the Triton launch of the
compiled kernel. Then a cProfile of the whole call, heaviest functions first.

Then a training call's (``training_rows``: q, k, v requiring grad, the same two mods): the
forward alone, the backward alone (``torch.autograd.grad`` of a kept graph) and both, per
call, and a cProfile of the pair.

Then the decode path (one query token; Hq=32 over Hkv=8, D=128 on a GPU): the
``flex_attention`` dispatch, ``decode_attention`` on contiguous K/V and on a
caller's page table, and ``PagedKVCache.attention`` / ``append``, at B=1 and
B=8 (B=2 with --smoke), plain and with softcap + a causal block mask. Per case: the whole call,
flexgen's own Python alone (``launch.run`` replaced by a no-op); then a cProfile of
the host-only call.
"""
from __future__ import annotations

import os

os.environ.pop("FLEXGEN_POISON", None)

import argparse  # noqa: E402
import cProfile  # noqa: E402
import io  # noqa: E402
import pstats  # noqa: E402
import statistics  # noqa: E402
import time  # noqa: E402

import torch  # noqa: E402

import flexgen  # noqa: E402
from flexgen import PagedKVCache, api, decode_attention  # noqa: E402
from flexgen.codegen import cache  # noqa: E402
from flexgen.runtime import launch, ops  # noqa: E402
from flexgen.runtime.plan import plan_attention  # noqa: E402


def per_call_us(fn, calls, rounds, sync):
    samples = []
    for _ in range(rounds):
        sync()
        t = time.perf_counter()
        for _ in range(calls):
            fn()
        sync()
        samples.append((time.perf_counter() - t) / calls * 1e6)
    return statistics.median(samples)


def print_profile(fn, calls: int, title: str, lines: int = 22, sync=lambda: None) -> None:
    """Run ``fn`` ``calls`` times under cProfile and print its heaviest functions (tottime first)."""
    prof = cProfile.Profile()
    prof.enable()
    for _ in range(calls):
        fn()
    prof.disable()
    sync()
    text = io.StringIO()
    pstats.Stats(prof, stream=text).sort_stats("tottime").print_stats(lines)
    print(f"\n== cProfile, {title}, {calls} calls (tottime first)\n{text.getvalue()}")


def softcap(score, b, h, q_idx, kv_idx):
    return 30.0 * torch.tanh(score / 30.0)


def causal(b, h, q_idx, kv_idx):
    return q_idx >= kv_idx


def decode_cases(device, dtype, smoke):
    """name -> (whole call, its plan or None) for the decode entry points."""
    Hq, Hkv, D, L, page = (4, 2, 32, 128, 16) if smoke else (32, 8, 128, 256, 64)
    cases = {}
    for B in ((1, 2) if smoke else (1, 8)):
        q = torch.randn(B, Hq, 1, D, device=device, dtype=dtype)
        k, v = (torch.randn(B, Hkv, L, D, device=device, dtype=dtype) for _ in range(2))
        short = flexgen.create_block_mask(causal, None, None, 1, L, device=device)    # flex: (Lq, Lkv)
        full = flexgen.create_block_mask(causal, None, None, L, L, device=device)     # logical positions
        pages = B * (L // page)
        kc, vc = (torch.randn(pages, page, Hkv, D, device=device, dtype=dtype) for _ in range(2))
        table = torch.randperm(pages, device=device).view(B, L // page).to(torch.int32)
        lengths = torch.full((B,), L, dtype=torch.int32, device=device)
        pc = PagedKVCache(num_pages=pages + B, page_size=page, num_kv_heads=Hkv, head_dim=D, max_batch=B,
                          max_pages_per_seq=L // page + 1, dtype=dtype, device=device)
        slots = [pc.add_sequence() for _ in range(B)]
        pc.append(slots, k[:, :, :L - page // 2], v[:, :, :L - page // 2])
        logical = pc.block_mask(causal)
        # append: a cache of its own (it grows), sized for every call the timing makes
        grow = PagedKVCache(num_pages=B * 400, page_size=page, num_kv_heads=Hkv, head_dim=D, max_batch=B,
                            max_pages_per_seq=400, dtype=dtype, device=device)
        grow_slots = [grow.add_sequence() for _ in range(B)]
        k1, v1 = k[:, :, :1].contiguous(), v[:, :, :1].contiguous()
        for mods, label in (({}, "plain"), (dict(score_mod=softcap), "softcap+causal")):
            bm = {} if not mods else dict(block_mask=short)
            bm_full = {} if not mods else dict(block_mask=full)
            bm_logical = {} if not mods else dict(block_mask=logical)
            cases[f"flex B={B} {label}"] = (
                lambda q=q, k=k, v=v, m={**mods, **bm}: flexgen.flex_attention(q, k, v, enable_gqa=True, **m),
                None)
            cases[f"decode B={B} {label}"] = (
                lambda q=q, k=k, v=v, m={**mods, **bm_full}: decode_attention(q, k, v, enable_gqa=True, **m),
                None)
            cases[f"page_table B={B} {label}"] = (
                lambda q=q, m={**mods, **bm_full}, kc=kc, vc=vc, t=table, n=lengths: decode_attention(
                    q, kc, vc, enable_gqa=True, kv_lengths=n, page_table=t, max_kv_len=L, **m),
                None)
            cases[f"cache.attention B={B} {label}"] = (
                lambda q=q, pc=pc, s=slots, m={**mods, **bm_logical}: pc.attention(q, s, **m), None)
        cases[f"cache.append B={B} 1 token"] = (lambda g=grow, s=grow_slots, k1=k1, v1=v1: g.append(s, k1, v1),
                                                None)
    return cases


def decode_rows(device, dtype, smoke, calls, rounds, sync):
    rows = []
    real_run = launch.run
    for name, (whole, plan) in decode_cases(device, dtype, smoke).items():
        whole()
        sync()
        stages = {"whole call": whole}
        if plan is not None:
            stages["plan"] = plan
        for stage, fn in stages.items():
            rows.append((name, stage, per_call_us(fn, calls, rounds, sync)))
        launch.run = lambda *args, **kwargs: None      # flexgen's own Python only
        try:
            rows.append((name, "host, no launch", per_call_us(whole, calls, rounds, sync)))
            if name.startswith(("cache.attention", "page_table")) and "B=1" not in name \
                    and ("softcap" in name) == name.startswith("cache"):
                print_profile(whole, calls, f"{name} without launches", lines=15)
        finally:
            launch.run = real_run
    return rows


def training_rows(device, dtype, calls, rounds, sync, block_mask):
    """Host time of an eager training call (the inputs require grad): its forward, its
    backward, and the two in one call; then a cProfile of the pair with the mods."""
    rows = []
    q, k, v = (torch.randn(1, 1, 128, 64, device=device, dtype=dtype, requires_grad=True) for _ in range(3))
    dout = torch.randn(1, 1, 128, 64, device=device, dtype=dtype)
    for name, kwargs in (("plain", {}), ("softcap+causal", dict(score_mod=softcap, block_mask=block_mask))):
        def forward():
            return flexgen.flex_attention(q, k, v, **kwargs)

        def both():
            return torch.autograd.grad(forward(), (q, k, v), dout)
        kept = forward()
        stages = {"train forward": forward,
                  "train backward": lambda: torch.autograd.grad(kept, (q, k, v), dout, retain_graph=True),
                  "train forward+backward": both}
        both()
        for stage, fn in stages.items():
            rows.append((name, stage, per_call_us(fn, calls, rounds, sync)))
        if kwargs:
            print_profile(both, calls, f"training {name}", sync=sync)
    return rows


def main(argv=None) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--smoke", action="store_true")
    ap.add_argument("--only", default="forward,training,decode",
                    help="comma-separated sections: forward, training, decode")
    args = ap.parse_args(argv)
    sections = set(args.only.split(","))
    device = torch.device("cpu" if args.smoke else "cuda")
    calls, rounds = (3, 2) if args.smoke else (2000, 5)
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    dtype = torch.float32 if args.smoke else torch.bfloat16
    q, k, v = (torch.randn(1, 1, 128, 64, device=device, dtype=dtype) for _ in range(3))
    block_mask = flexgen.create_block_mask(causal, None, None, 128, 128, device=device)
    rows = []
    for name, kwargs in (("plain", {}), ("softcap+causal", dict(score_mod=softcap, block_mask=block_mask))):
        if "forward" not in sections:
            break

        def whole():
            return flexgen.flex_attention(q, k, v, **kwargs)
        whole()
        mods = api._mods(kwargs.get("score_mod"), kwargs.get("block_mask"))
        score, sbufs, mask, mbufs, lists, block_size, lengths = mods
        op_args = (q, k, v, list(sbufs), list(mbufs), list(lists), score, mask, list(block_size),
                   list(lengths), 0.125, False, "", False)
        call = plan_attention(q, k, v, score, sbufs, mask, mbufs, lists, block_size, lengths, 0.125,
                              False, "")
        out = torch.empty(1, 1, 128, 64, dtype=dtype, device=device)
        lse = torch.empty(1, 1, 128, dtype=torch.float32, device=device)
        sparse = None if not lists else (*lists[:4], *block_size)
        inputs = dict(q=q, k=k, v=v, out=out, lse=lse, sparse=sparse, score_buffers=sbufs,
                      mask_buffers=mbufs, scale=0.125)
        module = cache.load(call.spec, interpret=device.type != "cuda")
        grid, largs, constexprs = module.arguments(**inputs)
        options = dict(num_warps=module.NUM_WARPS, num_stages=module.NUM_STAGES)
        constexprs = dict(constexprs, DOT_UPCAST=False)     # as launch.run passes it on a GPU
        stages = {
            "whole call": whole,
            "trace + mask (_mods)": lambda: api._mods(kwargs.get("score_mod"), kwargs.get("block_mask")),
            "plan (memoized)": lambda: plan_attention(q, k, v, score, sbufs, mask, mbufs, lists,
                                                      block_size, lengths, 0.125, False, ""),
            "op impl (_attention)": lambda: ops._attention(*op_args),
            "op via dispatcher": lambda: torch.ops.flexgen.attention(*op_args),
            "allocate out+lse": lambda: (torch.empty(1, 1, 128, 64, dtype=dtype, device=device),
                                         torch.empty(1, 1, 128, dtype=torch.float32, device=device)),
            "module.arguments": lambda: module.arguments(**inputs),
            "launch.run": lambda: launch.run(call.spec, device, inputs),
        }
        if device.type == "cuda":
            stages["KERNEL[grid](...)"] = lambda: module.KERNEL[grid](*largs, **constexprs, **options)
        for stage, fn in stages.items():
            rows.append((name, stage, per_call_us(fn, calls, rounds, sync)))
        print_profile(whole, calls, name, sync=sync)
        print(f"   {len(largs)} kernel arguments, {len(constexprs)} constexprs")
    if "training" in sections:
        rows += training_rows(device, dtype, calls, rounds, sync, block_mask)
    if "decode" in sections:
        rows += decode_rows(device, dtype, args.smoke, calls, rounds, sync)
    print(f"\n{'case':<36} {'stage':<20} {'us/call':>9}")
    for name, stage, us in rows:
        print(f"{name:<36} {stage:<20} {us:9.1f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
