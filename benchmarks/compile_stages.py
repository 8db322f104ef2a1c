"""Where a forward kernel's first compile goes, per compiler stage, on a machine without a GPU.

    PYTHONPATH=.triton-compat python benchmarks/compile_stages.py     # fp32 and bf16 as on an H100
    PYTHONPATH=.triton-compat python benchmarks/compile_stages.py --rows "fp32;fp32:BLOCK_N=32,num_stages=3;fp32:prec=tf32"

A new mod's first call on an H100 compiles its forward kernel once. This script records that
call's launch on CPU (causal block mask, ``cap * tanh(score / cap)``, B=1, H=16, L=4096,
D=128: the cold-start benchmark's mod; the launch is recorded, nothing runs), makes it the
launch the GPU makes (its tiles, dot precision, TMA or pointers) and compiles it for sm_90
the way Triton's JIT does on a launch (the same specialization of pointers and integers), in a
fresh process with an empty ``TRITON_CACHE_DIR`` per measurement. Each stage of the compile
(ttir, ttgir, llir, ptx: LLVM, cubin: ptxas) is timed; ``front`` is the rest (parsing the
kernel, the first compile's one-time setup). Prints a table: median seconds over
``--repeats`` processes, the PTX's lines, shared memory bytes, ptxas's registers and spills.

Rows (``;``-separated) are ``fp32`` or ``bf16``, the launches an H100 makes for this call
(tuning.table_row, plan._use_tma), with ``:key=value,...`` changing its fields: BLOCK_M,
BLOCK_N, num_warps, num_stages, prec (tf32x3 / tf32 / ieee), score (softcap / none), mask
(causal / none: no block mask), tma (0 / 1), ptxas (extra ptxas options).
``COMPILE_STAGES_DUMP=dir`` writes the last compile's IR of every stage there.
"""
from __future__ import annotations

import argparse
import contextlib
import io
import json
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time

B, H, L, D, CAP = 1, 16, 4096, 128, 20.0


def gpu_launch(dtype: str) -> dict:
    """What an H100 launches for this call: the tuning table's tiles, the planner's precision
    and TMA choice (Gluon declines float32; bf16 at 16 x 4096^2 scores is under its minimum)."""
    import torch
    from flexgen.runtime import plan, tuning
    tuning.gpu_name = lambda device: "H100"
    kernel = "forward:transcendental"
    row = tuning.table_row(kernel, D, dtype, torch.device("cuda", 0))
    scores = B * H * L * L
    return dict(dtype=dtype, **row, prec="tf32x3" if dtype == "float32" else "ieee", score="softcap",
                tma=int(dtype != "float32" and scores >= plan.TMA_MIN_SCORES))



def record(cfg: dict):
    """(spec, args, constexprs) of the CPU call planned with the GPU launch's fields (the tiles
    as kernel_options, the dot precision patched in); recorded before the interpreter runs."""
    import torch
    import flexgen
    from flexgen import mods as M
    from flexgen.codegen import cache
    from flexgen.runtime import launch, plan

    class Recorded(Exception):
        pass

    got = []

    def once(spec, device, inputs):
        got.append((spec, *cache.load(spec, interpret=True).arguments(**inputs)[1:]))
        raise Recorded

    launch._launch_once = once
    plan.dot_precision = lambda query: cfg["prec"]
    dtype = getattr(torch, cfg["dtype"])
    q, k, v = (torch.randn(B, H, L, D, dtype=dtype) for _ in range(3))
    mask = (None if cfg.get("mask") == "none" else
            flexgen.create_block_mask(M.causal_mask, None, None, L, L, device="cpu", BLOCK_SIZE=128))
    score_mod = M.tanh_softcap(CAP) if cfg["score"] == "softcap" else None
    options = {"USE_TMA": bool(cfg["tma"]), "BACKEND": "tl",
               **{k: cfg[k] for k in ("BLOCK_M", "BLOCK_N", "num_warps", "num_stages")}}
    try:
        flexgen.flex_attention(q, k, v, score_mod=score_mod, block_mask=mask, kernel_options=options)
    except Recorded:
        pass
    return got[0]


def child(cfg: dict) -> dict:
    import triton
    from triton import knobs
    from triton.compiler import ASTSource, make_backend
    from triton.runtime.jit import create_function_from_signature
    from flexgen.codegen import cache
    from flexgen.runtime import aot, compiler_key, driver

    spec, args, constexprs = record(cfg)
    module = cache.load(spec, interpret=False)
    kernel = module.KERNEL
    if "DOT_UPCAST" in kernel.arg_names:
        constexprs = dict(constexprs, DOT_UPCAST=False)
    # Triton's JIT specialization for this launch: pointers 16-byte aligned (the GPU's
    # allocations are), integers divisible by 16 or equal to 1 marked as such.
    backend = make_backend(aot.HOPPER)
    binder = create_function_from_signature(kernel.signature, kernel.params, backend)
    options = driver.compile_options(module)
    if cfg.get("ptxas"):
        options["ptx_options"] = cfg["ptxas"]
    bound, specialization, opts = binder(*args, **constexprs, **options)
    _, signature, consts, attrs = kernel._pack_args(backend, options, bound, specialization, opts)
    source = ASTSource(fn=kernel, signature=signature, constexprs=consts, attrs=attrs)
    compiler_key.install()

    times = {}

    def hook(self=None, stages=None, options=None, language=None, capability=None):
        if stages is None:          # Triton 3.9 first asks for the hook's part of the cache key
            return "compile_stages", "0"
        for name, fn in list(stages.items()):
            def timed(src, metadata, fn=fn, name=name):
                start = time.perf_counter()
                try:
                    return fn(src, metadata)
                finally:
                    times[name] = time.perf_counter() - start
            stages[name] = timed

    knobs.runtime.add_stages_inspection_hook = hook
    knobs.nvidia.dump_ptxas_log = True
    log = io.StringIO()
    start = time.perf_counter()
    with contextlib.redirect_stdout(log):
        compiled = triton.compile(source, target=aot.HOPPER, options=options)
    total = time.perf_counter() - start
    text = log.getvalue()
    regs = re.search(r"Used (\d+) registers", text)
    spill = re.search(r"(\d+) bytes spill stores, (\d+) bytes spill loads", text)
    ptx = compiled.asm["ptx"]
    if os.environ.get("COMPILE_STAGES_DUMP"):       # the IR of every stage, for reading
        for ext, text in compiled.asm.items():
            if isinstance(text, str):
                with open(os.path.join(os.environ["COMPILE_STAGES_DUMP"], f"kernel.{ext}"), "w") as f:
                    f.write(text)
    return dict(total=total, **times, front=total - sum(times.values()),
                ptx_lines=ptx.count("\n"), shared=compiled.metadata.shared,
                regs=int(regs.group(1)) if regs else None,
                spills=f"{spill.group(1)}/{spill.group(2)}" if spill else None,
                mma=len(re.findall(r"\bwgmma\.mma_async|\bmma\.sync", ptx)),
                kernel=spec.kernel_name)


def parse_row(text: str) -> tuple:
    name, _, rest = text.partition(":")
    base, _, _ = name.partition("+")
    cfg = gpu_launch("float32" if base.startswith("fp32") else "bfloat16")
    for item in filter(None, rest.split(",")):
        key, _, value = item.partition("=")
        cfg[key] = value if key in ("dtype", "prec", "score", "ptxas", "mask") else int(value)
    return text, cfg


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rows", default="fp32,bf16", help="';'-separated rows (see the docstring)")
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--child", help=argparse.SUPPRESS)
    a = parser.parse_args()
    if a.child:
        print(json.dumps(child(json.loads(a.child))))
        return
    stages = ("front", "ttir", "ttgir", "llir", "ptx", "cubin", "total")
    print(f"{'row':42s} " + " ".join(f"{s:>6s}" for s in stages) + "  ptx_lines  shared  regs spills mma")
    for text in a.rows.split(";"):
        name, cfg = parse_row(text)
        runs = []
        for _ in range(a.repeats):
            with tempfile.TemporaryDirectory() as triton_dir, tempfile.TemporaryDirectory() as flexgen_dir:
                env = dict(os.environ, TRITON_CACHE_DIR=triton_dir, FLEXGEN_CACHE_DIR=flexgen_dir)
                out = subprocess.run([sys.executable, __file__, "--child", json.dumps(cfg)], env=env,
                                     capture_output=True, text=True)
            if out.returncode:
                print(f"{name}: FAILED\n{out.stderr[-3000:]}")
                break
            runs.append(json.loads(out.stdout.strip().splitlines()[-1]))
        if not runs:
            continue
        med = {s: statistics.median(r[s] for r in runs) for s in stages}
        last = runs[-1]
        print(f"{name:42s} " + " ".join(f"{med[s]:6.2f}" for s in stages)
              + f"  {last['ptx_lines']:9d} {last['shared']:7d} {last['regs']!s:>5} {last['spills']!s:>6}"
              + f" {last['mma']:3d}   [" + " ".join("%.2f" % r["total"] for r in runs) + "]", flush=True)


if __name__ == "__main__":
    main()
