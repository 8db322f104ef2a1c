"""Where the small compiled model's step goes, kernel by kernel: bench_models' SmallTransformer
(document mask + learned relative bias, B=2, 4k, 4 layers), flexgen against torch's
flex_attention, both under ``torch.compile(model, fullgraph=True)``.

    python benchmarks/profile_small_model.py [--mode default|reduce-overhead] [--steps 5]
                                             [--layers] [--cprofile]       # on a GPU machine

Per peer: the step's wall time (median of 20, CUDA events), the host's enqueue time of a step
(no synchronization), then torch.profiler over ``--steps`` steps: GPU time per step by kernel
name, heaviest first, and the total. The two tables side by side say which kernels a
difference in the step comes from (the attention's own kernels, the block mask's build, the
copies around the ops, the learned bias's gradient). ``--layers``: flexgen's host time a step in
each layer of its ops, timed in place (a compiled step's calls run ~2x slower than the same calls
back to back: other code runs between them); ``--cprofile``: a cProfile of flexgen's steps.
"""
from __future__ import annotations

import argparse
import collections
import cProfile
import io
import os
import pstats
import sys
import time

os.environ.pop("FLEXGEN_POISON", None)

import torch  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_models import cuda_ms, small_inputs, small_peers, small_step  # noqa: E402


def kernel_times(prof, steps: int) -> dict[str, float]:
    """GPU microseconds per step by kernel name, from a profiler's device events."""
    times = collections.Counter()
    for event in prof.events():
        if event.device_type == torch.autograd.DeviceType.CUDA:
            times[event.name] += event.device_time / steps
    return dict(times)


def idle_ms(prof, steps: int) -> float:
    """Milliseconds per step in which no kernel ran, between the profiled steps' first kernel
    and their last."""
    spans = sorted((e.time_range.start, e.time_range.end) for e in prof.events()
                   if e.device_type == torch.autograd.DeviceType.CUDA)
    if not spans:
        return float("nan")
    idle, reach = 0.0, spans[0][1]
    for start, end in spans[1:]:
        idle += max(0.0, start - reach)
        reach = max(reach, end)
    return idle / steps / 1e3


def host_layers(step, steps: int) -> str:
    """Host microseconds a step spent inside each layer of flexgen's ops, timed in place (wrappers
    around the functions; the layers nest, so the rows do not add up)."""
    from flexgen.kernels import backward
    from flexgen.masks import builder
    from flexgen.runtime import driver, launch, ops
    layers = [(ops, "_attention", "forward op's implementation"),
              (ops, "run_forward", "  forward kernel call"),
              (ops, "_attention_backward", "backward op's implementation"),
              (ops, "plan_attention", "  plan lookups (forward and backward)"),
              (backward, "run_backward", "  backward kernel calls"),
              (backward._Launcher, "__call__", "    their launches"),
              (backward, "gradient_buffers", "    zeroed gradient sums"),
              (backward, "buffer_grads", "    gradients cast"),
              (launch.Replay, "__call__", "replayed launches (all)"),
              (driver.Binary, "launch_packed", "  the driver's launches (all)"),
              (builder, "build", "block mask build")]
    spent = collections.Counter()
    originals = []

    def timed(fn, label):
        def run(*args, **kwargs):
            start = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                spent[label] += time.perf_counter() - start
        return run

    for owner, attr, label in layers:
        originals.append((owner, attr, getattr(owner, attr)))
        setattr(owner, attr, timed(getattr(owner, attr), label))
    try:
        for _ in range(steps):
            step()
        torch.cuda.synchronize()
    finally:
        for owner, attr, fn in originals:
            setattr(owner, attr, fn)
    return "\n".join(f"{label:<40}{spent[label] / steps * 1e6:9.1f} us a step" for _, _, label in layers)


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mode", default="default", choices=("default", "reduce-overhead"))
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--top", type=int, default=25)
    parser.add_argument("--cprofile", action="store_true",
                        help="also a cProfile of flexgen's steps, heaviest functions first")
    parser.add_argument("--layers", action="store_true",
                        help="also flexgen's host time a step in each layer of its ops (timed in place)")
    args = parser.parse_args()
    ids, docs = small_inputs(4096, torch.device("cuda"))
    dtype = torch.bfloat16
    mode = None if args.mode == "default" else args.mode
    summary = []
    for name, attention in small_peers():
        name = name.split()[0]          # torch, flexgen
        step = small_step(attention, mode, ids, docs, dtype)
        for _ in range(3):
            step()
        wall = cuda_ms(step, 20)
        torch.cuda.synchronize()
        hosts = []
        for _ in range(10):
            t0 = time.perf_counter()
            step()
            hosts.append((time.perf_counter() - t0) * 1e3)
            torch.cuda.synchronize()
        host = sorted(hosts)[len(hosts) // 2]
        torch.cuda.set_sync_debug_mode("warn")      # a synchronizing call in a step says so
        step()
        torch.cuda.set_sync_debug_mode(0)
        torch.cuda.synchronize()
        activities = [torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA]
        with torch.profiler.profile(activities=activities) as prof:
            for _ in range(args.steps):
                step()
            torch.cuda.synchronize()
        times = kernel_times(prof, args.steps)
        total = sum(times.values())
        print(f"\n## {name} ({args.mode}): step {wall:.3f} ms, host enqueue {host:.3f} ms, "
              f"GPU kernels {total / 1e3:.3f} ms a step, GPU idle {idle_ms(prof, args.steps):.3f} ms a step")
        print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=args.top))
        for kernel, us in sorted(times.items(), key=lambda kv: -kv[1])[:args.top]:
            print(f"{us:9.1f} us  {kernel[:110]}")
        summary.append((name, wall, host, total / 1e3))
        if args.layers and name == "flexgen":
            print(host_layers(step, 30))
        if args.cprofile and name == "flexgen":
            profiler = cProfile.Profile()
            profiler.enable()
            for _ in range(args.steps):
                step()
            profiler.disable()
            torch.cuda.synchronize()
            stream = io.StringIO()
            pstats.Stats(profiler, stream=stream).sort_stats("cumulative").print_stats(45)
            print(stream.getvalue())
    print(f"\n{'peer':<10}{'step ms':>10}{'host ms':>10}{'GPU ms':>10}")
    for name, wall, host, gpu in summary:
        print(f"{name:<10}{wall:10.3f}{host:10.3f}{gpu:10.3f}")


if __name__ == "__main__":
    main()
