"""Tile configurations: a checked-in table, defaults per head dim, and an opt-in autotuner.

Which tiles a kernel launches with is decided in this order:

1. ``kernel_options`` the caller passed (never overridden);
2. a winner the autotuner stored on disk for this kernel, GPU and size bucket
   (``$FLEXGEN_CACHE_DIR/autotune.json``), when there is one;
3. ``TUNED``: configurations measured on a named GPU, per (kernel, GPU, dtype,
   padded head dim), checked into the repository (``benchmarks/tune.py`` measures them);
4. ``DEFAULTS``: per head dim, for any GPU; "cpu" for the Triton interpreter,
   whose cost is per operation rather than per element (few large tiles).

Autotuning is opt-in (``with flexgen.autotune():`` or ``FLEXGEN_AUTOTUNE=1``):
the first launch of a kernel for a size bucket on a CUDA device times every
candidate configuration on the call's own inputs (with a progress bar on
stderr), keeps the fastest and stores it. Only kernels that can be re-run
without changing their result are tuned (a kernel that accumulates gradients
of captured tensors with atomics is not).
"""
from __future__ import annotations

import contextlib
import dataclasses
import functools
import json
import math
import os
import re
import sys
import threading

import torch

from ..codegen.spec import KernelSpec, pad_head_dim

KERNELS = ("forward", "forward:transcendental", "forward:dense", "forward:terms", "forward:mask_loads",
           "backward.dq", "backward.dq:scatter", "backward.dkdv")
FIELDS = {"BLOCK_M": "block_m", "BLOCK_N": "block_n", "num_warps": "num_warps",
          "num_stages": "num_stages"}

_FORWARD = {
    "cpu": dict(BLOCK_M=64, BLOCK_N=64, num_warps=4, num_stages=1),
    64: dict(BLOCK_M=128, BLOCK_N=64, num_warps=4, num_stages=3),
    128: dict(BLOCK_M=128, BLOCK_N=64, num_warps=8, num_stages=3),
    256: dict(BLOCK_M=64, BLOCK_N=32, num_warps=4, num_stages=2),
}
# The backward holds more tiles live than the forward (dK and dV, or dQ, plus
# q/k/v/dO), so its tiles are smaller. Measured on an H100 (bf16, causal,
# L=4096, both parts swept over 32/64/128-wide tiles, 4/8 warps, 2/3 stages):
# 64 x 64 with 4 warps was best or within 5% at D=64 and D=128.
_BACKWARD = {
    "cpu": dict(BLOCK_M=64, BLOCK_N=64, num_warps=4, num_stages=1),
    64: dict(BLOCK_M=64, BLOCK_N=64, num_warps=4, num_stages=3),
    128: dict(BLOCK_M=64, BLOCK_N=64, num_warps=4, num_stages=2),
    256: dict(BLOCK_M=32, BLOCK_N=32, num_warps=4, num_stages=1),
}
DEFAULTS = {"forward": _FORWARD, "backward.dq": _BACKWARD, "backward.dkdv": _BACKWARD}
# fp32 tiles are twice the bytes: the forward's 128 x 64 tiles with 3 stages need 225 KiB of
# shared memory with FMA products and 256 KiB with tensor-core (tf32 / tf32x3) ones, past an
# H100's 227 KiB. 128 x 32 with 8 warps and 2 stages: 192 KiB, no register spills with tf32x3
# products, the forward of a causal softcap call (B=1, H=16, 4k, D=128) in 2.33 ms on the H100
# against 2.89 for 64 x 64 / 4 warps and 3.33 for 64 x 32 (torch's compiled flex_attention 9.76,
# same run), and a first sm_90 compile of 0.74 s against 1.22 on the dev CPU
# (benchmarks/NOTES.md, "fp32 first call" and "2026-11-25 (second session)").
FLOAT32 = {("forward", 128): dict(BLOCK_M=128, BLOCK_N=32, num_warps=8, num_stages=2)}

# (kernel, GPU, dtype, padded head dim) -> configuration, each measured by
# benchmarks/tune.py on that GPU: the configuration with the best geometric mean
# of (time / the case's best) over its cases. Comments: the gain over DEFAULTS.
# H100 SXM, torch 2.11, triton 3.6, 2026-11-23 (benchmarks/results/tune_h100_20261123.json),
# cases: full and causal, 16 heads x 16k tokens.
TUNED: dict = {
    # Head dim 64, measured on an H200 (2026-11-29, results/tiles_*_h200_20261129e.json and
    # tl64_rows_ab_h200_20261129e.txt): 64 x 128, 4 warps, two stages against the 64 x 64 / 4 / 3
    # row the H100 measured on 2026-11-23 (older templates; full and causal at 16k, which the
    # Gluon kernel runs now). A/B in one process: sliding windows of 512 and 1024 keys at 16k
    # (AUTO's tl kernel there) 7.4-7.6% faster, 8 x 2k full 7.3%, causal 9.0%, prefix LM 8.2%,
    # soft-cap 6.9%, window 7.7%; 16 x 1k causal 2.5% slower. fp16 measured alike.
    ("forward", "H100", "bfloat16", 64): dict(BLOCK_M=64, BLOCK_N=128, num_warps=4, num_stages=2),
    # Except for a mask_mod reading captured tensors (document ids): at 64 x 128 with 4 warps
    # Triton's layout pass (3.6 and 3.9) moves the score tile out of the MMA layout and runs the softmax
    # twice, once per layout (648 shuffles and 296 spilled stores in the sm_90 SASS): 6x slower
    # (8 x 2k documents 1.89 against 0.31 ms). And a score_mod taken as key and row terms (ALiBi):
    # 0.415 against 0.370 ms with two stages. Both keep the H100's row.
    ("forward:mask_loads", "H100", "bfloat16", 64): dict(BLOCK_M=64, BLOCK_N=64, num_warps=4, num_stages=3),
    ("forward:terms", "H100", "bfloat16", 64): dict(BLOCK_M=64, BLOCK_N=64, num_warps=4, num_stages=3),
    # With a block mask: causal 2.449 -> 2.398 ms with two stages instead of three (tune_h100_20261123_tma.json).
    ("forward", "H100", "bfloat16", 128): dict(BLOCK_M=128, BLOCK_N=128, num_warps=8, num_stages=2),
    # tanh softcap: the 128x128 row above was 10% (16k) and 6% (2k x 8) slower than these
    # tiles (results/bench_forward_h100_20261123_{untuned,tuned}.json).
    ("forward:transcendental", "H100", "bfloat16", 128): dict(BLOCK_M=128, BLOCK_N=64, num_warps=8,
                                                              num_stages=3),
    # Without a block mask: full 505 -> 527 TF/s at 16k (+4.4%), ALiBi flat (495), against
    # 128x128 / 8 / 3 (results/bench_forward_h100_20261123_plain_tiles.txt; full +4% in
    # tune_h100_20261123_tma.json too, where causal was 3% slower with these tiles).
    ("forward:dense", "H100", "bfloat16", 128): dict(BLOCK_M=128, BLOCK_N=64, num_warps=4, num_stages=2),
    ("backward.dq", "H100", "bfloat16", 64): dict(BLOCK_M=64, BLOCK_N=64, num_warps=4, num_stages=3),     # 0%
    ("backward.dq", "H100", "bfloat16", 128): dict(BLOCK_M=128, BLOCK_N=64, num_warps=8, num_stages=3),   # 11-13%
    # A dQ kernel that also scatters captured tensors' gradients (which the autotuner cannot
    # search: its atomics would add once per candidate): with a learned rel[h, q - kv] under a
    # document mask (B=2, H=8, 4k) 0.383 ms against 0.501 for the row above (32x64 0.391,
    # 64x32 0.406, 128x32 0.455; results/bias_tiles_h100_20261125.txt). Since the diagonal
    # sums rotate the tile (backward template 12), 4 warps and 2 stages: 0.153 ms against
    # 0.251 with 8 warps and 3 stages (64x32 0.154, 32x32 0.227, 32x64 0.255; H200,
    # results/small_attention_h200_20261127e.txt).
    ("backward.dq:scatter", "H100", "bfloat16", 128): dict(BLOCK_M=64, BLOCK_N=64, num_warps=4, num_stages=2),
    # Once the backward dropped its bounds checks for block-aligned lengths (EVEN), 128x64 ran
    # 16% slower than 64x64 on full and 6% faster on causal, 16k (results/ab_backward_even_h100_20261123.log).
    ("backward.dkdv", "H100", "bfloat16", 64): dict(BLOCK_M=64, BLOCK_N=64, num_warps=4, num_stages=2),
    ("backward.dkdv", "H100", "bfloat16", 128): dict(BLOCK_M=64, BLOCK_N=64, num_warps=4, num_stages=2),  # 0%
    # Head dim 256, measured on an H200 (results/tune_h200_20261129_d256.json; 16 heads x 16k, full
    # and causal): the DEFAULTS' 32 x 32 tiles with one stage took 32.1 / 30.7 ms (dQ) and 57.0 /
    # 29.2 ms (dK/dV); these 11.0 / 5.8 and 24.2 / 11.8 (a backward 2.5x / 3.4x faster).
    ("backward.dq", "H100", "bfloat16", 256): dict(BLOCK_M=128, BLOCK_N=32, num_warps=8, num_stages=3),
    ("backward.dkdv", "H100", "bfloat16", 256): dict(BLOCK_M=64, BLOCK_N=32, num_warps=4, num_stages=2),
}


# GPUs built on another's compute die (the same SMs, shared memory and register file, so the
# same best tiles; memory and clocks differ) take its rows where the table has none of their
# own: an H200 is an H100's GH100 die with HBM3e.
SAME_DIE = {"H200": "H100", "H800": "H100", "GH200": "H100"}


def gpu_name(device: torch.device) -> str:
    """A short name for the GPU ("H100", "H200", "A100"), else its architecture ("sm90")."""
    return _gpu_name(device.index if device.index is not None else torch.cuda.current_device())


@functools.lru_cache(maxsize=None)
def _gpu_name(index: int) -> str:
    found = re.search(r"\b([A-Z]{1,2}\d{2,3}[A-Z]?)\b", torch.cuda.get_device_name(index))
    if found:
        return found.group(1)
    major, minor = torch.cuda.get_device_capability(index)
    return f"sm{major}{minor}"


def transcendental(expr) -> bool:
    """Whether a canonical score_mod uses tanh, exp, log, ...: such mods keep more values live
    per score element (tanh's temporaries, say), the widest tiles spill for them, so they
    have rows of their own. (Recorded when the mod is lowered: no sympy on later calls.)"""
    import sympy
    return bool(expr.has(sympy.tanh, sympy.exp, sympy.log, sympy.sin, sympy.cos, sympy.tan,
                         sympy.atan, sympy.sinh, sympy.cosh, sympy.erf))


def forward_kernel(score, mask, has_block_mask: bool = True) -> tuple:
    """The table's names for a forward kernel with these lowered mods (either may be None), most
    specific first (``table_row`` takes the first with a row): "forward:mask_loads" (a mask_mod
    reading captured tensors), "forward:terms" (a score_mod taken as key and row terms, ALiBi),
    "forward:transcendental" (a score_mod with tanh, exp, ...), then "forward:dense" without a
    block mask (every kv tile full: no mask pass), then "forward"."""
    names = []
    if mask is not None and not mask.is_true and mask.buffers:
        names.append("forward:mask_loads")
    if score is not None and score.terms is not None:
        names.append("forward:terms")
    if score is not None and score.transcendental:
        names.append("forward:transcendental")
    if not has_block_mask:
        names.append("forward:dense")
    return tuple(names) + ("forward",)


def table_row(kernel, head_dim: int, dtype: str, device: torch.device) -> dict:
    """The configuration the table gives a kernel (before clamping to sparse blocks).

    ``kernel``: a name, or names most specific first (``forward_kernel``); ``dtype`` is the
    spec's name for it: "bfloat16", "float16" or "float32". A variant
    ("forward:transcendental") without a row of its own uses the next name's, else its kernel's.
    """
    names = (kernel,) if isinstance(kernel, str) else tuple(kernel)
    base = names[-1].split(":")[0]
    if device.type != "cuda":
        return dict(DEFAULTS[base]["cpu"])
    padded = pad_head_dim(head_dim)
    gpu = gpu_name(device)
    # fp16 and bf16 tiles cost the same: one stands in for the other.
    for name in dict.fromkeys(names + (base,)):
        for chip in dict.fromkeys((gpu, SAME_DIE.get(gpu, gpu))):
            for dt in (dtype, {"bfloat16": "float16", "float16": "bfloat16"}.get(dtype)):
                row = TUNED.get((name, chip, dt, padded))
                if row is not None:
                    return dict(row)
    if dtype == "float32" and (base, padded) in FLOAT32:
        return dict(FLOAT32[(base, padded)])
    return dict(next(DEFAULTS[base][d] for d in (64, 128, 256) if head_dim <= d))


def options(kernel, head_dim: int, dtype: str, device: torch.device,
            sparse_q: int, sparse_kv: int) -> dict:
    """BLOCK_M, BLOCK_N, num_warps, num_stages for a kernel, tiles clamped to the sparse blocks."""
    opts = table_row(kernel, head_dim, dtype, device)
    opts["BLOCK_M"] = min(opts["BLOCK_M"], sparse_q)
    opts["BLOCK_N"] = min(opts["BLOCK_N"], sparse_kv)
    return opts


# ---------------------------------------------------------------------------- autotuning

_ACTIVE = [os.environ.get("FLEXGEN_AUTOTUNE") == "1"]
_LOCK = threading.RLock()
_STORED: dict | None = None          # the disk file's entries, loaded on first need
_CHOSEN: dict = {}                   # (spec key, bucket, autotune on) -> the spec to launch
STORE_NAME = "autotune.json"
STORE_VERSION = 1


@contextlib.contextmanager
def autotune(enabled: bool = True):
    """Search tile configurations for kernels first launched inside the block (CUDA only).

    Each new (kernel, GPU, size bucket) times every candidate configuration on
    its inputs, shows progress on stderr and stores the winner in the cache
    directory; later calls, in this process or another, launch the winner.
    """
    with _LOCK:
        old, _ACTIVE[0] = _ACTIVE[0], enabled
    try:
        yield
    finally:
        with _LOCK:
            _ACTIVE[0] = old


def _pow2(n: int) -> int:
    return 1 << max(0, int(n) - 1).bit_length()


def _bucket(inputs) -> tuple:
    """Sizes that change the best tiles: lengths and batch x heads, rounded up to powers of two."""
    query, key = inputs["q"], inputs["k"]
    B, H, q_len = query.shape[:3]
    return _pow2(q_len), _pow2(key.shape[2]), _pow2(B * H)


def _tile_free_key(spec: KernelSpec) -> str:
    return dataclasses.replace(spec, block_m=0, block_n=0, num_warps=0, num_stages=0).key


def _store_key(spec: KernelSpec, device, bucket) -> str:
    return f"{_tile_free_key(spec)}|{gpu_name(device)}|{'x'.join(map(str, bucket))}"


def _with(spec: KernelSpec, config: dict) -> KernelSpec:
    return dataclasses.replace(spec, **{FIELDS[k]: v for k, v in config.items()})


def _valid(config, sparse) -> bool:
    """A stored configuration is used only if it is one the candidates could have produced."""
    if not isinstance(config, dict) or set(config) != set(FIELDS):
        return False
    if not all(type(v) is int for v in config.values()):
        return False
    for k, block in (("BLOCK_M", sparse[0]), ("BLOCK_N", sparse[1])):
        v = config[k]
        if not (16 <= v <= 256 and v & (v - 1) == 0 and block % v == 0):
            return False
    return config["num_warps"] in (1, 2, 4, 8, 16) and 1 <= config["num_stages"] <= 8


def _store_path():
    """``autotune.json`` in the cache directory, or None when there is no usable directory."""
    from ..codegen.cache import _private_dir
    folder = _private_dir()
    return None if folder is None else folder / STORE_NAME


def _load_store() -> dict:
    """The stored winners. A missing, malformed or untrusted file counts as empty: the
    store is read by the cache's rule for its files (a regular file of the user's
    that no one else can write; a symlink is not followed)."""
    global _STORED
    if _STORED is None:
        from ..codegen.cache import _read_private
        path = _store_path()
        data = None if path is None else _read_private(path)
        _STORED = {}
        if data is not None:
            try:
                parsed = json.loads(data)
                entries = parsed["entries"] if parsed.get("version") == STORE_VERSION else {}
                _STORED = {k: v for k, v in entries.items()
                           if isinstance(k, str) and isinstance(v, dict)}
            except (ValueError, TypeError, KeyError, AttributeError):
                pass
    return _STORED


def _save_winner(key: str, entry: dict) -> None:
    from ..codegen.cache import _write_atomically
    with _LOCK:
        stored = _load_store()
        stored[key] = entry
        path = _store_path()
        if path is None:          # no usable cache directory: the cache has warned once
            return
        try:
            _write_atomically(path, json.dumps(
                {"version": STORE_VERSION, "entries": stored}, indent=1, sort_keys=True))
        except OSError as e:     # a read-only cache still tunes, it just cannot remember
            print(f"flexgen autotune: could not store the winner ({e})", file=sys.stderr)


def candidates(spec: KernelSpec, sparse) -> list:
    """The configurations the autotuner tries for ``spec`` (tiles dividing the sparse blocks)."""
    big_head = max(spec.qk_head, spec.v_head) > 128
    found = []
    for block_m in (32, 64, 128):
        for block_n in (32, 64, 128):
            if sparse[0] % block_m or sparse[1] % block_n:
                continue
            if big_head and block_m * block_n > 64 * 64:
                continue              # 256-wide heads: larger tiles cannot fit in shared memory
            for num_warps in (4, 8):
                if num_warps == 8 and block_m < 64:
                    continue
                for num_stages in (2, 3, 4):
                    found.append(dict(BLOCK_M=block_m, BLOCK_N=block_n, num_warps=num_warps,
                                      num_stages=num_stages))
    return found


def smaller(spec: KernelSpec) -> KernelSpec | None:
    """The next configuration to try when ``spec``'s tiles do not fit, or None.

    Fewer pipeline stages first (they cost least), then narrower key tiles,
    then fewer query rows. Only forward and backward kernels: their tiles are
    free as long as they divide the sparse blocks, which halving keeps (and
    linear attention's, ``_smaller_linear``).
    """
    if spec.template == "linear":
        return _smaller_linear(spec)
    if spec.template not in ("forward", "backward"):
        return None
    if spec.num_stages > 2:
        return dataclasses.replace(spec, num_stages=spec.num_stages - 1)
    if spec.block_n > 32:
        return dataclasses.replace(spec, block_n=spec.block_n // 2)
    if spec.block_m > 32:
        return dataclasses.replace(spec, block_m=spec.block_m // 2, num_warps=min(spec.num_warps, 4))
    if spec.num_stages > 1:
        return dataclasses.replace(spec, num_stages=1)
    return None


def _smaller_linear(spec: KernelSpec) -> KernelSpec | None:
    """Linear attention's state, output and grad kernels (fp32 inputs or a 256 head dim can
    overflow the shared memory of tiles measured on bf16 and D=128): fewer stages, then a
    narrower key slice (state, output), then a narrower value slice. Never the chunk: the
    kernels of one call must agree on it."""
    from ..codegen.spec import pad_head_dim
    if spec.part not in ("state", "output", "grad"):
        return None
    if spec.num_stages > 2:
        return dataclasses.replace(spec, num_stages=spec.num_stages - 1)
    if spec.part != "grad" and (spec.block_k or pad_head_dim(spec.qk_head)) > 16:
        return dataclasses.replace(spec, block_k=(spec.block_k or pad_head_dim(spec.qk_head)) // 2)
    if spec.block_n > 16:
        return dataclasses.replace(spec, block_n=spec.block_n // 2)
    if spec.num_stages > 1:
        return dataclasses.replace(spec, num_stages=1)
    return None


def tunable(spec: KernelSpec) -> bool:
    """Kernels that give the same result when launched again (no atomic accumulation)."""
    return not getattr(spec, "scatters", ())


def choose(spec: KernelSpec, device: torch.device, inputs, sparse, launch) -> KernelSpec:
    """The spec to launch: a stored winner, a fresh search (autotune mode), or ``spec`` itself.

    ``launch(spec)`` runs the kernel of a spec on the call's inputs.
    """
    bucket = _bucket(inputs)
    # Autotune mode is part of the key: a bucket launched as is before may be searched after.
    memo = (spec.key, bucket, _ACTIVE[0])
    chosen = _CHOSEN.get(memo)
    if chosen is not None:
        return chosen
    with _LOCK:
        key = _store_key(spec, device, bucket)
        entry = _load_store().get(key)
        if isinstance(entry, dict) and _valid(entry.get("config"), sparse):
            chosen = _with(spec, entry["config"])
        elif _ACTIVE[0] and tunable(spec):
            config, ms, timings = _search(spec, device, sparse, launch)
            chosen = _with(spec, config)
            _save_winner(key, {"config": config, "ms": ms, "kernel": spec.kernel_name,
                               "gpu": gpu_name(device), "bucket": list(bucket),
                               "timings": timings})
        if len(_CHOSEN) > 4096:
            _CHOSEN.clear()
        if chosen is None:
            chosen = _CHOSEN[memo] = spec     # no winner, no search: the table's choice, this mode only
        else:
            # A winner holds in both modes: one spec object, whose key is hashed once.
            _CHOSEN[(spec.key, bucket, True)] = _CHOSEN[(spec.key, bucket, False)] = chosen
    return chosen


def needs_lookup() -> bool:
    """Whether launches should ask ``choose`` at all (autotune on, or winners on disk)."""
    return _ACTIVE[0] or bool(_load_store())


def _progress(total: int, label: str):
    try:
        from tqdm import tqdm
        return tqdm(total=total, desc=label, file=sys.stderr, leave=False)
    except ImportError:
        return _Bar(total, label)


class _Bar:
    """A one-line progress bar for when tqdm is not installed."""

    def __init__(self, total, label):
        self.total, self.label, self.done, self.postfix = total, label, 0, ""

    def update(self, n=1):
        self.done += n
        width = 30
        filled = width * self.done // max(self.total, 1)
        sys.stderr.write(f"\r{self.label} [{'#' * filled}{'.' * (width - filled)}] "
                         f"{self.done}/{self.total} {self.postfix}")
        sys.stderr.flush()

    def set_postfix_str(self, text):
        self.postfix = text

    def close(self):
        sys.stderr.write("\n")
        sys.stderr.flush()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


def _search(spec: KernelSpec, device, sparse, launch) -> tuple:
    """(fastest configuration, its median ms, every [configuration, ms]) over the candidates.

    A candidate that does not compile or run (too much shared memory) times as None.
    """
    import triton.testing

    configs = candidates(spec, sparse)
    current = {k: getattr(spec, f) for k, f in FIELDS.items()}
    if current not in configs:
        configs.insert(0, current)
    best, best_ms, timings = current, math.inf, []
    with _progress(len(configs), f"flexgen autotune {spec.kernel_name}") as bar:
        for config in configs:
            candidate = _with(spec, config)
            try:
                launch(candidate)                   # compiles; a config that cannot fit fails here
                ms = triton.testing.do_bench(lambda: launch(candidate), warmup=5, rep=20)
            except Exception as e:                  # noqa: BLE001 - out of resources, compile error
                if "out of resource" not in str(e).lower() and "shared memory" not in str(e).lower():
                    print(f"\nflexgen autotune: {config} failed: {type(e).__name__}: {e}", file=sys.stderr)
                ms = math.inf
            timings.append([config, None if ms == math.inf else ms])
            if ms < best_ms:
                best, best_ms = config, ms
            bar.set_postfix_str(f"best {best_ms:.3f} ms {best}")
            bar.update(1)
    return best, (None if best_ms == math.inf else best_ms), timings


__all__ = ["autotune", "options", "table_row", "candidates", "choose", "gpu_name", "TUNED",
           "DEFAULTS", "KERNELS"]
