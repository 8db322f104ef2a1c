"""Where a warm flex_attention call spends its host time (tiny inputs, so the GPU is never the limit).

    python benchmarks/profile_host.py            # on a GPU machine
    python benchmarks/profile_host.py --smoke    # CPU: the interpreter, to check the script

Times, per call (median of several rounds of many calls, no synchronization
inside a round, so kernel launches queue asynchronously): the whole call, and
its stages measured separately on the same arguments: planning
(``api._prepare``), output allocation, the module's ``arguments()`` and the
Triton launch of the compiled kernel. Then a cProfile of the whole call,
heaviest functions first.
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
from flexgen import api, cache, launch  # noqa: E402


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


def softcap(score, b, h, q_idx, kv_idx):
    return 30.0 * torch.tanh(score / 30.0)


def causal(b, h, q_idx, kv_idx):
    return q_idx >= kv_idx


def main(argv=None) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--smoke", action="store_true")
    args = ap.parse_args(argv)
    device = torch.device("cpu" if args.smoke else "cuda")
    calls, rounds = (3, 2) if args.smoke else (2000, 5)
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    dtype = torch.float32 if args.smoke else torch.bfloat16
    q, k, v = (torch.randn(1, 1, 128, 64, device=device, dtype=dtype) for _ in range(3))
    block_mask = flexgen.create_block_mask(causal, None, None, 128, 128, device=device)
    rows = []
    for name, kwargs in (("plain", {}), ("softcap+causal", dict(score_mod=softcap, block_mask=block_mask))):
        def whole():
            return flexgen.flex_attention(q, k, v, **kwargs)
        whole()
        call = api._prepare(q, k, v, kwargs.get("score_mod"), kwargs.get("block_mask"), None, False, None)
        out = torch.empty(1, 1, 128, 64, dtype=dtype, device=device)
        lse = torch.empty(1, 1, 128, dtype=torch.float32, device=device)
        inputs = (q, k, v, out, lse, call.sparse, call.score_buffers, call.mask_buffers, call.scale)
        module = cache.load(call.spec, interpret=device.type != "cuda")
        grid, largs, constexprs = module.arguments(*inputs)
        options = dict(num_warps=module.NUM_WARPS, num_stages=module.NUM_STAGES)
        constexprs = dict(constexprs, DOT_UPCAST=False)     # as launch.run passes it on a GPU
        stages = {
            "whole call": whole,
            "plan (_prepare)": lambda: api._prepare(q, k, v, kwargs.get("score_mod"), kwargs.get("block_mask"),
                                                     None, False, None),
            "allocate out+lse": lambda: (torch.empty(1, 1, 128, 64, dtype=dtype, device=device),
                                         torch.empty(1, 1, 128, dtype=torch.float32, device=device)),
            "module.arguments": lambda: module.arguments(*inputs),
            "launch.run": lambda: launch.run(call.spec, device, *inputs),
        }
        if device.type == "cuda":
            stages["KERNEL[grid](...)"] = lambda: module.KERNEL[grid](*largs, **constexprs, **options)
        for stage, fn in stages.items():
            rows.append((name, stage, per_call_us(fn, calls, rounds, sync)))
        prof = cProfile.Profile()
        prof.enable()
        for _ in range(calls):
            whole()
        prof.disable()
        sync()
        text = io.StringIO()
        pstats.Stats(prof, stream=text).sort_stats("tottime").print_stats(22)
        print(f"\n== cProfile, {name}, {calls} calls (tottime first)\n{text.getvalue()}")
        print(f"   {len(largs)} kernel arguments, {len(constexprs)} constexprs")
    print(f"\n{'case':<16} {'stage':<20} {'us/call':>9}")
    for name, stage, us in rows:
        print(f"{name:<16} {stage:<20} {us:9.1f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
