"""Planning ``linear_attention`` and ``linear_attention_decode``: the input checks, the chunked
or recurrent decode kernels' tiles and specs, and the backward's kernels (the kernels
themselves: ``flexgen.kernels.linear``). ``flexgen.runtime.plan`` re-exports these."""
from __future__ import annotations

import torch

from ..codegen.spec import dot_precision
from ..errors import expected
from ..frontend.lowering import lower
from ..frontend.trace import TracedMod
from .checks import DTYPES, check_heads
from .options import KernelOptions
from .plan_checks import check_captured, check_same_kind


# ---------------------------------------------------------------------------------- linear attention

LINEAR_STATE_DV = 16            # the state kernel's value-dim slice on a GPU (measured on the H100:
                                # 16 beat 32 and 64 at B=1, H=16, D=128 -- more programs),
LINEAR_STATE_WARPS = 4          # its warps (a [Dk, 16] float32 state tile needs few),
LINEAR_STATE_STAGES = 3         # and its pipeline depth (the next chunks' loads run ahead)
LINEAR_OUTPUT_DV = 64           # the output kernel's value-dim slice on a GPU, and its warps
LINEAR_OUTPUT_WARPS = 4         # (H100, D=128: 64 / 4 warps 0.407 ms, 128 / 8 warps 0.453 ms)
LINEAR_CHUNK = 64                # positions per chunk of the chunked kernels (kernel_options BLOCK_M)
_LINEAR: dict = {}


def _linear_tiles(options: KernelOptions, device, Dk: int, Dv: int, rows: int = 1) -> dict:
    """Chunk size, value-dim slices (state, output, grad, decode), warps and stages of the linear
    kernels; ``rows`` = batch x query heads (the decode kernel's programs per value slice)."""
    from ..codegen.spec import pad_head_dim
    gpu = device.type == "cuda"
    chunk = options.BLOCK_M or LINEAR_CHUNK
    v_pad = pad_head_dim(Dv)
    # The interpreter's cost is per operation: whole tiles there.
    block_dv = options.BLOCK_N or (min(64, v_pad) if gpu else v_pad)
    # The state kernel is one program per (batch, head, value slice) walking every chunk: thin
    # slices give the GPU more programs (16 heads x 128 / 16 = 128). The output kernel's slice
    # (64) computes φ(Q) φ(K)ᵀ of a chunk once per slice; smaller tiles measured faster.
    state_dv = options.BLOCK_N or (min(LINEAR_STATE_DV, v_pad) if gpu else v_pad)
    output_dv = options.BLOCK_N or (min(LINEAR_OUTPUT_DV, v_pad) if gpu else v_pad)
    for name, v in (("BLOCK_M", chunk), ("BLOCK_N", block_dv)):
        if v < 16 or v & (v - 1):
            raise expected(f"kernel_options[{name!r}]", "a power of two >= 16 ("
                           + ("the chunk size" if name == "BLOCK_M" else "the value-dim slice") + ")",
                           v, "use 64 (or 16 / 32 / 128)")
    warps = options.num_warps or (8 if gpu and max(Dk, Dv) > 64 else 4)
    stages = options.num_stages or (2 if gpu else 1)
    decode_dv = options.BLOCK_N or (_decode_dv(device, rows, v_pad) if gpu else v_pad)
    return dict(chunk=chunk, block_dv=min(block_dv, v_pad), state_dv=min(state_dv, v_pad),
                output_dv=min(output_dv, v_pad), warps=warps, stages=stages,
                output_warps=options.num_warps or (LINEAR_OUTPUT_WARPS if gpu else 4),
                state_warps=options.num_warps or (LINEAR_STATE_WARPS if gpu else 4),
                state_stages=options.num_stages or (LINEAR_STATE_STAGES if gpu else 1),
                decode_dv=decode_dv, decode_warps=options.num_warps or (4 if decode_dv <= 16 else warps))


def _decode_dv(device, rows: int, v_pad: int) -> int:
    """The decode kernel's value slice: it streams each state once (memory-bound), so 64-wide
    slices where the grid still gets two programs per SM, thinner ones (down to 16) where
    the batch is too small to fill the GPU. Measured on the H100 (16 heads, 128 x 128 states,
    CUDA graphs): B=64 83% of the copy bandwidth at 64 / 8 warps against 80% at 32; B=1
    3.3 us at 16 / 4 warps against 4.0 at 32 / 4."""
    from ..kernels.decode import _sm_count
    sms = _sm_count(device)
    block = min(64, v_pad)
    while block > 16 and rows * (v_pad // block) < 2 * sms:
        block //= 2
    return block


def check_linear(query, key, value, initial_state, enable_gqa, *, state_name="initial_state",
                 state_rows=None) -> None:
    """query [B, Hq, T, Dk], key [B, Hkv, T, Dk], value [B, Hkv, T, Dv], a state [rows, Hq, Dk, Dv]
    float32 (rows = B unless ``state_rows``)."""
    check_same_kind(query, key, value, "[B, H, T, D]")
    B, Hq, T, Dk = query.shape
    if key.shape[0] != B or value.shape[0] != B:
        raise expected("key/value batch", f"batch {B} like query", f"{key.shape[0]} and {value.shape[0]}",
                       "give query, key and value the same batch size")
    if key.shape[2] != T or value.shape[2] != T:
        raise expected("key/value length", f"the query's length {T} (linear attention is causal over "
                       "one sequence)", f"{key.shape[2]} and {value.shape[2]}",
                       "pass the same positions for query, key and value")
    if key.shape[1] != value.shape[1]:
        raise expected("value heads", f"the key's {key.shape[1]} heads", value.shape[1],
                       "key and value must have the same heads")
    if key.shape[3] != Dk:
        raise expected("key.shape[-1]", f"the query's head dim {Dk}", key.shape[3],
                       "query and key need the same head dim (value's may differ)")
    if B == 0 or Hq == 0 or T == 0:
        raise expected("query", "at least one batch row, head and position", f"shape {list(query.shape)}",
                       "skip the call for empty inputs")
    check_heads(Hq, key.shape[1], enable_gqa)
    if initial_state is not None:
        rows = B if state_rows is None else state_rows
        want = [rows, Hq, Dk, value.shape[3]]
        if not isinstance(initial_state, torch.Tensor) or initial_state.dim() != 4 or (
                state_rows is None and list(initial_state.shape) != want) or (
                state_rows is not None and list(initial_state.shape[1:]) != want[1:]):
            got = (f"shape {list(initial_state.shape)}" if isinstance(initial_state, torch.Tensor)
                   else type(initial_state).__name__)
            shape = f"[{rows}, {Hq}, {Dk}, {value.shape[3]}]" if state_rows is None else \
                f"[num_slots, {Hq}, {Dk}, {value.shape[3]}]"
            raise expected(state_name, f"a tensor {shape} (rows, query heads, Dk, Dv)", got,
                           "one [Dk, Dv] state per query head (enable_gqa: the query's heads)")
        if initial_state.dtype != torch.float32:
            raise expected(state_name, "a float32 tensor", initial_state.dtype, f"pass {state_name}.float()")
        if initial_state.device != query.device:
            raise expected(state_name, f"a tensor on {query.device}", initial_state.device,
                           f"{state_name}.to('{query.device}')")


def plan_linear(query, key, value, initial_state, decay_mod: str, decay_buffers, feature_map: str,
                feature_buffers, scale: float, enable_gqa: bool, options: str):
    """Check a ``linear_attention`` call and decide its kernels (memoized on what it reads):
    the recurrent decode kernel for a few positions from a given state (T <= 16), else the
    chunked ones (``flexgen.kernels.linear``)."""
    memo = (_key(query, key, value), None if initial_state is None else _key(initial_state), decay_mod,
            _key(*decay_buffers), feature_map, _key(*feature_buffers), scale, enable_gqa, options,
            dot_precision(query))
    return _memo(_LINEAR, memo, lambda: _plan_linear(
        query, key, value, initial_state, decay_mod, decay_buffers, feature_map, feature_buffers,
        scale, enable_gqa, options, None))


def _lowered_linear(decay_mod, decay_buffers, feature_map, feature_buffers, device):
    decay = TracedMod.from_graph(decay_mod, decay_buffers) if decay_mod else None
    feature = TracedMod.from_graph(feature_map, feature_buffers) if feature_map else None
    for traced in (decay, feature):
        if traced is not None:
            check_captured(traced, device)
    return decay, feature


def _plan_linear(query, key, value, initial_state, decay_mod, decay_buffers, feature_map, feature_buffers,
                 scale, enable_gqa, options, state_rows):
    from ..kernels.linear import LinearPlan, linear_spec
    check_linear(query, key, value, initial_state, enable_gqa,
                 state_name="initial_state" if state_rows is None else "state", state_rows=state_rows)
    B, Hq, T, Dk = query.shape
    Hkv, Dv = key.shape[1], value.shape[3]
    device, dtype = query.device, query.dtype
    opts = KernelOptions.from_text(options)
    decay, feature = _lowered_linear(decay_mod, decay_buffers, feature_map, feature_buffers, device)
    t = _linear_tiles(opts, device, Dk, Dv, rows=B * Hq)
    common = dict(decay=None if decay is None else lower(decay).snippet,
                  feature=None if feature is None else lower(feature).snippet,
                  decay_buffers=() if decay is None else lower(decay).buffers,
                  feature_buffers=() if feature is None else lower(feature).buffers,
                  qk_head=Dk, v_head=Dv, dtype=DTYPES[dtype], dot_precision=dot_precision(query),
                  num_warps=t["warps"], num_stages=t["stages"])
    decode = opts.BACKEND == "TRITON_DECODE" or (
        opts.BACKEND in ("AUTO", "tl") and initial_state is not None and T <= MAX_DECODE_QUERIES)
    plan = LinearPlan("decode" if decode or state_rows is not None else "chunked", B, Hq, Hkv, T, Dk, Dv,
                      dtype, device, scale, t["chunk"], t["block_dv"], decay, feature, common=common)
    plan.decode = linear_spec("linear_decode", part="decode",
                              **dict(common, num_stages=1, num_warps=t["decode_warps"]), block_n=t["decode_dv"])
    if state_rows is None:
        plan.state = linear_spec("linear", part="state", block_m=t["chunk"], block_n=t["state_dv"],
                                 **dict(common, num_warps=t["state_warps"], num_stages=t["state_stages"]))
        plan.output = linear_spec("linear", part="output", block_m=t["chunk"], block_n=t["output_dv"],
                                  **dict(common, num_warps=t["output_warps"]))
    return plan


def plan_linear_decode(query, key, value, state, decay_mod: str, decay_buffers, feature_map: str,
                       feature_buffers, scale: float, enable_gqa: bool, options: str):
    """Check a ``linear_attention_decode`` call (a cache of states [num_slots, Hq, Dk, Dv]) and
    decide its kernel."""
    memo = ("cache", _key(query, key, value), _key(state), decay_mod, _key(*decay_buffers), feature_map,
            _key(*feature_buffers), scale, enable_gqa, options)
    return _memo(_LINEAR, memo, lambda: _plan_linear(
        query, key, value, state, decay_mod, decay_buffers, feature_map, feature_buffers,
        scale, enable_gqa, options, state.shape[0] if isinstance(state, torch.Tensor) else 0))


def plan_linear_backward(plan, grad_slots: tuple):
    """The backward's kernels of a planned ``linear_attention`` call (memoized on the plan);
    GradientError naming the mod before anything runs."""
    from ..errors import GradientError
    from ..frontend.linear import decay_grad, feature_code
    from ..kernels.linear import LinearBackward, linear_spec
    hit = plan.backward.get(grad_slots)
    if hit is None:
        feature = plan.feature_traced
        if feature is not None and any(t.requires_grad for t in feature.buffers):
            raise GradientError(f"feature_map '{feature.name}': its captured tensors cannot get "
                                "gradients. Fix: pass them .detach()-ed (or fold a learned scale "
                                "into the query and key projections)")
        snippet, grad = feature_code(feature, with_grad=True)
        common = dict(plan.common, feature=snippet, feature_grad=grad)
        t = dict(block_m=plan.state.block_m, block_n=plan.grad_dv)
        gates = None
        if grad_slots:
            lowered = decay_grad(plan.decay_traced, grad_slots)
            gates = linear_spec("linear", part="gates", block_m=plan.state.block_m,
                                decay_buffers=plan.common["decay_buffers"],
                                decay_grad_lines=lowered.lines, scatters=lowered.scatters,
                                grad_buffers=lowered.grad_buffers, qk_head=plan.Dk, v_head=plan.Dv,
                                dtype=plan.common["dtype"], num_warps=4)
        hit = plan.backward[grad_slots] = LinearBackward(
            linear_spec("linear", part="grad", **t, **common), gates, grad_slots)
    return hit


# Imported after this module's definitions: flexgen.runtime.plan re-exports this module's
# names (imported at its end), so either module may be imported first.
from .plan import MAX_DECODE_QUERIES, _key, _memo  # noqa: E402
