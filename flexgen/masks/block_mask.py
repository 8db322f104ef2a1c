"""Block-sparse masks: which (query block, kv block) tiles a kernel visits.

``create_block_mask`` never builds the dense ``[Q_LEN, KV_LEN]`` mask. It
classifies blocks with interval bounds of the canonical mask expression
(``flexgen.masks.bounds``), then evaluates mask_mod on the elements of the blocks
the bounds leave undecided: with torch ops when they are few
(``flexgen.masks.mask_eval``, no kernel to compile), else with a generated kernel.
The result is a
dense ``[2, B, H, NQ, NKV]`` int32 of partial / full flags, O(number of
blocks), compacted into the index lists the attention kernels read (torch's
BlockMask layout).
"""
from __future__ import annotations

import torch

from ..runtime import launch
from . import bounds, mask_eval
from ..runtime.checks import check_buffers
from ..errors import expected
from ..frontend.bounds_check import check_call_indices
from ..frontend.lowering import buffer_map, lower
from ..codegen.spec import KernelSpec
from ..frontend.trace import trace, trace_cached

# Results are int32 views of one allocation, each starting on a 16-byte boundary
# (kernels specialize on pointer alignment): a multiple of 4 elements apart.
_ALIGN = 4

# device -> int8 [2, 1, 1, 1, 1] of (PARTIAL, FULL), for from_states
_STATE_VALUES: dict = {}


def _aligned(n: int) -> int:
    return -(-n // _ALIGN) * _ALIGN


def _contiguous_strides(shape) -> tuple:
    strides, step = [], 1
    for size in reversed(shape):
        strides.append(step)
        step *= size
    return tuple(reversed(strides))


def _is_dense(shape, strides) -> bool:
    """Whether the strides lay out exactly prod(shape) elements, in some order of the dims."""
    step = 1
    for size, stride in sorted((p for p in zip(shape, strides) if p[0] != 1), key=lambda p: p[1]):
        if stride != step:
            return False
        step *= size
    return True


def _lists(hit: torch.Tensor) -> tuple:
    """(partial_num, partial_idx, full_num, full_idx) along the last dim, and along dim -2.

    ``hit`` is int32 ``[2, B, H, NQ, NKV]``: 1 where a block is partial (``hit[0]``)
    or full (``hit[1]``), else 0. Per row, a list holds the indices of its
    blocks in that state, in increasing order, then the other indices in
    increasing order as padding (torch's layout): a stable descending sort.
    The "q" lists (per kv block) come out as transposed views, ``[B, H, NKV, NQ]``,
    as they always have. Both states go through each op (the leading dim of
    2) and the eight results are views of one int32 allocation, each 16-byte
    aligned: two sorts, two sums and two copies in all. ``hit`` being int32
    already, the sums convert nothing.
    """
    _, B, H, nq, nkv = hit.shape
    kv_order = hit.sort(dim=-1, descending=True, stable=True).indices
    q_order = hit.transpose(-1, -2).sort(dim=-1, descending=True, stable=True).indices
    # The q lists keep the layout they always had (the int32 copy of each sort
    # result, memory format preserved): the sort's strides, or contiguous where
    # the transposed view is contiguous (NQ or NKV of 1).
    q_strides = q_order.stride()[1:]
    if nq == 1 or nkv == 1 or not _is_dense((B, H, nkv, nq), q_strides):
        q_strides = _contiguous_strides((B, H, nkv, nq))
    n_kv, n_q, n_idx = _aligned(B * H * nq), _aligned(B * H * nkv), _aligned(B * H * nq * nkv)
    buf = torch.empty(2 * (n_kv + n_q + 2 * n_idx), dtype=torch.int32, device=hit.device)
    kv_num = buf.as_strided((2, B, H, nq), (n_kv, *_contiguous_strides((B, H, nq))), 0)
    q_num = buf.as_strided((2, B, H, nkv), (n_q, *_contiguous_strides((B, H, nkv))), 2 * n_kv)
    offset = 2 * (n_kv + n_q)
    kv_idx = buf.as_strided((2, B, H, nq, nkv), (n_idx, *_contiguous_strides((B, H, nq, nkv))), offset)
    q_idx = buf.as_strided((2, B, H, nkv, nq), (n_idx, *q_strides), offset + 2 * n_idx)
    torch.sum(hit, -1, dtype=torch.int32, out=kv_num)
    torch.sum(hit, -2, dtype=torch.int32, out=q_num)
    kv_idx.copy_(kv_order)
    q_idx.copy_(q_order)
    (kv_num, full_kv_num), (kv_idx, full_kv_idx) = kv_num.unbind(0), kv_idx.unbind(0)
    (q_num, full_q_num), (q_idx, full_q_idx) = q_num.unbind(0), q_idx.unbind(0)
    return (kv_num, kv_idx, full_kv_num, full_kv_idx), (q_num, q_idx, full_q_num, full_q_idx)


def _hits_of_states(states: torch.Tensor) -> torch.Tensor:
    """int32 ``[2, B, H, NQ, NKV]``: ``states == PARTIAL`` and ``states == FULL``."""
    values = _STATE_VALUES.get(states.device)
    if values is None:
        values = torch.tensor([bounds.PARTIAL, bounds.FULL], dtype=torch.int8,
                              device=states.device).view(2, 1, 1, 1, 1)
        _STATE_VALUES[states.device] = values
    hit = torch.empty((2, *states.shape), dtype=torch.int32, device=states.device)
    return torch.eq(states, values, out=hit)


class BlockMask:
    """Which blocks of the ``[Q_LEN, KV_LEN]`` score matrix are partial, full or skipped.

    Same fields as ``torch.nn.attention.flex_attention.BlockMask``:
    ``kv_num_blocks`` ``[B, H, NQ]`` and ``kv_indices`` ``[B, H, NQ, NKV]`` list
    the partially masked kv blocks of each query block (mask_mod applied),
    ``full_kv_*`` the fully unmasked ones (mask_mod skipped); ``q_*`` and
    ``full_q_*`` are the transposed lists (per kv block, its query blocks).
    ``B`` or ``H`` of size 1 broadcasts over the batch or heads.
    """

    def __init__(self, kv_num_blocks, kv_indices, full_kv_num_blocks, full_kv_indices,
                 q_num_blocks, q_indices, full_q_num_blocks, full_q_indices,
                 BLOCK_SIZE, mask_mod, seq_lengths):
        self.kv_num_blocks, self.kv_indices = kv_num_blocks, kv_indices
        self.full_kv_num_blocks, self.full_kv_indices = full_kv_num_blocks, full_kv_indices
        self.q_num_blocks, self.q_indices = q_num_blocks, q_indices
        self.full_q_num_blocks, self.full_q_indices = full_q_num_blocks, full_q_indices
        self.BLOCK_SIZE = tuple(BLOCK_SIZE)
        self.mask_mod = mask_mod
        self.seq_lengths = tuple(seq_lengths)
        self._traced = None
        self._broadcast = (None, None)      # (key, lists) of the last broadcast_lists call

    def broadcast_lists(self, which: str, B: int, H: int) -> tuple:
        """(num, indices, full_num, full_indices) of the "kv" or "q" lists as [B, H, ...] views.

        A training loop passes the same mask every step: the views are reused
        while the list tensors are the same objects (a reassigned field misses).
        """
        names = [f"{p}{which}_{n}" for p, n in (("", "num_blocks"), ("", "indices"),
                                                ("full_", "num_blocks"), ("full_", "indices"))]
        tensors = [getattr(self, n) for n in names]
        key = (which, B, H, *map(id, tensors))
        cached_key, lists = self._broadcast
        if cached_key != key:
            lists = tuple(t.expand(B, H, *t.shape[2:]) for t in tensors)
            self._broadcast = (key, lists)
        return lists

    @classmethod
    def from_states(cls, states: torch.Tensor, BLOCK_SIZE, mask_mod, seq_lengths) -> "BlockMask":
        """Build the index lists from an int8 ``[B, H, NQ, NKV]`` of EMPTY / PARTIAL / FULL."""
        kv_lists, q_lists = _lists(_hits_of_states(states))
        return cls(*kv_lists, *q_lists, BLOCK_SIZE, mask_mod, seq_lengths)

    @property
    def shape(self) -> tuple:
        """(B, H, Q_LEN, KV_LEN); B or H is 1 where the mask broadcasts."""
        B, H = self.kv_num_blocks.shape[:2]
        return (B, H) + self.seq_lengths

    @property
    def device(self) -> torch.device:
        return self.kv_num_blocks.device

    def to_dense(self) -> torch.Tensor:
        """int32 ``[B, H, NQ, NKV]``: 1 where a block is computed (partial or full), else 0."""
        B, H, nq = self.kv_num_blocks.shape
        nkv = self.kv_indices.shape[-1]
        dense = torch.zeros(B, H, nq, nkv, dtype=torch.int32, device=self.device)
        for num, idx in ((self.kv_num_blocks, self.kv_indices),
                         (self.full_kv_num_blocks, self.full_kv_indices)):
            valid = torch.arange(nkv, device=self.device) < num[..., None]
            dense.scatter_add_(-1, idx.long(), valid.to(torch.int32))
        return dense

    def block_states(self) -> torch.Tensor:
        """int8 ``[B, H, NQ, NKV]``: 0 skipped, 1 partial, 2 full."""
        B, H, nq = self.kv_num_blocks.shape
        nkv = self.kv_indices.shape[-1]
        states = torch.zeros(B, H, nq, nkv, dtype=torch.int8, device=self.device)
        for num, idx, value in ((self.kv_num_blocks, self.kv_indices, bounds.PARTIAL),
                                (self.full_kv_num_blocks, self.full_kv_indices, bounds.FULL)):
            valid = torch.arange(nkv, device=self.device) < num[..., None]
            states.scatter_add_(-1, idx.long(), (valid * value).to(torch.int8))
        return states

    def sparsity(self) -> float:
        """Percentage of blocks skipped (neither partial nor full)."""
        total = self.kv_indices.numel()
        computed = int(self.kv_num_blocks.sum()) + int(self.full_kv_num_blocks.sum())
        return 100.0 * (1 - computed / total) if total else 0.0

    def to(self, device) -> "BlockMask":
        moved = [t.to(device) for t in (
            self.kv_num_blocks, self.kv_indices, self.full_kv_num_blocks, self.full_kv_indices,
            self.q_num_blocks, self.q_indices, self.full_q_num_blocks, self.full_q_indices)]
        return BlockMask(*moved, self.BLOCK_SIZE, self.mask_mod, self.seq_lengths)

    def traced(self):
        """The traced mask_mod (traced once, on first use)."""
        if self._traced is None:
            self._traced = trace(self.mask_mod, "mask_mod")
        return self._traced

    def to_string(self, max_blocks: int = 32) -> str:
        """A picture of the block layout: '█' full, '░' partial, ' ' skipped (first batch and head)."""
        states = self.block_states()[0, 0]
        rows = []
        for row in states[:max_blocks].tolist():
            rows.append("".join(" ░█"[v] for v in row[:max_blocks]) + ("…" if len(row) > max_blocks else ""))
        if states.shape[0] > max_blocks:
            rows.append("…")
        return "\n".join(rows)

    def plot(self, path=None, max_len: int = 256):
        """A matplotlib Figure of the element mask (first batch and head) with the block grid.

        Full, partial and empty blocks are shaded in distinct colours and the
        title gives the block counts and sparsity; with ``path`` a PNG is
        written too. Evaluates mask_mod densely, so Q_LEN and KV_LEN must be
        <= ``max_len`` (else InputError). Needs matplotlib; see ``flexgen.masks.plot``.
        """
        from ..masks.plot import plot_block_mask
        return plot_block_mask(self, path=path, max_len=max_len)

    def __repr__(self) -> str:
        B, H, Q_LEN, KV_LEN = self.shape
        name = getattr(self.mask_mod, "__name__", type(self.mask_mod).__name__)
        head = (f"BlockMask(shape=(B={B}, H={H}, Q_LEN={Q_LEN}, KV_LEN={KV_LEN}), "
                f"BLOCK_SIZE={self.BLOCK_SIZE}, sparsity={self.sparsity():.2f}%, mask_mod={name})")
        nq, nkv = self.kv_indices.shape[-2:]
        if nq <= 32 and nkv <= 32:
            return head + "\n" + self.to_string()
        return head


def _check_block_size(BLOCK_SIZE) -> tuple:
    sizes = (BLOCK_SIZE, BLOCK_SIZE) if isinstance(BLOCK_SIZE, int) else tuple(BLOCK_SIZE)
    if len(sizes) != 2 or any(not isinstance(s, int) or s < 16 or s & (s - 1) for s in sizes):
        raise expected("BLOCK_SIZE", "a power of two >= 16, or a (Q_BLOCK, KV_BLOCK) pair of them",
                       BLOCK_SIZE, "use 128 (the default) or 64")
    return sizes


def _check_length(name, value, allow_none=False):
    if value is None and allow_none:
        return 1
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise expected(name, "a positive int" + (" or None (broadcast)" if allow_none else ""),
                       repr(value), f"pass the {name} of your inputs")
    return value


def default_device():
    return torch.device("cuda") if torch.cuda.is_available() else torch.device("cpu")


def create_block_mask(mask_mod, B, H, Q_LEN, KV_LEN, device=None, BLOCK_SIZE=128,
                      _compile=False) -> BlockMask:
    """The ``BlockMask`` of ``mask_mod(b, h, q_idx, kv_idx)`` over ``[B, H, Q_LEN, KV_LEN]``.

    ``B`` / ``H`` = None build one mask shared by every batch / head (the mod
    then sees b = 0 / h = 0). ``device`` defaults to CUDA when available, else
    CPU. ``BLOCK_SIZE`` is the sparse block size (an int or a (Q, KV) pair).
    ``_compile`` is accepted for torch compatibility; flexgen always generates a kernel.
    Memory is O(B * H * NQ * NKV), never O(Q_LEN * KV_LEN).
    """
    Bn, Hn = _check_length("B", B, True), _check_length("H", H, True)
    Q_LEN, KV_LEN = _check_length("Q_LEN", Q_LEN), _check_length("KV_LEN", KV_LEN)
    q_block, kv_block = _check_block_size(BLOCK_SIZE)
    device = torch.device(device) if device is not None else default_device()
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    traced = trace_cached(mask_mod, "mask_mod")
    lowered = lower(traced)
    check_buffers(traced, device, like="the mask")
    check_call_indices(None, traced, Bn, Hn, Q_LEN, KV_LEN)   # as torch's indexing would raise
    hit = _block_hits(lowered, traced, Bn, Hn, Q_LEN, KV_LEN, q_block, kv_block, device)
    kv_lists, q_lists = _lists(hit)
    mask = BlockMask(*kv_lists, *q_lists, (q_block, kv_block), mask_mod, (Q_LEN, KV_LEN))
    mask._traced = traced
    return mask


def _block_hits(lowered, traced, B, H, Q_LEN, KV_LEN, q_block, kv_block, device) -> torch.Tensor:
    """int32 ``[2, B, H, NQ, NKV]``: which blocks are partial (``[0]``) and which full (``[1]``).

    Interval bounds (``flexgen.bounds.block_flags``) decide most blocks full or
    empty; the others, undecided, are looked at element by element,
    which decides them exactly, and one indexed write stores the element
    pass's partial and full rows. No int8 state tensor is built, and no
    lookup of its values follows.
    """
    shape = (B, H, -(-Q_LEN // q_block), -(-KV_LEN // kv_block))
    hit = torch.empty((2, *shape), dtype=torch.int32, device=device)
    undecided, full = hit.unbind(0)
    _, empty = bounds.block_flags(lowered.expr, B, H, Q_LEN, KV_LEN, q_block, kv_block,
                                  buffer_map(traced), device, out=full)
    # Undecided: neither full nor empty, i.e. full == empty (never both true;
    # were they, the block would count as undecided and be looked at).
    torch.eq(empty.expand(shape), full, out=undecided)
    blocks = undecided.nonzero()                        # [N, 4]: b, h, q block, kv block
    if blocks.shape[0]:
        hit[(slice(None), *blocks.unbind(1))] = _classify_undecided(
            lowered, traced, blocks, Q_LEN, KV_LEN, q_block, kv_block, B, H)
    return hit


def _classify_undecided(lowered, traced, blocks, Q_LEN, KV_LEN, q_block, kv_block, B=None, H=None):
    """int32 [2, N]: whether each undecided block is partial, and whether it is full.

    A few blocks are evaluated with torch ops (``flexgen.masks.mask_eval``), which
    costs no kernel compile; many, or a mask the torch path cannot run, go
    to the generated block-mask kernel.
    """
    if blocks.shape[0] * q_block * kv_block <= mask_eval.TORCH_MAX_ELEMENTS:
        try:
            return mask_eval.classify_blocks(lowered, traced.buffers, blocks, Q_LEN, KV_LEN,
                                             q_block, kv_block, hits=True, B=B, H=H)
        except mask_eval.Unsupported:
            pass
    device = blocks.device
    hits = torch.empty(2, blocks.shape[0], dtype=torch.int32, device=device)
    spec = KernelSpec("block_mask", mask=lowered.snippet, mask_buffers=lowered.buffers, num_warps=4)
    # The kernel reads nonzero's int64 rows through their strides (column-major on a GPU).
    launch.run(spec, device, blocks, hits, traced.buffers, Q_LEN, KV_LEN, q_block, kv_block)
    return hits


def create_mask(mod, B, H, Q_LEN, KV_LEN, device=None) -> torch.Tensor:
    """The dense bool mask ``[B, H, Q_LEN, KV_LEN]`` of a mask_mod (or ``score_mod != -inf``).

    This materializes O(Q_LEN * KV_LEN) memory: for inspection and tests.
    """
    from ..reference import dense_mask, index_grids
    device = torch.device(device) if device is not None else default_device()
    Bn, Hn = B or 1, H or 1
    names = getattr(getattr(mod, "__code__", None), "co_argcount", 4)
    # The same TraceError as every other entry point for a mod flexgen cannot run (a mask_mod
    # returning floats, say), though the mask itself is evaluated with torch below.
    trace_cached(mod, "score_mod" if names == 5 else "mask_mod")
    if names == 5:
        b, h, q, kv = index_grids(Bn, Hn, Q_LEN, KV_LEN, device)
        scores = torch.zeros(Bn, Hn, Q_LEN, KV_LEN, device=device)
        return mod(scores, b, h, q, kv) != float("-inf")
    return dense_mask(mod, Bn, Hn, Q_LEN, KV_LEN, device)
