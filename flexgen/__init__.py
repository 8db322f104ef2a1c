"""flexgen: fused attention kernels generated from small Python mods.

The API mirrors ``torch.nn.attention.flex_attention``::

    from flexgen import flex_attention, create_block_mask
"""
__version__ = "0.1.0"

from .errors import FlexgenError, InputError, TraceError  # noqa: E402
from .masks.block_mask import BlockMask, create_block_mask, create_mask  # noqa: E402
from .api import flex_attention, kernel_source  # noqa: E402
from .kernels.backward import GradientError  # noqa: E402
from .runtime.tuning import autotune  # noqa: E402
from .mods.combinators import and_masks, noop_mask, or_masks  # noqa: E402

__all__ = [
    "flex_attention", "create_block_mask", "create_mask", "BlockMask", "kernel_source",
    "and_masks", "or_masks", "noop_mask", "FlexgenError", "InputError", "TraceError", "GradientError",
    "autotune",
]
