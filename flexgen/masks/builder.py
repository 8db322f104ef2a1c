"""Building a block mask's lists without the dense mask (what ``create_block_mask`` runs).

Blocks are classified full / empty / undecided from interval bounds of the
canonical mask expression (``flexgen.masks.bounds``); undecided blocks are
evaluated element by element, with torch ops when they are few
(``flexgen.masks.mask_eval``, no kernel to compile), else with a generated
kernel. The result, a ``[2, B, H, NQ, NKV]`` int32 of partial / full flags
(O(number of blocks)), is compacted into the eight index lists the attention
kernels read (torch's BlockMask layout), all views of one int32 tensor laid out
by ``layout`` — the output of the ``flexgen::block_mask`` op.

On a GPU (``SYNC_FREE_DEVICES``) nothing is read back to the host: the undecided
blocks are classified in place by the dense block-mask kernel, which for small
grids (``EVERY_MAX_ELEMENTS``) classifies every block, bounds skipped. Compiling
that kernel costs seconds, and a process that builds a mask once (a restart, a
script) would pay them for one launch: so the first build of a mask in a process,
where the grid is also small enough for torch ops, classifies every block with
``mask_eval`` instead, and only a second build of the same mask launches (and
compiles) the kernel. A warm-up (``compile_on_first_build``) compiles it at once, and
a first build whose kernel a previous process compiled (its binary in the restart
index: ``launch.ready``) launches it, as the torch ops' first use costs more then.
The lists are written the same way: by one generated kernel on a GPU (``fill_lists``),
generic so one compile serves every mask, and with torch ops the first time a process
fills lists.
"""
from __future__ import annotations

import contextlib
from dataclasses import dataclass

import torch

from ..runtime.checks import may_cache
from .states import FULL, PARTIAL

# Lists start on 16-byte boundaries (kernels specialize on pointer alignment): offsets
# are multiples of 4 int32 elements.
_ALIGN = 4

# device -> int8 [2, 1, 1, 1, 1] of (PARTIAL, FULL), for hits_of_states
_STATE_VALUES: dict = {}

# Devices whose undecided blocks are classified in place by the dense block-mask kernel (one
# program per block, the decided ones return at once) rather than gathered with nonzero():
# nonzero's length is read on the host, a sync on a GPU that stalls a training step's
# launches behind the previous step's kernels (Hugging Face builds a mask per forward). The
# CPU keeps the list and its torch-op path, which compiles no kernel.
SYNC_FREE_DEVICES = ("cuda",)
# There, a grid of at most this many elements (B * H * Q_LEN * KV_LEN) skips the bounds and
# has the kernel classify every block: ~60 small torch ops of the bounds cost ~1-2 ms of a
# slow host per mask (a step that builds its mask is host-bound on it), the kernel's extra
# element pass ~20-40 us of GPU at 2**28. The exception: a mask's first build in the process,
# where its blocks (ragged ones counted whole) hold at most mask_eval.TORCH_MAX_ELEMENTS
# elements (2**26, 8192 x 8192 for one head). There torch ops classify every block
# (``_classify_every_with_torch``, no host read either) and no kernel is compiled (~2 s on an
# H100) for a mask the process may never build again; its second build launches (compiles)
# the kernel, as every later one does.
EVERY_MAX_ELEMENTS = 2 ** 28

# The dense block-mask specs (their keys) this process has built a mask with, and the lists
# kernel's once it filled lists (``fill_lists``): the next build launches the kernel.
# Bounded like the spec memo (a cleared set costs a torch build).
_BUILT: set = set()
_BUILT_MAX = 4096
# Open compile_on_first_build() blocks: inside one, first builds launch the kernel too.
_COMPILE_ON_FIRST_BUILD = 0


def _aligned(n: int) -> int:
    return -(-n // _ALIGN) * _ALIGN


def _contiguous_strides(shape) -> tuple:
    strides, step = [], 1
    for size in reversed(shape):
        strides.append(step)
        step *= size
    return tuple(reversed(strides))


@dataclass(frozen=True)
class Layout:
    """Where the eight lists of a [B, H, NQ, NKV] mask lie in one int32 tensor of ``size``."""
    B: int
    H: int
    nq: int
    nkv: int
    n_kv: int                    # elements per kv count list, aligned
    n_q: int                     # per q count list
    n_idx: int                   # per index list

    @property
    def size(self) -> int:
        return 2 * (self.n_kv + self.n_q + 2 * self.n_idx)

    def stacked(self, buf: torch.Tensor) -> tuple:
        """(kv counts [2, B, H, NQ], q counts [2, B, H, NKV], kv indices [2, B, H, NQ, NKV],
        q indices [2, B, H, NKV, NQ]): partial then full, each contiguous."""
        B, H, nq, nkv = self.B, self.H, self.nq, self.nkv
        base = 2 * (self.n_kv + self.n_q)
        return (buf.as_strided((2, B, H, nq), (self.n_kv, *_contiguous_strides((B, H, nq))), 0),
                buf.as_strided((2, B, H, nkv), (self.n_q, *_contiguous_strides((B, H, nkv))), 2 * self.n_kv),
                buf.as_strided((2, B, H, nq, nkv), (self.n_idx, *_contiguous_strides((B, H, nq, nkv))), base),
                buf.as_strided((2, B, H, nkv, nq), (self.n_idx, *_contiguous_strides((B, H, nkv, nq))),
                               base + 2 * self.n_idx))

    def views(self, buf: torch.Tensor) -> tuple:
        """(kv_num, kv_idx, full_kv_num, full_kv_idx, q_num, q_idx, full_q_num, full_q_idx):
        counts [B, H, NQ] / [B, H, NKV], indices [B, H, NQ, NKV] / [B, H, NKV, NQ], contiguous."""
        kv_num, q_num, kv_idx, q_idx = (t.unbind(0) for t in self.stacked(buf))
        return (kv_num[0], kv_idx[0], kv_num[1], kv_idx[1], q_num[0], q_idx[0], q_num[1], q_idx[1])


def layout(B: int, H: int, nq: int, nkv: int) -> Layout:
    return Layout(B, H, nq, nkv, _aligned(B * H * nq), _aligned(B * H * nkv), _aligned(B * H * nq * nkv))


def fill_lists(hit: torch.Tensor, out: torch.Tensor | None = None, kept: list | None = None) -> torch.Tensor:
    """The lists of an int32 ``[2, B, H, NQ, NKV]`` of partial (``hit[0]``) / full (``hit[1]``)
    flags, written into ``out`` (or a new tensor) laid out by ``layout``.

    Per row, a list holds the indices of its blocks in that state, in increasing order,
    then the other indices in increasing order as padding (torch's layout): a stable
    descending sort. On a GPU (``SYNC_FREE_DEVICES``) one generated kernel writes them
    all (``lists_spec``), except in the process's first call, as for the block-mask
    kernel (``EVERY_MAX_ELEMENTS``): a process that builds one mask compiles nothing
    (``compile_on_first_build`` launches it there too). Elsewhere both states go through
    each torch op (the leading dim of 2): two sorts, two sums and two copies in all, into
    views of one tensor. ``kept``: where a launch's ``launch.Replay`` (or None) is appended
    (None: no Replay is made).
    """
    _, B, H, nq, nkv = hit.shape
    lay = layout(B, H, nq, nkv)
    if out is None:
        out = torch.empty(lay.size, dtype=torch.int32, device=hit.device)
    if hit.device.type in SYNC_FREE_DEVICES and hit.numel():
        # The torch ops below are 7 calls and more CUDA kernels, each call ~50-80 us of a
        # slow host (the H100's): most of a build's host time, paid every step by a
        # training step that builds its mask. One launch replaces them.
        spec = lists_spec()
        inputs = dict(hits=hit.contiguous(), out=out, n_kv=lay.n_kv, n_q=lay.n_q, n_idx=lay.n_idx)
        if _kernel_now(spec, hit.device, inputs):
            from ..runtime import launch
            replay = launch.run(spec, hit.device, inputs, replay=() if kept is None else (hit, out))
            if kept is not None:
                kept.append(replay)
            return out
    kv_num, q_num, kv_idx, q_idx = lay.stacked(out)
    torch.sum(hit, -1, dtype=torch.int32, out=kv_num)
    torch.sum(hit, -2, dtype=torch.int32, out=q_num)
    kv_idx.copy_(hit.sort(dim=-1, descending=True, stable=True).indices)
    q_idx.copy_(hit.transpose(-1, -2).sort(dim=-1, descending=True, stable=True).indices)
    return out


def lists_spec():
    """The spec of the kernel writing a mask's lists (``fill_lists`` on a GPU): no mod in it,
    so one kernel serves every mask of the process."""
    from ..codegen.spec import kernel_spec
    return kernel_spec("block_lists", num_warps=4)


def hits_of_states(states: torch.Tensor) -> torch.Tensor:
    """int32 ``[2, B, H, NQ, NKV]``: ``states == PARTIAL`` and ``states == FULL``."""
    values = _STATE_VALUES.get(states.device)
    if values is None:
        values = torch.tensor([PARTIAL, FULL], dtype=torch.int8,
                              device=states.device).view(2, 1, 1, 1, 1)
        if may_cache(states.device):
            _STATE_VALUES[states.device] = values
    hit = torch.empty((2, *states.shape), dtype=torch.int32, device=states.device)
    return torch.eq(states, values, out=hit)


def block_hits(lowered, traced, B, H, Q_LEN, KV_LEN, q_block, kv_block, device,
               kept: list | None = None) -> torch.Tensor:
    """int32 ``[2, B, H, NQ, NKV]``: which blocks are partial (``[0]``) and which full (``[1]``).

    Interval bounds (``flexgen.masks.bounds.block_flags``) decide most blocks full or
    empty; the others, undecided, are looked at element by element,
    which decides them exactly, and one indexed write stores the element
    pass's partial and full rows. No int8 state tensor is built, and no
    lookup of its values follows. ``kept``: where the launch's ``launch.Replay`` (or None) is
    appended when one kernel classified every block (nothing else wrote ``hit``); None: no
    Replay is made.
    """
    from ..frontend.lowering import buffer_map
    from . import bounds
    shape = (B, H, -(-Q_LEN // q_block), -(-KV_LEN // kv_block))
    hit = torch.empty((2, *shape), dtype=torch.int32, device=device)
    sync_free = torch.device(device).type in SYNC_FREE_DEVICES
    if sync_free and B * H * Q_LEN * KV_LEN <= EVERY_MAX_ELEMENTS:
        from . import mask_eval
        spec = block_mask_spec(lowered, dense=True)
        inputs = _dense_inputs(traced, hit, Q_LEN, KV_LEN, q_block, kv_block, every=True)
        # A mask's first build in the process: torch ops, no kernel to compile (EVERY_MAX_ELEMENTS).
        by_torch = (hit.numel() // 2 * q_block * kv_block <= mask_eval.TORCH_MAX_ELEMENTS
                    and not _kernel_now(spec, hit.device, inputs))
        if not (by_torch and _classify_every_with_torch(lowered, traced, hit, Q_LEN, KV_LEN,
                                                        q_block, kv_block)):
            from ..runtime import launch
            replay = launch.run(spec, hit.device, inputs,
                                replay=() if kept is None else (hit, *traced.buffers))
            if kept is not None:
                kept.append(replay)
        return hit
    undecided, full = hit.unbind(0)
    # The recorded block-bounds program (no sympy in a warm process), or the expression.
    program = lowered.bounds if lowered.bounds is not None else lowered.expr
    _, empty = bounds.block_flags(program, B, H, Q_LEN, KV_LEN, q_block, kv_block,
                                  buffer_map(traced), device, out=full)
    # Undecided: neither full nor empty, i.e. full == empty (never both true;
    # were they, the block would count as undecided and be looked at).
    torch.eq(empty.expand(shape), full, out=undecided)
    if sync_free:
        _classify_in_place(lowered, traced, hit, Q_LEN, KV_LEN, q_block, kv_block)
        return hit
    blocks = undecided.nonzero()                        # [N, 4]: b, h, q block, kv block
    if blocks.shape[0]:
        hit[(slice(None), *blocks.unbind(1))] = _classify_undecided(
            lowered, traced, blocks, Q_LEN, KV_LEN, q_block, kv_block, B, H)
    return hit


def _kernel_now(spec, device, inputs) -> bool:
    """Whether this build launches ``spec``'s kernel rather than torch ops: any build after the
    process's first with the spec, a warm-up's (``compile_on_first_build``), and a first one
    whose kernel needs no compile (``launch.ready``: a previous process recorded it)."""
    from ..runtime import launch
    first = _first_build(spec)
    return not first or bool(_COMPILE_ON_FIRST_BUILD) or launch.ready(spec, device, inputs)


def _first_build(spec) -> bool:
    """Whether this process builds a mask with ``spec`` (the dense kernel's; the lists kernel's:
    fills lists) for the first time; remembered from now on."""
    if spec.key in _BUILT:
        return False
    if len(_BUILT) >= _BUILT_MAX:
        _BUILT.clear()
    _BUILT.add(spec.key)
    return True


def _classify_every_with_torch(lowered, traced, hit, Q_LEN, KV_LEN, q_block, kv_block) -> bool:
    """Every block of ``hit`` classified with torch ops (``mask_eval``: no kernel to compile);
    False, ``hit`` untouched, where the torch path refuses the mask.

    The blocks' coordinates come from aranges, in ``hit``'s order, not from nonzero(): the
    build reads nothing back to the host, as the kernel's does not.
    """
    from . import mask_eval
    _, B, H, nq, nkv = hit.shape
    axes = (torch.arange(n, dtype=torch.int32, device=hit.device) for n in (B, H, nq, nkv))
    blocks = torch.stack(torch.meshgrid(*axes, indexing="ij"), -1).view(-1, 4)
    try:
        hits = mask_eval.classify_blocks(lowered, traced.buffers, blocks, Q_LEN, KV_LEN, q_block,
                                         kv_block, hits=True, B=B, H=H)
    except mask_eval.Unsupported:
        return False
    hit.view(2, -1).copy_(hits)
    return True


@contextlib.contextmanager
def compile_on_first_build():
    """Inside, a mask's first build launches (so compiles) the dense block-mask kernel and the
    lists kernel, as later builds do, instead of using torch ops. A warm-up
    (``flexgen.precompile``, ``python -m flexgen warmup``) builds each mask once, and must
    compile the kernels that serving's second build of that mask launches."""
    global _COMPILE_ON_FIRST_BUILD
    _COMPILE_ON_FIRST_BUILD += 1
    try:
        yield
    finally:
        _COMPILE_ON_FIRST_BUILD -= 1


def clear_memos() -> None:
    """Forget which masks were built (``flexgen.clear_caches``): each is built once more with torch ops."""
    _BUILT.clear()
    _LISTS.clear()
    _REPLAYS.clear()
    _SEEN.clear()


# The lists of masks that capture no tensor, a function of the mask's program and the sizes
# alone: (program, B, H, Q_LEN, KV_LEN, Q_BLOCK, KV_BLOCK, device) -> the eight lists. A loop
# that builds its mask at every step (transformers does, at every forward) gets the same lists
# back, at the same addresses, which the kernels' launch replays key on, and builds nothing.
_LISTS: dict = {}
_LISTS_MAX = 64


def tensor_free_lists(key: tuple, build) -> tuple:
    """The eight lists (``Layout.views``) of a mask that captures no tensor, ``build()`` the
    first time. Under a tensor mode (a FakeTensorMode planning shapes, say) the build is its
    own: its tensors are the mode's, and a real one kept here is not for the mode."""
    if torch._C._len_torch_dispatch_stack():          # (as ops._plain tells a mode)
        return build()
    lists = _LISTS.get(key)
    if lists is None:
        lists = build()
        if type(lists[0]) is torch.Tensor:
            if len(_LISTS) >= _LISTS_MAX:
                _LISTS.clear()
            _LISTS[key] = lists
    return lists


def _dense_inputs(traced, hit, Q_LEN, KV_LEN, q_block, kv_block, every=False) -> dict:
    """The dense block-mask kernel's inputs over ``hit``: its undecided blocks, or (``every``) all."""
    return dict(hits=hit, mask_buffers=traced.buffers, q_len=Q_LEN, kv_len=KV_LEN,
                q_block=q_block, kv_block=kv_block, every=every)


def _classify_in_place(lowered, traced, hit, Q_LEN, KV_LEN, q_block, kv_block) -> None:
    """The dense block-mask kernel over ``hit``'s undecided blocks."""
    from ..runtime import launch
    launch.run(block_mask_spec(lowered, dense=True), hit.device,
               _dense_inputs(traced, hit, Q_LEN, KV_LEN, q_block, kv_block))


def block_mask_spec(lowered, dense: bool = False):
    """The block-mask builder kernel's spec for a lowered mask_mod (its snippet and buffers):
    over a list of undecided blocks, or (``dense``) over every block of the grid in place."""
    from ..codegen.spec import BlockMaskSpec, kernel_spec
    # Interned: a mask built every step would hash a new spec's fields each time.
    return kernel_spec("block_mask", BlockMaskSpec, mask=lowered.snippet, mask_buffers=lowered.buffers,
                       num_warps=4, dense=dense)


def _classify_undecided(lowered, traced, blocks, Q_LEN, KV_LEN, q_block, kv_block, B=None, H=None):
    """int32 [2, N]: whether each undecided block is partial, and whether it is full.

    A few blocks are evaluated with torch ops (``flexgen.masks.mask_eval``), which
    costs no kernel compile; many, or a mask the torch path cannot run, go
    to the generated block-mask kernel.
    """
    from ..runtime import launch
    from . import mask_eval
    if blocks.shape[0] * q_block * kv_block <= mask_eval.TORCH_MAX_ELEMENTS:
        try:
            return mask_eval.classify_blocks(lowered, traced.buffers, blocks, Q_LEN, KV_LEN,
                                             q_block, kv_block, hits=True, B=B, H=H)
        except mask_eval.Unsupported:
            pass
    device = blocks.device
    hits = torch.empty(2, blocks.shape[0], dtype=torch.int32, device=device)
    spec = block_mask_spec(lowered)
    # The kernel reads nonzero's int64 rows through their strides (column-major on a GPU).
    launch.run(spec, device, dict(blocks=blocks, hits=hits, mask_buffers=traced.buffers, q_len=Q_LEN,
                                  kv_len=KV_LEN, q_block=q_block, kv_block=kv_block))
    return hits


# A build that was two launches (every block classified by the dense kernel, then the lists
# kernel) is made again from those launches' replays with the new tensors (``launch.Replay``):
# (program, the captured tensors' dtypes, shapes, strides and devices, B, H, Q_LEN, KV_LEN,
# Q_BLOCK, KV_BLOCK, device) -> (hit's shape, the lists' size and device, the two Replays). Everything
# else a build does (the program's parse and lowering, the index and device checks, the
# specs, the kernels' arguments) is a function of that key. A training step that builds its
# mask starts with it, before its first kernels can run (and under mode="reduce-overhead"
# between two graphs): the op's host time a build of the small model's document mask, H200
# host, 203 -> 34 us (median; create_block_mask's whole call 312 -> 86). A key's replays are
# kept from its second build on (``_SEEN``): a loop whose every build is new (a decode step's
# longer cache) makes no Replay it never uses (~12 us each on the dev CPU).
_REPLAYS: dict = {}
_REPLAYS_MAX = 64
_SEEN: set = set()          # keys built once
_SEEN_MAX = 1024


def build(mask_buffers, mask_mod: str, B: int, H: int, Q_LEN: int, KV_LEN: int, Q_BLOCK: int,
          KV_BLOCK: int, device) -> torch.Tensor:
    """The lists of a mask_mod (its program text and captured tensors) over
    ``[B, H, Q_LEN, KV_LEN]`` in blocks of ``Q_BLOCK x KV_BLOCK``, laid out by ``layout``."""
    if torch.device(device).type not in SYNC_FREE_DEVICES:      # (no kernel launch to replay)
        return _build(mask_buffers, mask_mod, B, H, Q_LEN, KV_LEN, Q_BLOCK, KV_BLOCK, device, None)
    key = (mask_mod, *[(t.dtype, t.shape, t.stride(), t.device) for t in mask_buffers],
           B, H, Q_LEN, KV_LEN, Q_BLOCK, KV_BLOCK, device)
    found = _REPLAYS.get(key)
    if found is not None:
        out = _replayed(found, mask_buffers)
        if out is not None:
            return out
    kept = [] if key in _SEEN else None
    if kept is None:
        if len(_SEEN) >= _SEEN_MAX:
            _SEEN.clear()
        _SEEN.add(key)
    out = _build(mask_buffers, mask_mod, B, H, Q_LEN, KV_LEN, Q_BLOCK, KV_BLOCK, device, kept)
    if kept is not None and len(kept) == 2 and all(kept):
        if len(_REPLAYS) >= _REPLAYS_MAX:
            _REPLAYS.clear()
        shape = (2, B, H, -(-Q_LEN // Q_BLOCK), -(-KV_LEN // KV_BLOCK))
        _REPLAYS[key] = (shape, out.numel(), out.device, *kept)
    return out


def _replayed(found, mask_buffers) -> torch.Tensor | None:
    """A build made again from its launches' replays (``_REPLAYS``), or None where the first
    one declines (then the build runs as usual)."""
    shape, size, device, classify, fill = found
    hit = torch.empty(shape, dtype=torch.int32, device=device)
    if not classify(hit, *mask_buffers):
        return None
    out = torch.empty(size, dtype=torch.int32, device=device)
    if not fill(hit, out):
        fill_lists(hit, out)
    return out


def _build(mask_buffers, mask_mod, B, H, Q_LEN, KV_LEN, Q_BLOCK, KV_BLOCK, device, kept) -> torch.Tensor:
    """``build`` from the program text; ``kept``: where its launches' Replays are appended."""
    from ..frontend.lowering import lower
    from ..frontend.trace import TracedMod
    from ..runtime.checks import check_buffers
    traced = TracedMod.from_graph(mask_mod, mask_buffers)
    check_buffers(traced, device, like="the mask")
    lowered = lower(traced)
    if traced.buffers:
        # As torch's indexing would raise (imported here: the check needs sympy, which a
        # warm restart of a mask without captured tensors never loads).
        from ..frontend.bounds_check import check_call_indices
        check_call_indices(None, traced, B, H, Q_LEN, KV_LEN)
    hit = block_hits(lowered, traced, B, H, Q_LEN, KV_LEN, Q_BLOCK, KV_BLOCK, device, kept)
    return fill_lists(hit, kept=kept)
