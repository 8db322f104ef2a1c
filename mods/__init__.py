"""Ready-made score_mods and mask_mods (``flexgen.mods``).

One small file per family, each a factory that checks its parameters and
returns a mod with torch FlexAttention's signature:
``score_mod(score, b, h, q_idx, kv_idx) -> score`` or
``mask_mod(b, h, q_idx, kv_idx) -> bool``. Every mod obeys flexgen's
tracing rules, so it compiles to a kernel; each also runs unchanged on
plain int32 index tensors (``flexgen.reference``) and in
``torch.nn.attention.flex_attention``.

    from flexgen.mods import and_masks, causal_mask, document_mask, tanh_softcap
    mask_mod = and_masks(causal_mask, document_mask(doc_ids))
    score_mod = tanh_softcap(50.0)

Each mask module's docstring draws its mask as a small text picture (█ kept,
· masked; a test keeps them true). To see any mask_mod at a real size with
the blocks a kernel visits, build a small BlockMask and plot it (needs
matplotlib): ``create_block_mask(mask_mod, 1, 1, 128, 128, BLOCK_SIZE=16).plot()``.
examples/03_mask_gallery.ipynb shows every mask of this package that way.
"""
from .alibi import alibi, alibi_slopes
from .block_causal import block_causal
from .causal import causal, causal_lower_right, causal_mask
from .chunked import chunked_local
from .combinators import and_masks, compose_score_mods, noop_mask, or_masks
from .dilated import dilated_sliding_window
from .document import doc_ids_from_lengths, doc_ids_from_offsets, document_mask
from .neighborhood import neighborhood_2d
from .padding import kv_padding, q_padding
from .prefix_lm import prefix_lm
from .relative_bias import relative_position_bias, t5_relative_bias
from .sliding_window import sliding_window
from .softcap import tanh_approx, tanh_softcap
from .streaming import attention_sinks

__all__ = [
    "alibi", "alibi_slopes", "and_masks", "attention_sinks", "block_causal", "causal",
    "causal_lower_right", "causal_mask", "chunked_local", "compose_score_mods",
    "dilated_sliding_window", "doc_ids_from_lengths", "doc_ids_from_offsets", "document_mask",
    "kv_padding", "neighborhood_2d", "noop_mask", "or_masks", "prefix_lm", "q_padding",
    "relative_position_bias", "sliding_window", "t5_relative_bias", "tanh_approx",
    "tanh_softcap",
]
