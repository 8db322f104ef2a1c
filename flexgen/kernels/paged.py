"""A paged KV cache: fixed-size pages shared by many sequences of different lengths.

``PagedKVCache`` owns two caches ``k_cache`` / ``v_cache`` ``[num_pages,
page_size, Hkv, D]``, a page table ``[max_batch, max_pages_per_seq]`` int32
(row ``s``: the physical pages of the sequence in slot ``s``, in logical
order) and the length of each sequence. Pages are handed out as sequences
grow and returned when they finish, so memory follows the tokens actually
cached, not ``max_batch * max_len``::

    cache = PagedKVCache(num_pages=512, page_size=64, num_kv_heads=8, head_dim=128,
                         max_batch=32, max_pages_per_seq=64, dtype=torch.bfloat16, device="cuda")
    slots = [cache.add_sequence() for _ in prompts]
    cache.append(slots, k_prompt, v_prompt, counts=prompt_lengths)   # prefill (padded batch)
    out = cache.attention(q_prompt, slots, mask_mod=causal_mask, q_lengths=prompt_lengths)
    ...
    cache.append(slots, k_tok, v_tok)                                # one token each
    out = cache.attention(q_tok, slots, score_mod=softcap)
    cache.free(slots[0])                                             # its pages are reused

Mods see logical positions: ``kv_idx`` counts the tokens of the sequence and
the queries passed to ``attention`` are its last tokens (``q_idx =
length - q_len + i``). The kernel (``flexgen.kernels.decode``) maps each logical key
position to its page itself.

Block masks are used directly with logical block indices, not converted to
physical ones: build one over the cache's logical length (``block_mask``
below, ``Q_LEN = KV_LEN = max_pages_per_seq * page_size``); the kernel reads
the kv blocks listed for ``q_idx // Q_BLOCK`` and translates each key of a
visited block through the page table. So one mask serves every step and
every page layout (no per-step conversion when pages are allocated, freed or
shuffled), and the mask's block size need not match the page size.

Bookkeeping (which pages a sequence owns, lengths) is mirrored on the host,
so appending and attending never read values back from the GPU; the page
table on the device is updated only when a sequence needs a new page.
"""
from __future__ import annotations

import functools

import torch

from ..errors import InputError, expected
from ..runtime.checks import DTYPES


class CacheFullError(InputError):
    """The paged KV cache has no free page (or sequence slot) for a request."""


def _host_bookkeeping(method):
    """A cache method that allocates pages and counts tokens in Python: torch.compile runs it as
    it is (a graph break; ``fullgraph=True`` refuses it with the reason) rather than trace it,
    where the lengths it reads would be specialized in the graph, one recompile a step. Only a
    trace reaches torch._dynamo (loaded then): torch.compiler.disable at import would import it,
    and sympy with it, into every process that imports flexgen."""
    @functools.wraps(method)
    def call(*args, **kwargs):
        if torch.compiler.is_compiling():
            torch._dynamo.graph_break(msg=_BOOKKEEPING)    # (fullgraph=True: the error, with this)
            return torch.compiler.disable(method)(*args, **kwargs)
        return method(*args, **kwargs)
    return call


_BOOKKEEPING = ("PagedKVCache's page allocation and token counts live in Python; call append / reserve / "
                "add_sequence / free outside the compiled function (cache.attention compiles once)")


def _positive(name, value, fix):
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise expected(name, "a positive int", repr(value), fix)
    return value


class PagedKVCache:
    """Keys and values of up to ``max_batch`` sequences in ``num_pages`` pages of ``page_size`` tokens.

    ``k_cache`` ``[num_pages, page_size, num_kv_heads, head_dim]`` and
    ``v_cache`` (head dim ``v_head_dim``, default ``head_dim``) hold the
    tokens; ``page_table`` ``[max_batch, max_pages_per_seq]`` int32 maps
    (slot, logical page) to a physical page; ``lengths`` ``[max_batch]`` int32
    (on ``device``) is each slot's number of cached tokens. A sequence holds at
    most ``max_pages_per_seq * page_size`` tokens (``max_seq_len``).
    """

    def __init__(self, num_pages, page_size, num_kv_heads, head_dim, max_batch, max_pages_per_seq,
                 dtype=torch.bfloat16, device=None, v_head_dim=None):
        self.num_pages = _positive("num_pages", num_pages, "pass the number of pages to allocate")
        self.page_size = _positive("page_size", page_size, "pass the tokens per page, e.g. 64")
        self.num_kv_heads = _positive("num_kv_heads", num_kv_heads, "pass the model's key/value heads")
        self.head_dim = _positive("head_dim", head_dim, "pass the model's head dim")
        self.v_head_dim = head_dim if v_head_dim is None else _positive(
            "v_head_dim", v_head_dim, "pass the value head dim, or None for head_dim")
        self.max_batch = _positive("max_batch", max_batch, "pass the most sequences cached at once")
        self.max_pages_per_seq = _positive("max_pages_per_seq", max_pages_per_seq,
                                           "pass the most pages one sequence may use")
        for name, d in (("head_dim", self.head_dim), ("v_head_dim", self.v_head_dim)):
            if not 16 <= d <= 256:
                raise expected(name, "a head dim from 16 to 256", d, "pad or split the head dim")
        if dtype not in DTYPES:
            raise expected("dtype", "torch.float16, torch.bfloat16 or torch.float32", dtype,
                           "pick one of those")
        device = torch.device(device if device is not None else
                              ("cuda" if torch.cuda.is_available() else "cpu"))
        self.k_cache = torch.zeros(num_pages, page_size, num_kv_heads, head_dim, dtype=dtype, device=device)
        # The tensor's device names its index ("cuda" -> "cuda:0"), as the inputs' devices do.
        self.dtype, self.device = dtype, self.k_cache.device
        device = self.device
        self.v_cache = torch.zeros(num_pages, page_size, num_kv_heads, self.v_head_dim,
                                   dtype=dtype, device=device)
        # Unused entries point at page 0: a stray read stays inside the cache.
        self.page_table = torch.zeros(max_batch, max_pages_per_seq, dtype=torch.int32, device=device)
        self.lengths = torch.zeros(max_batch, dtype=torch.int32, device=device)
        # Host mirror: no GPU read-back is ever needed for bookkeeping.
        self._lengths = [0] * max_batch
        self._pages = [[] for _ in range(max_batch)]
        self._active = [False] * max_batch
        self._free_pages = list(range(num_pages - 1, -1, -1))     # a stack: lowest ids first
        self._tensors: dict = {}                                  # small cached index tensors
        self._row_views: dict = {}                                # n -> views of the first n rows

    # --- bookkeeping ------------------------------------------------------------------
    @property
    def max_seq_len(self) -> int:
        """The most tokens one sequence can hold (``max_pages_per_seq * page_size``)."""
        return self.max_pages_per_seq * self.page_size

    @property
    def num_free_pages(self) -> int:
        """Pages not held by any sequence."""
        return len(self._free_pages)

    def length(self, slot: int) -> int:
        """Tokens cached for the sequence in ``slot``."""
        return self._lengths[self._check_slot(slot)]

    def pages(self, slot: int) -> list:
        """The physical pages of ``slot``'s sequence, in logical order."""
        return list(self._pages[self._check_slot(slot)])

    @_host_bookkeeping
    def add_sequence(self) -> int:
        """Claim a free slot for a new, empty sequence and return it."""
        for slot, active in enumerate(self._active):
            if not active:
                self._active[slot] = True
                return slot
        raise CacheFullError(f"add_sequence: expected a free sequence slot, got all {self.max_batch} "
                             "in use. Fix: free finished sequences with cache.free(slot), or create "
                             "the cache with a larger max_batch")

    @_host_bookkeeping
    def free(self, slot: int) -> None:
        """End the sequence in ``slot``: its pages go back to the pool, the slot to the free slots."""
        slot = self._check_slot(slot)
        self._free_pages.extend(reversed(self._pages[slot]))
        self._pages[slot] = []
        self._lengths[slot] = 0
        self._active[slot] = False
        self.lengths[slot] = 0

    def _check_slot(self, slot) -> int:
        if isinstance(slot, torch.Tensor) and slot.dim() == 0:
            slot = int(slot)
        if not isinstance(slot, int) or isinstance(slot, bool) or not 0 <= slot < self.max_batch:
            raise expected("slot", f"a sequence slot from 0 to {self.max_batch - 1}", repr(slot),
                           "use a slot returned by cache.add_sequence()")
        if not self._active[slot]:
            raise expected("slot", "a slot holding a sequence", f"slot {slot}, which is free",
                           "call cache.add_sequence() first")
        return slot

    def _slots(self, slots) -> list:
        if isinstance(slots, torch.Tensor):
            slots = slots.reshape(-1).tolist()
        elif isinstance(slots, int):
            slots = [slots]
        slots = list(slots)
        active, n = self._active, self.max_batch
        # The common case (active slots as plain ints) checked inline; anything else
        # goes through _check_slot, which converts or explains.
        if not all(type(s) is int and 0 <= s < n and active[s] for s in slots):
            slots = [self._check_slot(s) for s in slots]
        if len(set(slots)) != len(slots):
            raise expected("slots", "distinct sequence slots", slots, "list each sequence once")
        return slots

    @_host_bookkeeping
    def reserve(self, slots, new_lengths) -> None:
        """Make sure each sequence of ``slots`` has pages for ``new_lengths`` tokens.

        All or nothing: when the pool cannot cover every request, nothing is
        allocated and ``CacheFullError`` is raised.
        """
        slots = self._slots(slots)
        new_lengths = [int(n) for n in new_lengths]
        need = []
        for slot, n in zip(slots, new_lengths):
            if n > self.max_seq_len:
                raise CacheFullError(
                    f"reserve: expected at most {self.max_seq_len} tokens per sequence "
                    f"(max_pages_per_seq={self.max_pages_per_seq} x page_size={self.page_size}), got "
                    f"{n} for slot {slot}. Fix: create the cache with a larger max_pages_per_seq")
            need.append(max(0, -(-n // self.page_size) - len(self._pages[slot])))
        total = sum(need)
        if total > len(self._free_pages):
            raise CacheFullError(
                f"reserve: expected at most {len(self._free_pages)} free pages to be needed, got a "
                f"request for {total} (of {self.num_pages}). Fix: free finished sequences with "
                "cache.free(slot), or create the cache with more num_pages")
        rows, cols, pages = [], [], []
        for slot, count in zip(slots, need):
            for _ in range(count):
                page = self._free_pages.pop()
                rows.append(slot)
                cols.append(len(self._pages[slot]))
                pages.append(page)
                self._pages[slot].append(page)
        if pages:
            index = self._to_device([rows, cols, pages], torch.int64)
            self.page_table[index[0], index[1]] = index[2].to(torch.int32)

    @_host_bookkeeping
    def advance(self, slots, counts) -> None:
        """Count ``counts[b]`` more tokens in the sequence of ``slots[b]``, on the host only.

        For CUDA graphs: a replayed graph that captured ``append`` wrote the tokens and grew
        ``lengths`` on the device, but runs no Python, so the host's lengths (which
        ``reserve``, ``attention`` and ``length`` read) are brought along here. The pages
        must already hold the new tokens (``reserve`` them before the replay: a replay
        cannot allocate).
        """
        slots = self._slots(slots)
        counts = [int(c) for c in counts]
        if len(counts) != len(slots) or min(counts, default=0) < 0:
            raise expected("counts", f"{len(slots)} counts >= 0 (one per slot)", counts,
                           "give each slot's number of tokens the replay appended")
        for s, c in zip(slots, counts):
            if self._lengths[s] + c > len(self._pages[s]) * self.page_size:
                raise expected("slots", "sequences whose reserved pages hold the new tokens",
                               f"slot {s} with {self._lengths[s]} + {c} tokens in "
                               f"{len(self._pages[s])} pages", "call cache.reserve before the replay")
        for s, c in zip(slots, counts):
            self._lengths[s] += c

    def _to_device(self, values, dtype) -> torch.Tensor:
        """``values`` as a tensor on the cache's device, copied without waiting for the GPU."""
        t = torch.tensor(values, dtype=dtype)
        if self.device.type == "cuda":
            # A plain host-to-device copy synchronizes the stream; from pinned memory it is
            # queued (the caching host allocator keeps the block until the copy is done).
            return t.pin_memory().to(self.device, non_blocking=True)
        return t.to(self.device)

    def _index(self, name, values, dtype=torch.int32):
        """A small cached device tensor of ``values`` (no per-step allocation or copy).

        Keyed on the values themselves, so it can never be stale (these tensors are
        flexgen's own and only ever read).
        """
        key = (name, dtype, tuple(values))
        t = self._tensors.get(key)
        if t is None:
            if len(self._tensors) > 256:
                self._tensors.clear()
            t = self._tensors[key] = self._to_device(values, dtype)
        return t

    def _prefix(self, n):
        """Views (page_table[:n], lengths[:n]), kept per n.

        They share the tensors' memory, so a page or length written in place is seen;
        a reassigned (or re-allocated) table or lengths tensor misses.
        """
        table, lengths = self.page_table, self.lengths
        if torch.compiler.is_compiling():      # (a graph's views cost nothing, and it has no pointers)
            return table[:n], lengths[:n]
        hit = self._row_views.get(n)
        if hit is None or hit[0] is not table or hit[1] is not lengths \
                or hit[2].data_ptr() != table.data_ptr() or hit[3].data_ptr() != lengths.data_ptr():
            hit = self._row_views[n] = (table, lengths, table[:n], lengths[:n])
        return hit[2], hit[3]

    def _rows(self, slots):
        """(page table rows, device lengths) of ``slots``: views when they are 0 .. B-1."""
        n = len(slots)
        if slots == list(range(n)):
            return self._prefix(n)
        # Gathered on every call (copies): the table changes in place.
        index = self._index("slots", slots, torch.int64)
        return self.page_table[index], self.lengths[index]

    # --- writing ----------------------------------------------------------------------
    @_host_bookkeeping
    def append(self, slots, key, value, counts=None, *, rope=None, query=None):
        """Append new keys / values to the sequences of ``slots`` (prefill chunks or single tokens).

        key ``[B, Hkv, L, D]``, value ``[B, Hkv, L, Dv]`` (the layout ``flex_attention``
        takes), one row per slot; row ``b`` adds its first ``counts[b]`` tokens
        (default all ``L``; the rest is padding) at positions ``length .. length
        + counts[b] - 1``. Pages are reserved first (all or nothing,
        ``CacheFullError`` when the pool is short); one Triton kernel writes them
        (inputs of another dtype are converted to the cache's first).

        ``rope`` (a ``flexgen.RoPE``): the keys are rotated at those positions in the same
        kernel, and ``query`` ``[B, Hq, L, D]`` (Hq a multiple of Hkv) too, every row at the
        position its token has (padding rows at the positions they would have): returns the
        rotated query (in its dtype), else None. Positions come from the cached lengths:
        decoding needs no position tensor.
        """
        slots = self._slots(slots)
        B = len(slots)
        for name, t, d in (("key", key, self.head_dim), ("value", value, self.v_head_dim)):
            if not isinstance(t, torch.Tensor) or t.dim() != 4 or t.shape[0] != B \
                    or t.shape[1] != self.num_kv_heads or t.shape[3] != d:
                got = list(t.shape) if isinstance(t, torch.Tensor) else type(t).__name__
                raise expected(name, f"a tensor [{B}, {self.num_kv_heads}, L, {d}] (one row per slot)",
                               got, "pass new keys / values as [batch, kv heads, tokens, head dim]")
            if t.device != self.device:
                raise expected(name, f"a tensor on {self.device} like the cache", t.device,
                               f"{name}.to('{self.device}')")
            if t.dtype not in DTYPES:
                raise expected(name, "a float16, bfloat16 or float32 tensor", t.dtype,
                               f"convert it with .to({self.dtype})")
        if key.shape[2] != value.shape[2]:
            raise expected("value", f"{key.shape[2]} tokens like the key", value.shape[2],
                           "append keys and values of the same tokens")
        L = key.shape[2]
        if counts is None:
            counts = [L] * B
        else:
            if isinstance(counts, torch.Tensor):
                counts = counts.reshape(-1).tolist()
            counts = [int(c) for c in counts]
            if len(counts) != B or min(counts) < 0 or max(counts) > L:
                raise expected("counts", f"{B} counts from 0 to {L}", counts,
                               "give each row's number of valid new tokens")
        inv_freq = None
        if rope is not None:
            inv_freq = self._rope_frequencies(rope)
            if query is not None:
                self._check_query(query, B, L)
        elif query is not None:
            raise expected("query", "None without rope", "a tensor",
                           "pass rope=flexgen.RoPE(...) to rotate the query, or leave query out")
        self.reserve(slots, [self._lengths[s] + c for s, c in zip(slots, counts)])
        rotated = None
        if L:
            # Convert in torch (round to nearest even) so the cached values are the same on
            # every backend (the interpreter's float32 -> bfloat16 conversion truncates); the
            # kernel then only copies (or rotates in float32).
            key, value = (t.to(self.dtype) if t.dtype != self.dtype else t for t in (key, value))
            if key.stride(-1) != 1:
                key = key.contiguous()
            if value.stride(-1) != 1:
                value = value.contiguous()
        if inv_freq is not None and L:
            from ..runtime.ops.serving import call_paged_write_rope
            rotated = call_paged_write_rope(
                self.k_cache, self.v_cache, key, value, self.page_table, self._index("slots", slots),
                self.lengths, self._index("counts", counts), inv_freq, rope.dims(self.head_dim),
                bool(rope.interleaved), query)
        elif L and max(counts):
            from ..runtime.ops.serving import call_paged_write
            call_paged_write(self.k_cache, self.v_cache, key, value, self.page_table,
                             self._index("slots", slots), self.lengths, self._index("counts", counts))
        for s, c in zip(slots, counts):
            self._lengths[s] += c
        if slots == list(range(B)) and len(set(counts)) == 1:
            self._prefix(B)[1].add_(counts[0])
        else:     # the slots are distinct: one scatter-add
            self.lengths.index_add_(0, self._index("slots", slots, torch.int64), self._index("counts", counts))
        if query is None:
            return None
        return rotated if rotated is not None else query      # L == 0: nothing to rotate

    def _rope_frequencies(self, rope):
        """``rope``'s frequencies on the cache's device, made once per RoPE."""
        from .rope import RoPE
        if not isinstance(rope, RoPE):
            raise expected("rope", "a flexgen.RoPE or None", type(rope).__name__,
                           "pass rope=flexgen.RoPE(theta=..., rotary_dim=..., interleaved=...)")
        key = ("rope", rope)
        t = self._tensors.get(key)
        if t is None:
            t = self._tensors[key] = rope.inv_freq(self.head_dim, self.device)
        return t

    def _check_query(self, query, B, L):
        if not isinstance(query, torch.Tensor) or query.dim() != 4 or query.shape[0] != B \
                or query.shape[2] != L or query.shape[3] != self.head_dim \
                or query.shape[1] % self.num_kv_heads:
            got = list(query.shape) if isinstance(query, torch.Tensor) else type(query).__name__
            raise expected("query", f"a tensor [{B}, Hq, {L}, {self.head_dim}] with Hq a multiple of "
                           f"{self.num_kv_heads} (the key's rows and tokens)", got,
                           "pass the queries of the tokens appended, as [batch, heads, tokens, head dim]")
        if query.device != self.device or query.dtype not in DTYPES:
            raise expected("query", f"a float16, bfloat16 or float32 tensor on {self.device}",
                           f"{query.dtype} on {query.device}", f"query.to('{self.device}')")

    # --- reading ----------------------------------------------------------------------
    def attention(self, query, slots, score_mod=None, mask_mod=None, block_mask=None, scale=None,
                  return_lse=False, q_lengths=None, num_splits=None, kernel_options=None):
        """Attention of each sequence's newest tokens against everything it has cached.

        query ``[B, Hq, Lq, D]`` (Hq a multiple of the cache's kv heads), one row
        per slot: the queries of the last ``Lq`` tokens appended (or of the last
        ``q_lengths[b]``, the rest of the row being padding), so ``q_idx =
        length - q_len + i`` and ``kv_idx`` runs over the sequence's tokens.
        ``mask_mod`` is applied element-wise; a ``block_mask`` built over the
        logical positions (see ``block_mask``) also skips blocks. Any Lq works:
        a prefill chunk attends to the cached prefix and to itself (pass a
        causal mask). Returns ``out [B, Hq, Lq, Dv]`` (and the LSE ``[B, Hq, Lq]``).

        A mixed step (some sequences prefill a chunk, others decode a token) can also come
        packed, without padding: query ``[total_q, Hq, D]`` holding each slot's rows one after
        another and ``q_lengths`` their counts (0 for a slot with no new token); one launch
        serves them all (one split), returning ``out [total_q, Hq, Dv]`` (and the LSE
        ``[Hq, total_q]``).
        """
        slots = self._slots(slots)
        B = len(slots)
        packed = None
        if isinstance(query, torch.Tensor) and query.dim() == 3:
            packed, query = self._packed_queries(query, B, q_lengths)
            if packed is None:            # no query rows at all: nothing to launch
                out = query.new_empty(0, query.shape[1], self.v_head_dim)
                lse = query.new_empty(query.shape[1], 0, dtype=torch.float32)
                return (out, lse) if return_lse else out
        if not isinstance(query, torch.Tensor) or query.dim() != 4 or query.shape[0] != B:
            got = list(query.shape) if isinstance(query, torch.Tensor) else type(query).__name__
            raise expected("query", f"a tensor [{B}, Hq, Lq, D] (one row per slot) or packed "
                           "[total_q, Hq, D] with q_lengths", got,
                           "pass queries as [batch, heads, tokens, head dim]")
        Lq = query.shape[2]
        # Under torch.compile the host lengths, which change every step, are not read (each read
        # would be a guard, so a recompile a token): the kernel reads the device lengths, the
        # split count comes from the table's capacity and the check below is eager only.
        compiling = torch.compiler.is_compiling()
        lengths = None if compiling else [self._lengths[s] for s in slots]
        if q_lengths is None:
            q_counts = [Lq] * B
        else:
            q_counts = [int(c) for c in (q_lengths.reshape(-1).tolist()
                                         if isinstance(q_lengths, torch.Tensor) else q_lengths)]
            if len(q_counts) != B or min(q_counts) < 0 or max(q_counts) > Lq:
                raise expected("q_lengths", f"{B} counts from 0 to {Lq}", q_counts,
                               "give each row's number of valid query tokens")
        short = [] if compiling else [s for s, n, q in zip(slots, lengths, q_counts) if q > n]
        if short:
            raise expected("query", "no more query tokens than the sequence has cached",
                           f"slot {short[0]} holds {self._lengths[short[0]]} tokens",
                           "append the new tokens' keys and values before attending")
        table, kv_lengths = self._rows(slots)
        q_arg = None if q_lengths is None else self._index("counts", q_counts)
        from ..api import decode_attention
        return decode_attention(query, self.k_cache, self.v_cache, score_mod=score_mod,
                                block_mask=block_mask, scale=scale, enable_gqa=True,
                                return_lse=return_lse, kv_lengths=kv_lengths, page_table=table,
                                mask_mod=mask_mod, q_lengths=q_arg, num_splits=num_splits,
                                kernel_options=kernel_options,
                                max_kv_len=None if compiling else max(lengths, default=0),
                                _host_lengths=None if compiling else (lengths, q_counts), _packed=packed)

    def _packed_queries(self, query, B, q_lengths):
        """((packed query, first rows, longest), the [B, Hq, longest, D] view the kernel reads)."""
        from .decode import packed_view
        if q_lengths is None:
            raise expected("q_lengths", f"{B} query counts with a packed query [total_q, Hq, D]", None,
                           "pass each slot's number of new query tokens (0 for none)")
        counts = [int(c) for c in (q_lengths.reshape(-1).tolist() if isinstance(q_lengths, torch.Tensor)
                                   else q_lengths)]
        if len(counts) != B or min(counts, default=0) < 0 or sum(counts) != query.shape[0]:
            raise expected("q_lengths", f"{B} counts >= 0 summing to the packed query's "
                           f"{query.shape[0]} tokens", counts, "give each slot's number of query rows")
        rows = [0]
        for c in counts:
            rows.append(rows[-1] + c)
        if query.shape[0] == 0:
            return None, query
        longest = max(counts)
        return (query, self._index("rows", rows), longest), packed_view(query, B, longest)

    def block_mask(self, mask_mod, B=None, H=None, BLOCK_SIZE=128):
        """A ``BlockMask`` of ``mask_mod`` over the cache's logical positions.

        ``Q_LEN = KV_LEN = max_seq_len``; build it once and pass it to every
        ``attention`` call (``b`` is the batch row of that call, ``h`` the query
        head; None broadcasts).
        """
        from ..masks.block_mask import create_block_mask
        return create_block_mask(mask_mod, B, H, self.max_seq_len, self.max_seq_len,
                                 device=self.device, BLOCK_SIZE=BLOCK_SIZE)

    def gather(self, slot):
        """The cached (keys ``[Hkv, length, D]``, values ``[Hkv, length, Dv]``) of ``slot``, contiguous."""
        slot = self._check_slot(slot)
        n = self._lengths[slot]
        pages = torch.tensor(self._pages[slot], dtype=torch.long, device=self.device)
        k = self.k_cache[pages].reshape(-1, self.num_kv_heads, self.head_dim)[:n]
        v = self.v_cache[pages].reshape(-1, self.num_kv_heads, self.v_head_dim)[:n]
        return k.permute(1, 0, 2).contiguous(), v.permute(1, 0, 2).contiguous()


def paged_write_spec(k_cache, v_cache):
    """The paged_write kernel's spec for caches ``[pages, page_size, Hkv, D]`` / ``[..., Dv]``."""
    from ..codegen.spec import kernel_spec
    return kernel_spec("paged_write", qk_head=k_cache.shape[3], v_head=v_cache.shape[3],
                       dtype=DTYPES[k_cache.dtype], block_m=64 if k_cache.device.type != "cuda" else 32,
                       num_warps=4)


def run_paged_write(k_cache, v_cache, key, value, page_table, slots, lengths, counts, inv_freq=None,
                    rotary_dim=0, interleaved=False, query=None):
    """Launch the paged_write kernel: ``counts[b]`` tokens of row ``b`` into sequence ``slots[b]``.

    With ``inv_freq`` (RoPE, ``flexgen.kernels.rope``) the keys' first ``rotary_dim`` dims are
    rotated at their positions; returns ``query`` rotated the same way (an empty tensor
    without a query, None without RoPE)."""
    from ..runtime import launch
    spec = paged_write_spec(k_cache, v_cache)
    rope = {}
    q_out = None
    if inv_freq is not None:
        q_out = torch.empty_like(query) if query is not None else key.new_empty((0,))
        rope = dict(inv_freq=inv_freq, rotary_dim=rotary_dim, interleaved=interleaved, query=query,
                    q_out=q_out if query is not None else None)
    launch.run(spec, k_cache.device, dict(k_new=key, v_new=value, k_cache=k_cache, v_cache=v_cache,
                                          page_table=page_table, slots=slots, lengths=lengths,
                                          count=counts, **rope))
    return q_out
