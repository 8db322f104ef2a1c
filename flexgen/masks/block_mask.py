"""Block-sparse masks: which (query block, kv block) tiles a kernel visits.

A ``BlockMask`` holds, per (batch, head, query block), the kv blocks that are
partially masked (mask_mod applied) and those fully kept (mask_mod skipped), and
the transposed lists for the backward pass: torch's BlockMask layout and fields,
so masks move between the two libraries (``mask_inputs`` reads torch's too), and
torch's API on it (indexing, ``from_kv_blocks``, ``_adjust``, ``as_tuple``, pytree
flattening: ``flexgen.masks.torch_compat``), so code written for torch's BlockMask
keeps working. ``create_block_mask`` traces the mask_mod and runs the
``flexgen::block_mask`` op (``flexgen.masks.builder``), which never builds the dense
``[Q_LEN, KV_LEN]`` mask: memory is O(number of blocks). Both run inside torch.compile.
"""
from __future__ import annotations

import torch

from ..errors import expected, reported
from ..mods.combinators import noop_mask
from .states import FULL, PARTIAL
from . import torch_compat
from .builder import fill_lists, hits_of_states, layout, tensor_free_lists
from .torch_compat import LIST_NAMES


def trace_cached(mod, kind: str):
    """``flexgen.frontend.trace.trace_cached``, imported on first use (``import flexgen`` stays cheap)."""
    from ..frontend.trace import trace_cached as trace
    return trace(mod, kind)


# torch's marker for "no block mask" (its _create_empty_block_mask): BLOCK_SIZE of 2**30.
LARGE_SPARSE_BLOCK = 1 << 30


class BlockMask:
    """Which blocks of the ``[Q_LEN, KV_LEN]`` score matrix are partial, full or skipped.

    Same fields as ``torch.nn.attention.flex_attention.BlockMask``:
    ``kv_num_blocks`` ``[B, H, NQ]`` and ``kv_indices`` ``[B, H, NQ, NKV]`` list
    the partially masked kv blocks of each query block (mask_mod applied),
    ``full_kv_*`` the fully unmasked ones (mask_mod skipped); ``q_*`` and
    ``full_q_*`` are the transposed lists (per kv block, its query blocks).
    ``B`` or ``H`` of size 1 broadcasts over the batch or heads. ``mask_mod`` is
    the mod the kernels apply to partial blocks: assigning another one (torch's
    decode pattern: a sliced mask with an offset mod) makes that one run.
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

    @classmethod
    def from_states(cls, states: torch.Tensor, BLOCK_SIZE, mask_mod, seq_lengths) -> "BlockMask":
        """Build the index lists from an int8 ``[B, H, NQ, NKV]`` of EMPTY / PARTIAL / FULL."""
        buf = fill_lists(hits_of_states(states))
        return cls(*layout(*states.shape).views(buf), BLOCK_SIZE, mask_mod, seq_lengths)

    @classmethod
    def from_kv_blocks(cls, kv_num_blocks, kv_indices, full_kv_num_blocks=None, full_kv_indices=None,
                       BLOCK_SIZE=128, mask_mod=None, seq_lengths=None,
                       compute_q_blocks=True, *, dq_write_order=None, dq_write_order_full=None,
                       dq_kv_order=None) -> "BlockMask":
        """A mask from its kv lists (torch's ``BlockMask.from_kv_blocks``).

        ``kv_num_blocks`` ``[B, H, NQ]`` / ``kv_indices`` ``[B, H, NQ, NKV]`` list the partial
        blocks of each query block, ``full_kv_*`` the full ones (None: no full blocks; empty
        lists stand in, the kernels read both). The transposed q lists are computed (None
        with ``compute_q_blocks=False``: flex_attention then computes them per call).
        ``seq_lengths`` defaults to ``(NQ * Q_BLOCK, NKV * KV_BLOCK)`` and ``mask_mod`` to
        ``noop_mask`` (every position of a partial block kept), both as torch does.
        ``dq_write_order*`` / ``dq_kv_order`` (torch's FLASH backend's deterministic backward
        schedule) are accepted and not needed: see ``create_block_mask``.
        """
        torch_compat.check_lists(kv_num_blocks, kv_indices, full_kv_num_blocks, full_kv_indices)
        q_block, kv_block = _check_block_size(BLOCK_SIZE)
        kv_len = kv_indices.shape[-1] * kv_block if seq_lengths is None else seq_lengths[1]
        torch_compat.check_list_values((kv_num_blocks, kv_indices, full_kv_num_blocks, full_kv_indices),
                                       -(-kv_len // kv_block))
        return cls._from_lists(kv_num_blocks, kv_indices, full_kv_num_blocks, full_kv_indices,
                               (q_block, kv_block), mask_mod, seq_lengths, compute_q_blocks)

    @classmethod
    def _from_lists(cls, kv_num_blocks, kv_indices, full_kv_num_blocks, full_kv_indices, block_size,
                    mask_mod, seq_lengths, compute_q_blocks) -> "BlockMask":
        """``from_kv_blocks`` on lists already checked (sliced or cropped from a mask's own, or
        built here): no device sync, so the decode pattern's slice can run in a captured step."""
        q_block, kv_block = block_size
        kv_num_blocks, kv_indices = kv_num_blocks.to(torch.int32), kv_indices.to(torch.int32)
        if full_kv_num_blocks is None:
            full_kv_num_blocks, full_kv_indices = torch_compat.empty_lists(kv_num_blocks, kv_indices)
        else:
            full_kv_num_blocks = full_kv_num_blocks.to(torch.int32)
            full_kv_indices = full_kv_indices.to(torch.int32)
        q_lists = (None,) * 4
        if compute_q_blocks:
            q_lists = (*torch_compat.transposed(kv_num_blocks, kv_indices),
                       *torch_compat.transposed(full_kv_num_blocks, full_kv_indices))
        if seq_lengths is None:
            seq_lengths = (kv_indices.shape[-2] * q_block, kv_indices.shape[-1] * kv_block)
        return cls(kv_num_blocks, kv_indices, full_kv_num_blocks, full_kv_indices, *q_lists,
                   (q_block, kv_block), noop_mask if mask_mod is None else mask_mod, seq_lengths)

    def traced(self):
        """The traced mask_mod: the one assigned now (``trace_cached`` makes a repeat cheap)."""
        return trace_cached(self.mask_mod, "mask_mod")

    def as_tuple(self, flatten: bool = True) -> tuple:
        """torch's tuple form: (Q_LEN, KV_LEN, the eight lists, Q_BLOCK, KV_BLOCK, mask_mod);
        with ``flatten=False`` the lengths and block sizes stay pairs. Under a torch whose
        BlockMask has deterministic-backward metadata (2.13), its four slots follow the
        lists, None here, so the positions are that torch's."""
        lengths, block = ((*self.seq_lengths,), (*self.BLOCK_SIZE,)) if flatten else \
            ((self.seq_lengths,), (self.BLOCK_SIZE,))
        return (*lengths, *(getattr(self, n) for n in LIST_NAMES),
                *(None,) * torch_compat.TORCH_DQ_SLOTS, *block, self.mask_mod)

    @property
    def shape(self) -> tuple:
        """(B, H, Q_LEN, KV_LEN): the lists' leading dims (1 where the mask broadcasts) and
        the lengths it was built for."""
        return tuple(self.kv_indices.shape[:-2]) + tuple(self.seq_lengths)

    def numel(self) -> int:
        """Elements of the mask's shape (not accounting for sparsity), as torch counts them."""
        n = 1
        for size in self.shape:
            n *= size
        return n

    @property
    def device(self) -> torch.device:
        return self.kv_num_blocks.device

    def __getitem__(self, index) -> "BlockMask":
        """The mask of some batch rows, heads or query blocks, as torch's BlockMask slices.

        ``index`` covers (batch, head, query block); an int keeps its dim (``bm[0]`` has
        lists ``[1, H, NQ, ...]``), tensors index as tensors do. The kv lists are sliced
        and the q lists recomputed from them; the lengths stay. The sliced mask's
        ``mask_mod`` is a placeholder that raises until one is assigned (its query blocks no
        longer start at q_idx 0). torch's decode pattern::

            mask = block_mask[:, :, input_pos // block_mask.BLOCK_SIZE[0]]
            mask.mask_mod = lambda b, h, q, kv: block_mask.mask_mod(b, h, q + input_pos, kv)
            mask.seq_lengths = (1, max_len)
            flex_attention(q, k_cache, v_cache, block_mask=mask)   # q [B, H, 1, D]

        (``decode_attention`` reads it with ``q_offsets=0``: q_idx then starts at 0 too.)
        """
        index = torch_compat.list_index(index, self.kv_num_blocks.shape)
        lists = [getattr(self, n)[index] for n in LIST_NAMES[:4]]
        return BlockMask._from_lists(*lists, self.BLOCK_SIZE, torch_compat.sliced_mask_mod,
                                     self.seq_lengths, self.q_indices is not None)

    def _adjust(self, new_q_len: int, new_kv_len: int) -> "BlockMask":
        """The mask cropped to its upper-left ``new_q_len x new_kv_len`` corner (torch's
        ``_adjust``): right for masks whose blocks do not depend on the lengths (causal,
        sliding window), not for every mask_mod. A mask cannot grow: blocks past its
        lengths were never looked at."""
        Q_LEN, KV_LEN = self.seq_lengths
        for name, value, most in (("new_q_len", new_q_len, Q_LEN), ("new_kv_len", new_kv_len, KV_LEN)):
            _check_length(name, value)
            if value > most:
                raise reported(expected(name, f"at most the mask's length {most} (_adjust crops)",
                                        value, "build a new mask with create_block_mask for longer "
                                        "sequences"))
        q_block, kv_block = self.BLOCK_SIZE
        rows, cols = -(-new_q_len // q_block), -(-new_kv_len // kv_block)
        kv = torch_compat.cropped(self.kv_num_blocks, self.kv_indices, rows, cols)
        full = torch_compat.cropped(self.full_kv_num_blocks, self.full_kv_indices, rows, cols)
        return BlockMask._from_lists(*kv, *full, self.BLOCK_SIZE, self.mask_mod, (new_q_len, new_kv_len),
                                     self.q_indices is not None)

    def to_dense(self) -> torch.Tensor:
        """int32 ``[B, H, NQ, NKV]``: 1 where a block is computed (partial or full), else 0."""
        nkv = self.kv_indices.shape[-1]
        return (torch_compat.dense_of(self.kv_num_blocks, self.kv_indices, nkv)
                | torch_compat.dense_of(self.full_kv_num_blocks, self.full_kv_indices, nkv))

    def block_states(self) -> torch.Tensor:
        """int8 ``[B, H, NQ, NKV]``: 0 skipped, 1 partial, 2 full."""
        nkv = self.kv_indices.shape[-1]
        partial = torch_compat.dense_of(self.kv_num_blocks, self.kv_indices, nkv)
        full = torch_compat.dense_of(self.full_kv_num_blocks, self.full_kv_indices, nkv)
        return (partial * PARTIAL + full * FULL).to(torch.int8)

    def sparsity(self) -> float:
        """Percentage of the ``[B, H, Q_LEN, KV_LEN]`` score elements not computed, as torch
        counts it: 100 * (1 - computed blocks * Q_BLOCK * KV_BLOCK / numel()). Blocks at a
        ragged end count whole, so a short mask can read below 0 (torch's too)."""
        if self.device.type == "meta":
            raise reported(expected("block_mask", "a mask with values (sparsity counts blocks)",
                                    "a mask on the meta device (shapes only)",
                                    "build it on 'cpu' or 'cuda'"))
        computed = sum(int(t.sum()) for t in (self.kv_num_blocks, self.full_kv_num_blocks) if t is not None)
        total = self.numel()
        return 100.0 * (1 - computed * self.BLOCK_SIZE[0] * self.BLOCK_SIZE[1] / total) if total else 0.0

    def to(self, device) -> "BlockMask":
        moved = [None if t is None else t.to(device) for t in (getattr(self, n) for n in LIST_NAMES)]
        return BlockMask(*moved, self.BLOCK_SIZE, self.mask_mod, self.seq_lengths)

    def to_string(self, max_blocks: int = 32) -> str:
        """A picture of the block layout: '█' full, '░' partial, ' ' skipped (first batch and head)."""
        states = self.block_states().reshape(-1, *self.kv_indices.shape[-2:])[0]
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
        *lead, Q_LEN, KV_LEN = self.shape
        name = getattr(self.mask_mod, "__name__", type(self.mask_mod).__name__)
        dims = f"B={lead[0]}, H={lead[1]}, " if len(lead) == 2 else f"batch dims {tuple(lead)}, "
        if self.device.type == "meta":      # shapes without values: no sparsity, no picture
            return (f"BlockMask(shape=({dims}Q_LEN={Q_LEN}, KV_LEN={KV_LEN}), "
                    f"BLOCK_SIZE={self.BLOCK_SIZE}, device=meta, mask_mod={name})")
        head = (f"BlockMask(shape=({dims}Q_LEN={Q_LEN}, KV_LEN={KV_LEN}), "
                f"BLOCK_SIZE={self.BLOCK_SIZE}, sparsity={self.sparsity():.2f}%, mask_mod={name})")
        nq, nkv = self.kv_indices.shape[-2:]
        if nq <= 32 and nkv <= 32 and self.kv_indices.numel():
            return head + "\n" + self.to_string()
        return head


def _check_block_size(BLOCK_SIZE) -> tuple:
    sizes = (BLOCK_SIZE, BLOCK_SIZE) if isinstance(BLOCK_SIZE, int) else tuple(BLOCK_SIZE)
    if len(sizes) != 2 or any(not isinstance(s, int) or s < 16 or s & (s - 1) for s in sizes):
        raise reported(expected("BLOCK_SIZE", "a power of two >= 16, or a (Q_BLOCK, KV_BLOCK) pair of "
                                "them", BLOCK_SIZE, "use 128 (the default) or 64"))
    return sizes


def _check_length(name, value, allow_none=False):
    if value is None and allow_none:
        return 1
    if not isinstance(value, (int, torch.SymInt)) or isinstance(value, bool) or value < 1:
        raise reported(expected(name, "a positive int" + (" or None (broadcast)" if allow_none else ""),
                                repr(value), f"pass the {name} of your inputs"))
    return value


def default_device():
    return torch.device("cuda") if torch.cuda.is_available() else torch.device("cpu")


def create_block_mask(mask_mod, B, H, Q_LEN, KV_LEN, device=None, BLOCK_SIZE=128,
                      _compile=False, separate_full_blocks=True, compute_dq_write_order=False,
                      dq_kv_order=True) -> BlockMask:
    """The ``BlockMask`` of ``mask_mod(b, h, q_idx, kv_idx)`` over ``[B, H, Q_LEN, KV_LEN]``.

    ``B`` / ``H`` = None build one mask shared by every batch / head (the mod
    then sees b = 0 / h = 0). ``device`` defaults to CUDA when available, else
    CPU. ``BLOCK_SIZE`` is the sparse block size (an int or a (Q, KV) pair).
    ``separate_full_blocks=False`` (torch's argument) lists every visited block as
    partial, so mask_mod runs on all of them; the full lists are then empty.
    ``_compile`` is accepted for torch compatibility (flexgen's builder is always
    compiled), and so are ``compute_dq_write_order`` / ``dq_kv_order``: torch's schedule
    for a deterministic backward of its FLASH backend, which flexgen's kernels do not read
    (their backward is deterministic under ``torch.use_deterministic_algorithms(True)``). Memory is O(B * H * NQ * NKV), never O(Q_LEN * KV_LEN). Works inside
    torch.compile (one ``flexgen::block_mask`` op). On the ``meta`` device the lists have
    their shapes and no values, as torch's create_block_mask gives there.
    """
    from ..runtime.ops import call_block_mask
    Bn, Hn = _check_length("B", B, True), _check_length("H", H, True)
    Q_LEN, KV_LEN = _check_length("Q_LEN", Q_LEN), _check_length("KV_LEN", KV_LEN)
    q_block, kv_block = _check_block_size(BLOCK_SIZE)
    device = torch.device(device) if device is not None else default_device()
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    traced = trace_cached(mask_mod, "mask_mod")
    lay = layout(Bn, Hn, -(-Q_LEN // q_block), -(-KV_LEN // kv_block))
    if device.type == "meta":
        # torch's create_block_mask works on meta (its dense path is all shape
        # arithmetic), giving a mask to plan shapes with; so does this one: the op's
        # layout, nothing evaluated (the builder's nonzero has no meta kernel).
        lists = lay.views(torch.empty(lay.size, dtype=torch.int32, device=device))
    elif not traced.buffers and not torch.compiler.is_compiling():
        # Shared by every build of this program and sizes (the kernels never write the lists),
        # views included: a model that builds its mask at every step (transformers does) takes
        # the same eight tensors each time. The program's first line, which names the
        # function, plays no part in them.
        from ..frontend.program import LINE_END
        program = traced.graph.partition(LINE_END)[2]
        lists = tensor_free_lists((program, Bn, Hn, Q_LEN, KV_LEN, q_block, kv_block, device),
                                  lambda: lay.views(call_block_mask((), traced.graph, Bn, Hn, Q_LEN, KV_LEN,
                                                                    q_block, kv_block, device)))
    else:
        lists = lay.views(call_block_mask(traced.buffers, traced.graph, Bn, Hn, Q_LEN, KV_LEN, q_block,
                                          kv_block, device))
    mask = BlockMask(*lists, (q_block, kv_block), mask_mod, (Q_LEN, KV_LEN))
    if not separate_full_blocks:
        # Every visited block partial, as torch lists them; O(blocks) more work.
        return BlockMask._from_lists(*torch_compat.ordered(mask.to_dense()), None, None, mask.BLOCK_SIZE,
                                     mask_mod, mask.seq_lengths, True)
    return mask


def mask_inputs(block_mask) -> tuple:
    """What the ops take of a block mask: (mask program text, its captured tensors, the eight
    lists, (Q_BLOCK, KV_BLOCK), (Q_LEN, KV_LEN)); a flexgen or a torch BlockMask, or None.

    Lists missing from a mask (torch's ``separate_full_blocks=False``: empty ones stand in;
    ``compute_q_blocks=False``: computed) or with fewer leading dims are made what the
    kernels read (``torch_compat.kernel_lists``). torch's "no mask" marker (BLOCK_SIZE
    2**30) counts as no mask. A sliced mask whose mask_mod was not assigned is refused.
    """
    if block_mask is None:
        return "", (), (), (), ()
    if not isinstance(block_mask, BlockMask) and not _is_torch_block_mask(block_mask):
        raise reported(expected("block_mask", "a BlockMask (flexgen's or torch's) or None",
                                type(block_mask).__name__, "build it with create_block_mask"))
    if tuple(block_mask.BLOCK_SIZE) == (LARGE_SPARSE_BLOCK, LARGE_SPARSE_BLOCK):
        return "", (), (), (), ()
    if torch_compat.is_sliced_placeholder(block_mask.mask_mod):
        raise reported(torch_compat.sliced_error())
    traced = trace_cached(block_mask.mask_mod, "mask_mod")
    lists = torch_compat.kernel_lists(tuple(getattr(block_mask, n) for n in LIST_NAMES))
    return traced.graph, traced.buffers, lists, tuple(block_mask.BLOCK_SIZE), tuple(block_mask.seq_lengths)


def _is_torch_block_mask(obj) -> bool:
    flex = getattr(torch.nn.attention, "flex_attention", None)
    return flex is not None and isinstance(obj, flex.BlockMask)


def create_mask(mod, B, H, Q_LEN, KV_LEN, device=None) -> torch.Tensor:
    """The dense bool mask ``[B, H, Q_LEN, KV_LEN]`` of a mask_mod, or of a score_mod
    (``score_mod(0.0, b, h, q_idx, kv_idx) != -inf``), told apart by their number of
    arguments as torch's create_mask does.

    As torch's, the mod is called element by element (``torch.vmap`` over 0-d index
    tensors), so a mod written for scalars works (indexing a captured tensor with
    ``q_idx``); indices are int32, as the kernels pass them. A mask_mod must return bools
    (``flexgen.TraceError`` otherwise, as everywhere). Materializes O(B * H * Q_LEN * KV_LEN)
    memory: for inspection and tests. Works under torch.compile.
    """
    kind = torch_compat.mod_kind(mod)
    device = torch.device(device) if device is not None else default_device()
    Bn, Hn = _check_length("B", B, True), _check_length("H", H, True)
    Q_LEN, KV_LEN = _check_length("Q_LEN", Q_LEN), _check_length("KV_LEN", KV_LEN)
    return torch_compat.evaluate(mod, kind, Bn, Hn, Q_LEN, KV_LEN, device)


torch_compat.register_pytree(BlockMask)
