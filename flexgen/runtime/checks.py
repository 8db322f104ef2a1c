"""Input checks shared by every attention entry point (forward, decode, paged).

Each raises ``InputError`` naming the argument, what was expected, what was
given and the fix, before anything is traced or launched.
"""
from __future__ import annotations

import torch

from ..errors import InputError, expected

DTYPES = {torch.float16: "float16", torch.bfloat16: "bfloat16", torch.float32: "float32"}


def check_tensor(name, t, layout="[B, H, L, D]"):
    """``t`` is a 4-D fp16/bf16/fp32 CUDA or CPU tensor with a head dim of 16..256."""
    if not isinstance(t, torch.Tensor):
        raise expected(name, f"a torch.Tensor {layout}", type(t).__name__, f"pass {name} as a tensor")
    if t.dim() != 4:
        raise expected(name, f"a 4-D tensor {layout}", f"shape {list(t.shape)}",
                       f"reshape {name} to {layout} (e.g. x.transpose(1, 2))")
    if t.dtype not in DTYPES:
        raise expected(name, "dtype float16, bfloat16 or float32", t.dtype,
                       f"convert with {name}.to(torch.bfloat16)")
    if t.device.type not in ("cuda", "cpu"):
        raise expected(name, "a CUDA or CPU tensor", t.device, "move it with .to('cuda') or .cpu()")
    if not 16 <= t.shape[-1] <= 256:
        raise expected(f"{name}.shape[-1] (head dim)", "a head dim from 16 to 256", t.shape[-1],
                       "pad or split the head dim")
    if t.stride(-1) != 1:
        raise expected(name, "a tensor whose last dim is contiguous", f"strides {t.stride()}",
                       f"pass {name}.contiguous()")


def check_heads(Hq: int, Hkv: int, enable_gqa: bool) -> None:
    """Query heads equal the key/value heads, or are a multiple of them with enable_gqa."""
    if Hq < 1 or Hkv < 1:
        # The kernels divide by the head counts (torch's flex_attention fails on 0 heads too).
        raise expected("query / key heads (dim 1)", "at least 1 head each", f"query {Hq}, key/value {Hkv}",
                       "skip the attention call when there are no heads (its output would be empty)")
    if Hq != Hkv:
        if not enable_gqa:
            raise expected("enable_gqa", f"True when query has {Hq} heads and key/value {Hkv}",
                           False, "pass enable_gqa=True, or repeat the key/value heads")
        if Hq % Hkv:
            raise expected("query heads", f"a multiple of the key/value heads ({Hkv})", Hq,
                           "use a head count divisible by the number of key/value heads")


def check_buffers(traced, device, like: str = "the query") -> None:
    """Every tensor a traced mod captured is on ``device``."""
    for i, t in enumerate(traced.buffers):
        if t.device != device:
            raise InputError(f"{traced.kind} '{traced.name}': captured tensor {i} (shape {list(t.shape)}) "
                             f"is on {t.device}, expected {device} like {like}. "
                             f"Fix: move it with .to('{device}')")


def may_cache(device: torch.device) -> bool:
    """Whether a tensor made now on ``device`` may be kept in a module-level cache.

    Not while torch.compile's CUDA graphs (mode="reduce-overhead") warm up or capture:
    both run on the graph manager's own stream, whose allocations belong to the graph's
    memory pool, and a tensor that outlives the graph's outputs there is refused
    ("tensors in the cudagraph pool not tracked as outputs"). Off the default stream
    nothing is cached: such a call makes its small tensors again. (The raw stream handle
    is read directly, ~0.1 us: decode steps ask on every call; the legacy default stream's
    handle is 0.)
    """
    device = torch.device(device)
    if device.type != "cuda":
        return True
    index = device.index if device.index is not None else torch._C._cuda_getDevice()
    return torch._C._cuda_getCurrentRawStream(index) == 0
