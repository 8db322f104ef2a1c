"""flexgen: fused attention kernels generated from small Python mods.

The API mirrors ``torch.nn.attention.flex_attention``::

    from flexgen import flex_attention, create_block_mask
"""
__version__ = "0.1.0"

from .errors import FlexgenError, GradientError, InputError, TraceError  # noqa: E402
from .masks.block_mask import BlockMask, create_block_mask, create_mask  # noqa: E402
from .api import AuxOutput, AuxRequest, decode_attention, flex_attention, kernel_source  # noqa: E402
from .api import sigmoid_attention, sigmoid_kernel_source, varlen_attention  # noqa: E402
from .api import linear_attention, linear_attention_decode, linear_kernel_source  # noqa: E402
from .kernels.paged import CacheFullError, PagedKVCache  # noqa: E402
from .kernels.rope import RoPE  # noqa: E402
from .mods.combinators import and_masks, noop_mask, or_masks  # noqa: E402


def __getattr__(name):
    # Loaded on first use, so ``import flexgen`` stays cheap: the tuner (it needs triton).
    if name == "autotune":
        from .runtime.tuning import autotune
        return autotune
    if name == "precompile":
        from .runtime.warmup import precompile
        return precompile
    raise AttributeError(f"module 'flexgen' has no attribute {name!r}")


def clear_caches() -> None:
    """Forget every memoized trace, lowered mod, plan, spec and loaded kernel module of this
    process, and which masks it built (the disk cache stays). For tests and long-lived processes that generate
    many one-off mods; nothing else needs it: every memo is bounded."""
    from .codegen import cache, spec
    from .frontend import bounds_check, grad, lowering, trace
    from .masks import builder
    from .runtime import launch, plan
    for clear in (trace.clear_memos, lowering.clear_memos, grad.clear_memos, bounds_check.clear_memos,
                  plan.clear_memos, spec.clear_memos, cache.clear_memos, launch.clear_memos,
                  builder.clear_memos):
        clear()


__all__ = [
    "flex_attention", "create_block_mask", "create_mask", "BlockMask", "kernel_source",
    "decode_attention", "PagedKVCache", "CacheFullError", "AuxRequest", "AuxOutput",
    "and_masks", "or_masks", "noop_mask", "FlexgenError", "InputError", "TraceError", "GradientError",
    "autotune", "clear_caches", "sigmoid_attention", "sigmoid_kernel_source",
    "linear_attention", "linear_attention_decode", "linear_kernel_source", "varlen_attention",
    "RoPE", "precompile",
]
