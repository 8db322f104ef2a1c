"""The parts of torch's BlockMask API that are not about building a mask.

``flexgen.BlockMask`` offers what code written for
``torch.nn.attention.flex_attention.BlockMask`` uses — ``as_tuple``, indexing
(``block_mask[:, :, i]``, the decode pattern), ``from_kv_blocks``, ``_adjust``,
pytree flattening — and ``create_mask`` evaluates mods element by element as
torch's does. This module holds the list arithmetic and the torch-facing glue
behind them; ``flexgen.masks.block_mask`` holds the class.

Lists here are torch's layout: per row (a query block, or a kv block for the
transposed lists) a count and the indices of the listed blocks, in increasing
order for lists built here, the other indices following as padding.
"""
from __future__ import annotations

import inspect

import torch
import torch.utils._pytree as pytree

from ..errors import FlexgenError, InputError, TraceError, expected, reported

LIST_NAMES = ("kv_num_blocks", "kv_indices", "full_kv_num_blocks", "full_kv_indices",
              "q_num_blocks", "q_indices", "full_q_num_blocks", "full_q_indices")


try:
    from torch.nn.attention import flex_attention as _torch_flex
except ImportError:  # pragma: no cover - a torch without FlexAttention
    _torch_flex = None

# torch 2.13's BlockMask carries deterministic-backward metadata (dq_write_order and
# friends) between its lists and its block sizes in ``as_tuple``; torch 2.11's does not.
# ``BlockMask.as_tuple`` follows the torch it runs with, so code that unpacks it by
# position keeps working: flexgen has none of that metadata, so those slots are None.
TORCH_DQ_SLOTS = 4 if "dq_write_order" in getattr(getattr(_torch_flex, "BlockMask", None),
                                                  "_TENSOR_ATTRS", ()) else 0


# ---------------------------------------------------------------------------------- lists

def dense_of(num: torch.Tensor, idx: torch.Tensor, cols: int) -> torch.Tensor:
    """int32 ``[..., rows, cols]``: 1 where a block is among the first ``num`` entries of its
    row's list. Entries naming a block at or past ``cols`` are dropped (``_adjust`` crops
    with this). Works on any leading dims, and on the meta device (shapes only)."""
    count = torch.arange(idx.shape[-1], device=idx.device) < num[..., None]
    # Dropped entries are written to an extra last column, cut off afterwards.
    target = torch.where(count & (idx < cols) & (idx >= 0), idx, cols).long()
    dense = torch.zeros(*idx.shape[:-1], cols + 1, dtype=torch.int32, device=idx.device)
    dense.scatter_(-1, target, 1)
    return dense[..., :cols]


def ordered(dense: torch.Tensor) -> tuple:
    """(counts int32 ``[..., rows]``, indices int32 ``[..., rows, cols]``) of a 0/1 int32
    ``[..., rows, cols]``: listed blocks in increasing order, then the others (the
    padding), as ``flexgen.masks.builder.fill_lists`` lays them out."""
    num = dense.sum(-1, dtype=torch.int32)
    idx = dense.sort(dim=-1, descending=True, stable=True).indices.to(torch.int32)
    return num, idx


def transposed(num: torch.Tensor, idx: torch.Tensor) -> tuple:
    """The transposed lists of (counts ``[..., NQ]``, indices ``[..., NQ, NKV]``): per kv
    block, its query blocks (counts ``[..., NKV]``, indices ``[..., NKV, NQ]``)."""
    return ordered(dense_of(num, idx, idx.shape[-1]).transpose(-1, -2))


def cropped(num: torch.Tensor, idx: torch.Tensor, rows: int, cols: int) -> tuple:
    """The lists of the upper-left ``rows x cols`` blocks (``BlockMask._adjust``).

    torch's ``_adjust`` keeps the first ``cols`` entries of each row and counts those
    below the row's count, which is right for causal-like lists but can keep a block past
    ``cols`` (torch 2.13 then fails on a 256 x 256 causal mask cropped to 256 x 128):
    here the listed blocks below ``cols`` are kept, whatever their place in the list.
    """
    return ordered(dense_of(num[..., :rows], idx[..., :rows, :], cols))


def empty_lists(num: torch.Tensor, idx: torch.Tensor) -> tuple:
    """Lists with no block, shaped like (``num``, ``idx``): what stands in for a missing
    full list (the kernels always read both)."""
    return torch.zeros_like(num, dtype=torch.int32), torch.zeros_like(idx, dtype=torch.int32)


def kernel_lists(lists: tuple) -> tuple:
    """The eight lists as the ops take them: int32, ``[B, H, ...]`` (a list sliced down to
    fewer leading dims broadcasts over the missing ones, a dim of 1 as always), missing
    full lists empty, missing q lists computed (a mask built with ``compute_q_blocks=False``).
    """
    kv_num, kv_idx, full_num, full_idx, q_num, q_idx, full_q_num, full_q_idx = lists
    if kv_idx.dim() > 4 or kv_idx.dim() < 2 or kv_num.shape != kv_idx.shape[:-1]:
        raise reported(expected("block_mask", "kv lists [B, H, NQ] and [B, H, NQ, NKV] (or with "
                                "fewer leading dims)", f"{list(kv_num.shape)} and {list(kv_idx.shape)}",
                                "build it with create_block_mask or BlockMask.from_kv_blocks"))
    if full_num is None:
        full_num, full_idx = empty_lists(kv_num, kv_idx)
    if q_num is None:
        q_num, q_idx = transposed(kv_num, kv_idx)
    if full_q_num is None:
        full_q_num, full_q_idx = transposed(full_num, full_idx)
    out = []
    for i, t in enumerate((kv_num, kv_idx, full_num, full_idx, q_num, q_idx, full_q_num, full_q_idx)):
        if t.dtype != torch.int32:
            t = t.to(torch.int32)
        rank = 3 if i % 2 == 0 else 4                     # counts, then indices
        out.append(t.reshape((1,) * (rank - t.dim()) + tuple(t.shape)) if t.dim() < rank else t)
    return tuple(out)


def check_lists(kv_num_blocks, kv_indices, full_kv_num_blocks, full_kv_indices) -> None:
    """``from_kv_blocks``'s arguments: integer tensors, counts shaped like the indices' rows."""
    pairs = [("kv_num_blocks", kv_num_blocks, "kv_indices", kv_indices)]
    if (full_kv_num_blocks is None) != (full_kv_indices is None):
        raise reported(expected("full_kv_num_blocks / full_kv_indices", "both or neither",
                                "only one of them", "pass both lists, or neither (no full blocks)"))
    if full_kv_num_blocks is not None:
        pairs.append(("full_kv_num_blocks", full_kv_num_blocks, "full_kv_indices", full_kv_indices))
    for num_name, num, idx_name, idx in pairs:
        for name, t in ((num_name, num), (idx_name, idx)):
            if not isinstance(t, torch.Tensor) or t.dtype.is_floating_point or t.dtype.is_complex \
                    or t.dtype == torch.bool:
                got = f"dtype {t.dtype}" if isinstance(t, torch.Tensor) else type(t).__name__
                raise reported(expected(name, "an integer tensor (int32)", got,
                                        "pass the lists as int32 tensors"))
        if idx.dim() < 2 or tuple(num.shape) != tuple(idx.shape[:-1]):
            raise reported(expected(f"{num_name} / {idx_name}", "shapes [..., NQ] and [..., NQ, NKV]",
                                    f"{list(num.shape)} and {list(idx.shape)}",
                                    f"give {num_name} one count per row of {idx_name}"))
        if idx.device != kv_indices.device or num.device != kv_indices.device:
            raise reported(expected(idx_name, f"tensors on {kv_indices.device} like kv_indices",
                                    idx.device, "move every list to one device"))
    if full_kv_indices is not None and full_kv_indices.shape != kv_indices.shape:
        raise reported(expected("full_kv_indices", f"the shape of kv_indices {list(kv_indices.shape)}",
                                list(full_kv_indices.shape), "build both lists over the same blocks"))


def check_list_values(lists: tuple, kv_blocks: int) -> None:
    """A caller's kv lists (``from_kv_blocks``: kv_num_blocks, kv_indices, full_kv_num_blocks,
    full_kv_indices) count at most a row's entries and name, among each row's first count
    entries, blocks in [0, kv_blocks): the kernels trust both (where the lengths are multiples
    of the blocks they read keys, and the captured tensors the mods index by key, without a
    bounds check), and a block past the keys would read past them. The padding after a row's
    count is not read. One device sync, at the mask's construction; not while tracing or
    capturing a CUDA graph, whose tensors have no values to read."""
    tensors = [t for t in lists if t is not None]
    if (torch.compiler.is_compiling() or any(type(t) is not torch.Tensor for t in tensors)
            or (tensors[0].is_cuda and torch.cuda.is_current_stream_capturing())):
        return
    checks = []
    for num, idx in zip(lists[0::2], lists[1::2]):
        if num is None:
            continue
        used = torch.arange(idx.shape[-1], device=idx.device) < num[..., None]
        outside = used & ((idx < 0) | (idx >= kv_blocks))
        checks.append(torch.stack([(num < 0).any() | (num > idx.shape[-1]).any(), outside.any()]))
    for (counts_bad, entries_bad), (num_name, idx_name) in zip(
            torch.stack(checks).tolist(), (("kv_num_blocks", "kv_indices"),
                                           ("full_kv_num_blocks", "full_kv_indices"))):
        if counts_bad:
            raise reported(expected(num_name, f"counts from 0 to the rows' {lists[1].shape[-1]} entries",
                                    "a count outside that range", f"count the blocks listed in {idx_name}"))
        if entries_bad:
            raise reported(expected(idx_name, f"blocks 0 .. {kv_blocks - 1} among each row's first "
                                    f"{num_name} entries (KV_LEN / KV_BLOCK, rounded up)",
                                    "a block outside that range",
                                    "list only blocks of the keys, or give seq_lengths covering them"))


# ---------------------------------------------------------------------------------- indexing

def list_index(index, sizes) -> tuple:
    """``block_mask[index]`` as an index of the lists' (batch, head, query block) dims.

    As torch's ``BlockMask.__getitem__``: missing trailing dims are ``:``, an int ``i`` is
    the slice ``i:i+1`` (every dim is kept: a sliced mask stays ``[B, H, NQ, ...]``),
    tensors index as tensors do. Unlike torch's, an int past the end is an error (torch
    gives empty lists), so is a 0-d tensor kept as a dim like an int (torch drops the dim,
    giving lists no kernel can read), and ``...`` / None are refused (torch applies them
    to the counts and the indices differently).
    """
    index = index if isinstance(index, tuple) else (index,)
    if len(index) > 3:
        raise reported(expected("block_mask[index]", "at most 3 indices (batch, head, query block)",
                                f"{len(index)} indices", "index the kv block lists directly"))
    out = []
    for dim, (i, n) in enumerate(zip(index + (slice(None),) * (3 - len(index)), sizes)):
        name = ("batch", "head", "query block")[dim]
        if isinstance(i, torch.Tensor) and i.dim() == 0 and not i.dtype.is_floating_point \
                and i.dtype != torch.bool:
            i = i.reshape(1)
        elif isinstance(i, (int, torch.SymInt)) and not isinstance(i, bool):
            if isinstance(i, int) and not -n <= i < n:
                raise reported(expected("block_mask[index]", f"a {name} index from {-n} to {n - 1}",
                                        i, "index within the mask's lists "
                                        "(a mask built with B or H = None has one batch row or head)"))
            i = slice(i + n, i + n + 1) if i < 0 else slice(i, i + 1)
        elif not isinstance(i, (slice, torch.Tensor)):
            raise reported(expected("block_mask[index]", "ints, slices or integer tensors over (batch, "
                                    "head, query block)", repr(i), "index like block_mask[:, :, i]"))
        out.append(i)
    return tuple(out)


def sliced_mask_mod(b, h, q_idx, kv_idx):
    """The mask_mod of a sliced BlockMask until one is assigned (torch's rule: the mask's
    query blocks no longer start at q_idx 0, so the original mod would be wrong)."""
    raise reported(sliced_error())


def sliced_error() -> InputError:
    return expected(
        "block_mask.mask_mod", "a mask_mod assigned after slicing (block_mask[...] resets it)",
        "the placeholder of a sliced mask",
        "assign one built from the ORIGINAL mask's mod, e.g. for decoding: mask = block_mask[:, :, i]; "
        "mask.mask_mod = lambda b, h, q, kv: block_mask.mask_mod(b, h, q + offset, kv); "
        "mask.seq_lengths = (1, max_len)")


def is_sliced_placeholder(mod) -> bool:
    """The mask_mod a slice leaves: flexgen's or torch's."""
    return mod is sliced_mask_mod or (
        _torch_flex is not None and mod is getattr(_torch_flex, "_sliced_mask_mod_error", None))


# ---------------------------------------------------------------------------------- pytree

def register_pytree(cls) -> None:
    """Make ``cls`` (flexgen's BlockMask) a pytree node: its lists are the children, the
    lengths, block size and mask_mod the context. So ``tree_map`` reaches the lists and a
    mask crosses torch.compile / torch.export boundaries as an input or output (strict
    export too: a function is a constant there).

    TreeSpecs compare the mask_mod by identity (torch's flatten methods wrap it to compare
    code and closure contents): an exported program has the mod's traced program baked
    in, so a matching spec must mean the same mod. torch's own BlockMask has flatten
    methods but torch (2.11, 2.13) does not register them: export refuses torch's mask as
    an input. The mask_mod's captured tensors stay in the context, as in torch 2.11's
    methods (2.13's lift them into leaves)."""

    def flatten(bm):
        # Lists a mask lacks (q lists of compute_q_blocks=False) are named in the
        # context, not passed as None leaves: tree_map(fn) then sees tensors only.
        present = tuple(n for n in LIST_NAMES if getattr(bm, n) is not None)
        return [getattr(bm, n) for n in present], (present, bm.seq_lengths, bm.BLOCK_SIZE, bm.mask_mod)

    def flatten_with_keys(bm):
        children, context = flatten(bm)
        return [(pytree.GetAttrKey(n), t) for n, t in zip(context[0], children)], context

    def unflatten(children, context):
        present, seq_lengths, block_size, mod = context
        lists = dict(zip(present, children))
        return cls(*(lists.get(n) for n in LIST_NAMES), block_size, mod, seq_lengths)

    if cls not in pytree.SUPPORTED_NODES:
        pytree.register_pytree_node(cls, flatten, unflatten, serialized_type_name="flexgen.BlockMask",
                                    flatten_with_keys_fn=flatten_with_keys)


# ---------------------------------------------------------------------------------- create_mask

def mod_kind(mod) -> str:
    """"score_mod" or "mask_mod", by the number of positional arguments without defaults,
    as torch's create_mask decides (5 and 4)."""
    if not callable(mod):
        raise reported(TraceError(f"mod_fn: expected a mask_mod or a score_mod, got "
                                  f"{type(mod).__name__}. Fix: pass a function"))
    if inspect.isfunction(mod):         # what dynamo can read (it cannot run inspect.signature)
        n = mod.__code__.co_argcount - len(mod.__defaults__ or ())
    else:                               # partials, bound methods, callable objects
        try:
            params = inspect.signature(mod).parameters.values()
        except (TypeError, ValueError):
            return "mask_mod"
        n = sum(p.default is inspect.Parameter.empty
                and p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD) for p in params)
    if n not in (4, 5):
        name = getattr(mod, "__name__", type(mod).__name__)
        raise reported(TraceError(
            f"mod_fn '{name}': expected a mask_mod (b, h, q_idx, kv_idx) or a score_mod (score, b, h, "
            f"q_idx, kv_idx), got a function of {n} positional arguments. Fix: define it with 4 or 5"))
    return "score_mod" if n == 5 else "mask_mod"


class _IndexWithTensors(torch.overrides.TorchFunctionMode):
    """``captured[q_idx]`` with a 0-d index tensor, under vmap. Python would turn the index
    into an int (reading a batched value: an error under vmap); ``aten.index`` takes it as
    a tensor, element by element. The idea of torch's TransformGetItemToIndex."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        if func is torch.Tensor.__getitem__:
            base, index = args
            parts = index if isinstance(index, tuple) else (index,)
            if all(isinstance(p, (torch.Tensor, int)) and not isinstance(p, bool) for p in parts):
                return torch.ops.aten.index.Tensor(base, [
                    p if isinstance(p, torch.Tensor) else torch.tensor(p, device=base.device)
                    for p in parts])
        return func(*args, **(kwargs or {}))


# Query rows per evaluation: B*H*rows*KV_LEN elements at most (one row at least), so
# the mod's intermediates (int32 / float) stay a bounded multiple of the bool output.
ROWS_BUDGET = 1 << 24


def evaluate(mod, kind: str, B: int, H: int, Q_LEN: int, KV_LEN: int, device) -> torch.Tensor:
    """bool ``[B, H, Q_LEN, KV_LEN]``: ``mask_mod`` at every position, or ``score_mod(0.0,
    ...) != -inf``; the mod is called on 0-d index tensors (int32, as the kernels and
    flex_attention pass them) through ``torch.vmap``, as torch's create_mask calls it, so a
    mod written for scalars works (``bias[q_idx]``)."""
    name = getattr(mod, "__name__", type(mod).__name__)

    def element(*args):
        out = mod(*args)
        return out if isinstance(out, torch.Tensor) else torch.tensor(out, device=device)

    fn = element
    prefix = (0,) if kind == "score_mod" else ()
    for dims in ((None, None, None, 0), (None, None, 0, None), (None, 0, None, None), (0, None, None, None)):
        fn = torch.vmap(fn, in_dims=prefix + dims)
    index = [torch.arange(n, dtype=torch.int32, device=device) for n in (B, H)]
    kv = torch.arange(KV_LEN, dtype=torch.int32, device=device)
    rows = max(1, ROWS_BUDGET // max(1, B * H * KV_LEN))
    out = torch.empty(B, H, Q_LEN, KV_LEN, dtype=torch.bool, device=device)
    for start in range(0, Q_LEN, rows):
        q = torch.arange(start, min(Q_LEN, start + rows), dtype=torch.int32, device=device)
        args = (*index, q, kv)
        if kind == "score_mod":
            args = (torch.zeros(B, H, q.shape[0], KV_LEN, device=device),) + args
        try:
            with _IndexWithTensors():
                value = fn(*args)
        except FlexgenError:            # the mod's own (a sliced mask's placeholder)
            raise
        except Exception as exc:
            raise reported(TraceError(
                f"{kind} '{name}': evaluating it element by element (torch.vmap) raised "
                f"{type(exc).__name__}: {exc}. Fix: use tensor operations on the arguments "
                "(torch.where, &, |) rather than Python control flow")) from exc
        if kind == "mask_mod" and value.dtype != torch.bool:
            raise reported(TraceError(
                f"mask_mod '{name}': expected it to return a bool (a comparison or a combination "
                f"of comparisons), got a value of dtype {value.dtype}. Fix: return a comparison "
                "such as q_idx >= kv_idx"))
        if value.dim() != 4:
            raise reported(TraceError(
                f"{kind} '{name}': expected one value per position, got a tensor of shape "
                f"{list(value.shape[4:])} per position. Fix: return an expression of the arguments"))
        if kind == "score_mod" and value.dtype == torch.bool:
            raise reported(TraceError(
                f"score_mod '{name}': expected it to return a number (the new score), got a bool. "
                "Fix: to mask positions use a mask_mod, or torch.where(cond, score, -float('inf'))"))
        out[:, :, start:start + q.shape[0]] = value if kind == "mask_mod" else ~torch.isneginf(value)
    return out
