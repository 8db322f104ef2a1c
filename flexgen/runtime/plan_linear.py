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

# The chunked kernels' tiles on a GPU, by kernel (dk / dv: the key / value head-dim slice of a
# program, 0 the whole padded head dim; warps; stages), measured on the H100 at B=1, H=16,
# T=16k, D=128, bf16 (benchmarks/NOTES.md, "Linear attention: per kernel, against fla"):
# - state: one program per (batch, head, key slice, value slice) walks every chunk with the next
#   chunks' loads in flight; a [64, 32] tile gives 128 programs, each rereading its key slice 4
#   times and its value slice twice (0.100 ms at chunk 128 / 4 stages, 0.183 at [128, 16] / 64 / 3);
# - output: every chunk in parallel, the whole value dim per program (φ(Q) φ(K)ᵀ once per chunk),
#   the key dim in two pipelined steps (0.150 ms; 0.197 at [128, 64] / 4 warps);
# - grad: one program per chunk, the value dim in grad_dv slices inside it, at chunk 64 (128
#   spills or runs out of shared memory): the backward recomputes the states at that size. Where
#   it also writes dG (gates that get gradients) it keeps more accumulators live: 8 warps and
#   64-wide slices there (0.356 ms; 0.483 at 4 warps), 4 and 32 without (0.281; 0.325 at 8 / 64).
LINEAR_CHUNK = 128                # the forward's positions per chunk (kernel_options BLOCK_M sets every chunk)
LINEAR_GPU_TILES = dict(
    state_dk=64, state_dv=32, state_warps=4, state_stages=4,
    output_dk=64, output_dv=128, output_warps=8, output_stages=3,
    grad_chunk=64, grad_dv=32, grad_warps=4, grad_stages=3,
    grad_dg_dv=64, grad_dg_warps=8, grad_dg_stages=3,
)
# The interpreter's cost is per operation: whole tiles there (None), unless a test sets a
# table like LINEAR_GPU_TILES to run the sliced kernels' code paths.
LINEAR_CPU_TILES: dict | None = None
LINEAR_PREFIX = True              # per-token decays: G from the prefix kernel (not a scan per chunk)
_LINEAR: dict = {}


def _linear_tiles(options: KernelOptions, device, Dk: int, Dv: int, rows: int = 1) -> dict:
    """Chunk sizes, head-dim slices, warps and stages of the linear kernels (state, output,
    grad, decode); ``rows`` = batch x query heads (the decode kernel's programs per value
    slice). kernel_options override: BLOCK_M every chunk, BLOCK_N every value slice,
    num_warps / num_stages every kernel's."""
    from ..codegen.spec import pad_head_dim
    gpu = device.type == "cuda"
    k_pad, v_pad = pad_head_dim(Dk), pad_head_dim(Dv)
    for name, v in (("BLOCK_M", options.BLOCK_M), ("BLOCK_N", options.BLOCK_N)):
        if v is not None and (v < 16 or v & (v - 1)):
            raise expected(f"kernel_options[{name!r}]", "a power of two >= 16 ("
                           + ("the chunk size" if name == "BLOCK_M" else "the value-dim slice") + ")",
                           v, "use 64 (or 16 / 32 / 128)")
    table = LINEAR_GPU_TILES if gpu else LINEAR_CPU_TILES
    whole = dict(state_dk=0, state_dv=v_pad, state_warps=4, state_stages=1, output_dk=0, output_dv=v_pad,
                 output_warps=4, output_stages=1, grad_chunk=LINEAR_CHUNK, grad_dv=v_pad, grad_warps=4,
                 grad_stages=1, grad_dg_dv=v_pad, grad_dg_warps=4, grad_dg_stages=1)
    table = whole if table is None else table
    t = {}
    for part in ("state", "output", "grad", "grad_dg"):
        dk = table[f"{part}_dk"] if part in ("state", "output") else 0
        t[f"{part}_dk"] = 0 if not dk or dk >= k_pad else dk
        t[f"{part}_dv"] = min(options.BLOCK_N or table[f"{part}_dv"], v_pad)
        warps = table[f"{part}_warps"]
        if part.startswith("grad") and max(Dk, Dv) <= 64:
            warps = min(warps, 4)   # its [chunk, Dk] float32 accumulators need 8 only for wide heads
        t[f"{part}_warps"] = options.num_warps or warps
        t[f"{part}_stages"] = options.num_stages or table[f"{part}_stages"]
    t["chunk"] = options.BLOCK_M or LINEAR_CHUNK
    t["grad_chunk"] = options.BLOCK_M or table["grad_chunk"]
    decode_dv = options.BLOCK_N or (_decode_dv(device, rows, v_pad) if gpu else v_pad)
    warps = options.num_warps or (8 if gpu and max(Dk, Dv) > 64 else 4)
    t.update(decode_dv=decode_dv, decode_warps=options.num_warps or (4 if decode_dv <= 16 else warps))
    return t


def _decode_dv(device, rows: int, v_pad: int) -> int:
    """The decode kernel's value slice: it streams each state once (memory-bound), so 64-wide
    slices where the grid still gets two programs per SM, thinner ones (down to 16) where
    the batch is too small to fill the GPU. Measured on the H100 (16 heads, 128 x 128 states,
    CUDA graphs): B=64 83% of the copy bandwidth at 64 / 8 warps against 80% at 32; B=1
    3.3 us at 16 / 4 warps against 4.0 at 32 / 4."""
    from . import launch
    sms = launch.sm_count(device)
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
                  decay_form=_decay_form(decay),
                  feature=None if feature is None else lower(feature).snippet,
                  decay_buffers=() if decay is None else lower(decay).buffers,
                  feature_buffers=() if feature is None else lower(feature).buffers,
                  qk_head=Dk, v_head=Dv, dtype=DTYPES[dtype], dot_precision=dot_precision(query))
    decode = opts.BACKEND == "TRITON_DECODE" or (
        opts.BACKEND in ("AUTO", "tl") and initial_state is not None and T <= MAX_DECODE_QUERIES)
    plan = LinearPlan("decode" if decode or state_rows is not None else "chunked", B, Hq, Hkv, T, Dk, Dv,
                      dtype, device, scale, t["chunk"], decay, feature, common=common, tiles=t)
    plan.decode = linear_spec("linear_decode", part="decode", block_n=t["decode_dv"],
                              **dict(common, num_stages=1, num_warps=t["decode_warps"]))
    if state_rows is None:
        plan.state, plan.prefix = _state_specs(common, t, t["chunk"])
        plan.output = linear_spec("linear", part="output", block_m=t["chunk"], block_n=t["output_dv"],
                                  block_k=t["output_dk"], num_warps=t["output_warps"],
                                  num_stages=t["output_stages"], **common)
    return plan


def _state_specs(common: dict, t: dict, chunk: int):
    """The state kernel's spec at ``chunk`` positions per chunk, and the prefix kernel's (None
    unless the decay_form is "prefix")."""
    from ..kernels.linear import linear_spec
    state = linear_spec("linear", part="state", block_m=chunk, block_n=t["state_dv"], block_k=t["state_dk"],
                        num_warps=t["state_warps"], num_stages=t["state_stages"], **common)
    prefix = None
    if common["decay_form"] == "prefix":
        prefix = linear_spec("linear", part="prefix", block_m=chunk, decay=common["decay"],
                             decay_buffers=common["decay_buffers"], decay_form="prefix",
                             qk_head=common["qk_head"], v_head=common["v_head"], dtype=common["dtype"],
                             num_warps=4)
    return state, prefix


def _decay_form(decay) -> str:
    """How the chunked kernels get G (``LinearSpec.decay_form``): in closed form where the
    decay_mod does not read t (one g per batch row and head), else from the prefix kernel (the
    scan off the state kernel's serial path), or traced in every kernel (LINEAR_PREFIX off)."""
    if decay is None:
        return "traced"
    free = lower(decay).snippet.free
    if free is not None and "t" not in free:
        return "head"
    return "prefix" if LINEAR_PREFIX else "traced"


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
        t, chunk = plan.tiles, plan.tiles["grad_chunk"]
        gates = None
        if grad_slots:
            lowered = decay_grad(plan.decay_traced, grad_slots)
            gates = linear_spec("linear", part="gates", block_m=chunk,
                                decay_buffers=plan.common["decay_buffers"],
                                decay_grad_lines=lowered.lines, scatters=lowered.scatters,
                                grad_buffers=lowered.grad_buffers, qk_head=plan.Dk, v_head=plan.Dv,
                                dtype=plan.common["dtype"], num_warps=4)
        g = "grad_dg" if grad_slots else "grad"    # the grad kernel's tiles, with or without dG
        grad = linear_spec("linear", part="grad", block_m=chunk, block_n=t[f"{g}_dv"], num_warps=t[f"{g}_warps"],
                           num_stages=t[f"{g}_stages"], **dict(plan.common, feature=snippet, feature_grad=grad))
        # The states again, at the grad kernel's chunk size (the forward's may differ).
        state, prefix = _state_specs(plan.common, t, chunk)
        hit = plan.backward[grad_slots] = LinearBackward(grad, gates, grad_slots, state, prefix, chunk)
    return hit


# Imported after this module's definitions: flexgen.runtime.plan re-exports this module's
# names (imported at its end), so either module may be imported first.
from .plan import MAX_DECODE_QUERIES, _key, _memo  # noqa: E402
