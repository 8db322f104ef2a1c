"""Launch the forward kernel of a planned ``flex_attention`` call.

``run_forward`` allocates the outputs (in the query's stride order), picks the
pointer variant where a TMA plan meets a base TMA cannot address, and launches
through ``flexgen.runtime.launch``; a repeated call with the same plan and the same
other tensors replays the previous launch with its new leading tensors
(``launch.Replay``, ``replay``).
"""
from __future__ import annotations

import torch

from triton.compiler.errors import CompilationError

from ..codegen.spec import tma_addressable
from ..errors import expected
from ..runtime import launch, tuning
from ..runtime.poison import poison


def broadcast_lists(lists, B: int, H: int) -> tuple:
    """Four block-mask lists as ``[B, H, ...]`` views (a batch or head of 1 broadcasts)."""
    return tuple(t if t.shape[0] == B and t.shape[1] == H else t.expand(B, H, *t.shape[2:])
                 for t in lists)


def run_forward(plan, query, key, value, score_buffers, mask_buffers, block_lists, want_max=False,
                bias=None):
    """(out [B, Hq, Lq, Dv], lse [B, Hq, Lq] float32, max scores like lse or an empty tensor).

    With ``bias`` (sigmoid attention: the plan's specs have the sigmoid activation) there is
    no LSE: (out, None, an empty tensor)."""
    B, Hq, Lq = plan.B, plan.Hq, plan.Lq
    device = query.device
    sigmoid = bias is not None
    if key.shape[0] != B:                     # key / value shared by every query row
        key, value = key.expand(B, *key.shape[1:]), value.expand(B, *value.shape[1:])
    out = torch.empty_strided((B, Hq, Lq, plan.Dv), plan.out_strides, dtype=plan.dtype, device=device)
    lse = None if sigmoid else torch.empty(B, Hq, Lq, dtype=torch.float32, device=device)
    max_scores = torch.empty(B, Hq, Lq, dtype=torch.float32, device=device) if want_max else None
    poison(out, lse, max_scores)
    # The leading kernel arguments a replay swaps in: Q, K, V, OUT, and for softmax LSE and
    # MAX (LSE again when not asked for); the bias is a launch argument like the buffers.
    if sigmoid:
        leading, extra = (query, key, value, out), dict(bias=bias)
    else:
        leading, extra = (query, key, value, out, lse, lse if max_scores is None else max_scores), {}
    others = replay_key(score_buffers, mask_buffers, block_lists[:4], *extra.values())
    # Only the plan's own kernel replays (not its pointer variant, nor a fallback's), so a
    # replay needs no TMA check: the plan fixes the layouts of Q, K, V and OUT, and the
    # Replay declines tensors whose 16-byte alignment differs from its launch's, whose
    # tensors passed the check (~4 tensors' checks a call, ~2 us on the dev CPU).
    if not replay(plan, others, leading):
        spec = plan.spec
        if spec.use_tma and not all(map(tma_addressable, (query, key, value, out))):
            spec = plan.pointer_spec
        origins = tuple(t for t in (*score_buffers, *mask_buffers, *block_lists[:4], *extra.values())
                        if isinstance(t, torch.Tensor))
        # (Only a launch reads the lists broadcast to [B, H]: a replay has their addresses.)
        sparse = None
        if plan.mask_info is not None:
            sparse = (*broadcast_lists(block_lists[:4], B, Hq), *plan.mask_info.block_size)
        inputs = dict(q=query, k=key, v=value, out=out, lse=lse, sparse=sparse,
                      score_buffers=score_buffers, mask_buffers=mask_buffers, scale=plan.scale,
                      max_scores=max_scores, **extra)
        try:
            launched = launch.run(spec, device, inputs, tune_blocks=plan.tune_blocks,
                                  replay=leading, origins=origins)
        except CompilationError as err:
            if spec.template != "forward_gluon":
                raise
            spec = _gluon_failed(plan, err)
            launched = launch.run(spec, device, inputs, replay=leading, origins=origins)
        if spec is plan.spec:
            remember(plan, others, launched)
    return out, lse, _placeholder(max_scores, device)


def _gluon_failed(plan, err):
    """The Gluon kernel did not compile with this Triton (its API moves between releases):
    under BACKEND "gluon" an InputError saying so; under AUTO the plan falls back to the tl
    kernel for good (returned), so later calls do not try again."""
    if plan.options.BACKEND == "gluon":
        import triton
        raise expected("kernel_options['BACKEND']", "'gluon' where the Gluon kernel compiles",
                       f"a compile error with Triton {triton.__version__}: {str(err)[-400:]}",
                       "use BACKEND 'AUTO' or 'tl' (the Triton-language kernel)") from err
    plan.spec, plan.tl_spec = plan.tl_spec, None
    plan.tune_blocks = (plan.mask_info.block_size if plan.mask_info is not None else (128, 128))
    plan.replays.clear()
    return plan.spec


MAX_REPLAYS = 32           # per plan: where the other tensors lie (and which kernel) -> Replay


def replay_key(score_buffers, mask_buffers, lists, *extra) -> tuple:
    """What a launch passes besides the tensors it swaps in and what the plan fixes (shapes,
    strides, dtypes, scale): where the captured tensors and block lists it reads lie (address,
    dtype, shape, strides). A replay launches at those addresses, so it reads whatever tensors
    lie there now, as a launch would: keyed by identity instead, every call of a compiled graph
    (whose views of one mask buffer are new objects each time) launched anew."""
    # (One comprehension, no function call per tensor: a training call keys twelve.)
    return tuple([None if t is None else (t.data_ptr(), t.dtype, t.shape, t.stride())
                  for t in (*score_buffers, None, *mask_buffers, None, *lists)]) + extra


def replay(plan, key, fresh) -> bool:
    """Relaunch the plan's launch kept under ``key`` with the call's ``fresh`` tensors (False
    where there is none, or the Replay declines: then launch as usual). ``key``: the forward's
    ``replay_key`` (the backward keeps its kernels' replays by its own keys: backward._Launcher)."""
    found = plan.replays.get(key)
    return found is not None and not tuning.needs_lookup() and found(*fresh)


def remember(plan, key, launched) -> None:
    """Keep ``launched`` (a Replay, a backward call's replays by kernel name, or None) for the
    next call with the same ``key``."""
    if launched is not None:
        if len(plan.replays) >= MAX_REPLAYS:
            plan.replays.clear()
        plan.replays[key] = launched


def _placeholder(t, device) -> torch.Tensor:
    """``t``, or an empty tensor for an output the call did not ask for (ops return fixed outputs)."""
    return t if t is not None else torch.empty(0, dtype=torch.float32, device=device)
