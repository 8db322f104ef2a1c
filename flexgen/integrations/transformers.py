"""flexgen as a Hugging Face transformers attention backend: ``attn_implementation="flexgen"``.

    import flexgen.integrations.transformers as flexgen_hf
    flexgen_hf.register()
    model = AutoModelForCausalLM.from_config(config, attn_implementation="flexgen")

transformers 5 looks an attention up by name twice: the model builds its masks through
``AttentionMaskInterface`` (``create_causal_mask``, ``create_sliding_window_causal_mask``:
one mask per layer type) and each attention layer calls the function registered in
``AttentionInterface``. ``register()`` puts flexgen in both:

- ``flexgen_mask`` turns HF's ``mask_function`` (a closure of ``causal_mask_function``,
  ``sliding_window_overlay``, ... that flexgen's tracer reads like any mask_mod) into a
  ``flexgen.BlockMask``, with the 2-D padding mask folded in and the cache offsets added,
  as HF's own ``flex_attention_mask`` does for torch's FlexAttention;
- ``flexgen_attention_forward`` runs ``flexgen.flex_attention`` on that mask, with Gemma 2's
  logit soft-capping as a score_mod, GQA without repeating K/V, and attention sinks
  (``s_aux``, GPT-OSS) applied through the returned log-sum-exp.

Nothing here reads a tensor's values on the host (no ``.item()``, no ``if`` on a tensor), so
a model runs under ``torch.compile(fullgraph=True)`` and decode steps need no sync.
transformers is imported only by ``register()``.
"""
from __future__ import annotations

import torch

from ..api import flex_attention
from ..errors import FlexgenError, expected, reported
from ..masks.block_mask import LIST_NAMES, BlockMask, _is_torch_block_mask, create_block_mask
from ..mods.softcap import tanh_softcap

NAME = "flexgen"


def register() -> str:
    """Register flexgen with transformers as ``attn_implementation="flexgen"``; returns the name.

    Call it once before building a model (``from_pretrained`` / ``from_config(...,
    attn_implementation="flexgen")``); calling it again changes nothing. Needs transformers 5
    (``pip install "flexgen[hf]"``); raises ``flexgen.FlexgenError`` without it.
    """
    try:
        import transformers
        from transformers import AttentionInterface
        from transformers.masking_utils import AttentionMaskInterface
    except ImportError as exc:
        raise FlexgenError(
            "flexgen.integrations.transformers.register(): transformers >= 5 is not installed "
            f"({exc}). Fix: pip install 'flexgen[hf]' (or pip install 'transformers>=5')") from None
    major = int(transformers.__version__.split(".")[0])
    if major < 5:
        raise FlexgenError(
            f"flexgen.integrations.transformers.register(): expected transformers >= 5, got "
            f"{transformers.__version__}. Fix: pip install -U 'transformers>=5'")
    AttentionInterface.register(NAME, flexgen_attention_forward)
    AttentionMaskInterface.register(NAME, flexgen_mask)
    return NAME


# ---------------------------------------------------------------------------------- masks

def flexgen_mask(batch_size: int, q_length: int, kv_length: int, q_offset=0, kv_offset=0,
                 mask_function=None, attention_mask: torch.Tensor | None = None,
                 device="cpu", **kwargs) -> BlockMask:
    """HF's mask interface for flexgen: the ``flexgen.BlockMask`` ``[batch_size, 1, q_length,
    kv_length]`` of ``mask_function`` (default causal) where query ``i`` is position
    ``q_offset + i`` and key ``j`` position ``kv_offset + j``.

    ``attention_mask`` (bool ``[batch_size, seen + q_length]``, True for real tokens) hides
    padded keys; it is padded with False up to the keys' end, which hides the unused slots
    of a static cache. It is always folded in: asking whether it has any padding would read
    it on the host. The other arguments HF passes (``dtype``, ``config``, ...) do not matter.
    """
    from transformers.masking_utils import (add_offsets_to_mask_function, and_masks,
                                            causal_mask_function, padding_mask_function,
                                            prepare_padding_mask)
    if isinstance(attention_mask, BlockMask):
        # generate() with a static cache prepares the masks before the forward, which hands
        # them back here: built already (for this step, with the cache's offsets).
        return attention_mask
    if mask_function is None:
        mask_function = causal_mask_function
    if attention_mask is not None:
        padding = prepare_padding_mask(attention_mask, kv_length, kv_offset)
        mask_function = and_masks(mask_function, padding_mask_function(padding))
    # The offsets enter the mask as 0-d tensors, runtime scalars of the kernels: as Python
    # ints they would be constants of the mask's program, and every decode step (a new
    # offset) would compile a new kernel. Without a cache (training, a first prefill) they
    # are the int 0 and the mask is HF's function itself: captures no tensor, so the same
    # lists come back for every step (create_block_mask), and the kernels' partial tiles
    # read no offsets.
    device = torch.device(device)
    if not (_is_int_zero(q_offset) and _is_int_zero(kv_offset)):
        mask_function = add_offsets_to_mask_function(mask_function, _scalar(q_offset, device),
                                                     _scalar(kv_offset, device))
    mask = create_block_mask(mask_function, batch_size, None, q_length, kv_length, device=device)
    return GenerationBlockMask(*(getattr(mask, n) for n in LIST_NAMES), mask.BLOCK_SIZE,
                               mask.mask_mod, mask.seq_lengths)


class GenerationBlockMask(BlockMask):
    """The ``flexgen.BlockMask`` handed to transformers. ``generate()`` with a static cache
    prepares each step's masks ahead of the forward and treats them like 4-D tensors: it calls
    ``.contiguous()`` (a block mask's lists are laid out for the kernels already: it is its
    own contiguous form) and the model's mask code reads ``.ndim`` (4, as ``shape`` says)
    before handing the mask to ``flexgen_mask`` again."""

    ndim = 4

    def contiguous(self) -> "GenerationBlockMask":
        return self


def _is_int_zero(offset) -> bool:
    return not isinstance(offset, torch.Tensor) and offset == 0


def _scalar(offset, device) -> torch.Tensor:
    """``offset`` (an int or a 0-d integer tensor) as a new int32 0-d tensor on ``device``.

    An int is written by a fill on the device (its value travels as a kernel argument: no
    host-to-device copy to wait for). A tensor is copied: a static cache's offset is its
    length counter, which each layer's cache update increments in place after the mask is
    built, and partial blocks read the offset only when attention runs.
    """
    if isinstance(offset, torch.Tensor):
        return offset.to(device=device, dtype=torch.int32, copy=True).reshape(())
    return torch.full((), offset, dtype=torch.int32, device=device)


# ---------------------------------------------------------------------------------- attention

def flexgen_attention_forward(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor,
                              value: torch.Tensor, attention_mask, scaling: float | None = None,
                              softcap: float | None = None, s_aux: torch.Tensor | None = None,
                              position_bias: torch.Tensor | None = None, dropout: float = 0.0,
                              **kwargs) -> tuple[torch.Tensor, None]:
    """HF's attention interface for flexgen: query ``[B, Hq, Lq, D]``, key / value
    ``[B, Hkv, Lkv, D]`` (Hq a multiple of Hkv) -> (output ``[B, Lq, Hq, D]``, None).

    ``attention_mask`` is what the model's mask interface built: a ``flexgen.BlockMask``
    (``flexgen_mask``) or a torch one; a 4-D tensor a caller passed instead (bool: True keeps;
    float: added to the scores) or None (causal when the module is causal and Lq > 1, as
    SDPA does). ``softcap`` becomes ``softcap * tanh(score / softcap)`` (Gemma 2),
    ``position_bias`` ``[B, H, Lq, Lkv]`` is added to the scores, ``s_aux`` ``[Hq]`` (a learned
    logit per head that joins the softmax's denominator only: GPT-OSS's sinks) rescales
    the output by ``exp(lse - logaddexp(lse, s_aux))``. Attention dropout, ``head_mask`` and
    ``output_attentions`` raise ``flexgen.FlexgenError``: the kernels have no dropout and
    never form the attention weights. The second output (the weights) is always None.
    """
    _refuse_unsupported(module, dropout, kwargs)
    Lq, Lkv = query.shape[2], key.shape[2]
    block_mask, bias = None, None
    if isinstance(attention_mask, BlockMask) or _is_torch_block_mask(attention_mask):
        block_mask = attention_mask
    elif isinstance(attention_mask, torch.Tensor):
        if attention_mask.dim() != 4:
            raise reported(expected(
                "attention_mask", "a BlockMask or a 4-D mask [B, 1 or H, Lq, Lkv] at the attention "
                "layer", f"a tensor of shape {list(attention_mask.shape)}",
                "pass the 2-D padding mask to the model and let it build the mask"))
        # A mask prepared for a longer cache (HF slices it the same way).
        attention_mask = attention_mask[:, :, :, :Lkv]
        if attention_mask.dtype == torch.bool:
            block_mask = _dense_block_mask(attention_mask, Lq, Lkv)
        else:
            bias = attention_mask
    elif attention_mask is None:
        is_causal = kwargs.get("is_causal")
        if is_causal is None:
            is_causal = getattr(module, "is_causal", True)
        if is_causal and Lq > 1:
            block_mask = _causal_block_mask(Lq, Lkv, query.device)
    else:
        raise reported(expected("attention_mask", "a BlockMask, a 4-D tensor or None",
                                type(attention_mask).__name__,
                                'build the model with attn_implementation="flexgen" after '
                                "flexgen.integrations.transformers.register()"))
    score_mod = _score_mod(softcap, bias, position_bias)
    want_lse = s_aux is not None
    result = flex_attention(query, key, value, score_mod=score_mod, block_mask=block_mask,
                            scale=scaling, enable_gqa=query.shape[1] != key.shape[1],
                            return_lse=want_lse, kernel_options=kwargs.get("kernel_options"))
    if want_lse:
        out, lse = result
        # softmax over [scores, s_aux]: the scores' weights shrink by exp(lse) / (exp(lse) +
        # exp(s_aux)). A row that sees no key has lse = -inf: factor 0, output 0 (as eager).
        sinks = s_aux.to(torch.float32).reshape(1, -1, 1)
        factor = torch.exp(lse - torch.logaddexp(lse, sinks))
        result = (out * factor.unsqueeze(-1)).to(query.dtype)
    return result.transpose(1, 2).contiguous(), None


def _refuse_unsupported(module, dropout, kwargs) -> None:
    if dropout:
        raise reported(expected(
            "dropout", "0.0 (flexgen's kernels have no attention dropout)", dropout,
            "set config.attention_dropout = 0.0 before building the model, or train with "
            'attn_implementation="eager"'))
    if kwargs.get("head_mask") is not None:
        raise reported(expected(
            "head_mask", "None (flexgen's kernels do not scale heads)", "a tensor",
            'scale the attention output yourself, or use attn_implementation="eager"'))
    if kwargs.get("cache") is not None:
        # Continuous batching (generate_batch) hands each attention its paged cache to
        # update and read; flexgen's attention does not know HF's page layout.
        raise reported(expected(
            "cache", "None (flexgen does not read transformers' paged cache)",
            type(kwargs["cache"]).__name__,
            'use generate() for flexgen, or attn_implementation="sdpa" for continuous batching'))
    if kwargs.get("output_attentions"):
        raise reported(expected(
            "output_attentions", "False (flexgen never forms the attention weights)", True,
            'load the model with attn_implementation="eager" to look at attention weights'))


_SOFTCAPS: dict = {}


def _softcap_mod(cap: float):
    """One function object per cap, so that flexgen's trace memo reuses one trace for every
    layer and step (torch.compile traces the mod afresh anyway)."""
    if torch.compiler.is_compiling():
        return tanh_softcap(cap)
    mod = _SOFTCAPS.get(cap)
    if mod is None:
        mod = _SOFTCAPS[cap] = tanh_softcap(cap)
    return mod


def _at(t, b, h, q_idx, kv_idx):
    """``t[b, h, q_idx, kv_idx]`` of a 4-D tensor whose batch or head dim may broadcast."""
    return t[b if t.shape[0] > 1 else 0, h if t.shape[1] > 1 else 0, q_idx, kv_idx]


def _score_mod(softcap, bias, position_bias):
    """The score_mod of HF's per-call extras, or None when there are none."""
    if bias is None and position_bias is None:
        return None if softcap is None else _softcap_mod(float(softcap))
    added = tuple(t for t in (bias, position_bias) if t is not None)

    def hf_score_mod(score, b, h, q_idx, kv_idx):
        if softcap is not None:
            score = softcap * torch.tanh(score / softcap)
        for t in added:
            score = score + _at(t, b, h, q_idx, kv_idx)
        return score

    return hf_score_mod


def _dense_block_mask(mask, Lq, Lkv) -> BlockMask:
    def hf_dense_mask(b, h, q_idx, kv_idx):
        return _at(mask, b, h, q_idx, kv_idx)

    B, H = mask.shape[:2]
    return create_block_mask(hf_dense_mask, B if B > 1 else None, H if H > 1 else None, Lq, Lkv,
                             device=mask.device)


def _causal_block_mask(Lq, Lkv, device) -> BlockMask:
    # The queries are the last Lq of the Lkv positions (what a cache means; the same as
    # SDPA's is_causal whenever Lq == Lkv). A runtime scalar, as in flexgen_mask.
    offset = _scalar(Lkv - Lq, device)

    def hf_causal_mask(b, h, q_idx, kv_idx):
        return kv_idx <= q_idx + offset

    return create_block_mask(hf_causal_mask, None, None, Lq, Lkv, device=device)


__all__ = ["register", "flexgen_attention_forward", "flexgen_mask", "NAME"]
