"""Rows and captured tensors: the element numbers behind a row's shape operations and
broadcasting (plain Python: torch.compile traces it), mapping a builder over rows, and
indexing a captured tensor (a load, a ``View`` or a ``Row``)."""
from __future__ import annotations

import torch

from .program import KIND_OF_DTYPE, _RANK


def _promote_all(items) -> str:
    """The kind torch's promotion gives a row's elements together."""
    return max([_kind(x) for x in items], key=_RANK.get)


def _bool_of(x):
    return _as_bool(_operand(x._tracer, x))


def _positions(shape) -> list:
    """Every position of ``shape``, row-major (plain Python: torch.compile traces it)."""
    out = [()]
    for n in shape:
        out = [p + (i,) for p in out for i in range(n)]
    return out


def _strides(shape) -> list:
    out, step = [], 1
    for n in reversed(shape):
        out.append(step)
        step *= n
    return out[::-1]


def _sizes(args) -> tuple:
    """``f(2, 3)`` or ``f((2, 3))``: the sizes, as torch's shape methods take them."""
    return tuple(args[0]) if len(args) == 1 and isinstance(args[0], (tuple, list, torch.Size)) \
        else tuple(args)


def _grid_index(shape, numbers, parts):
    """(shape, numbers) of ``grid[parts]`` for ints, slices and None, as torch indexes."""
    axes, fixed, d = [], 0, 0
    strides = _strides(shape)
    for k in parts:
        if k is None:
            axes.append(None)
            continue
        if d >= len(shape):
            raise IndexError(f"too many indices for {len(shape)} dims")
        n = shape[d]
        if isinstance(k, slice):
            axes.append((d, list(range(*k.indices(n)))))
        else:
            if not -n <= int(k) < n:
                raise IndexError(f"index {int(k)} is out of bounds for a dim of size {n}")
            fixed += strides[d] * (int(k) % n)
        d += 1
    axes += [(e, list(range(shape[e]))) for e in range(d, len(shape))]
    out_shape = tuple(1 if a is None else len(a[1]) for a in axes)
    out = []
    for pos in _positions(out_shape):
        flat = fixed
        for a, i in zip(axes, pos):
            if a is not None:
                flat += strides[a[0]] * a[1][i]
        out.append(numbers[flat])
    return out_shape, out


def _grid_reshape(shape, numbers, sizes):
    total = len(numbers)
    known = 1
    for n in sizes:
        known *= n if n != -1 else 1
    sizes = tuple(total // known if n == -1 else n for n in sizes)
    check = 1
    for n in sizes:
        check *= n
    if check != total:
        raise ValueError(f"shape {list(sizes)} is invalid for a row of {total} elements")
    return sizes, numbers


def _grid_permute(shape, numbers, dims):
    strides = _strides(shape)
    out_shape = tuple([shape[d] for d in dims])
    out = []
    for pos in _positions(out_shape):
        flat = 0
        for d, i in zip(dims, pos):
            flat += strides[d] * i
        out.append(numbers[flat])
    return out_shape, out


def _broadcast_shape(shapes) -> tuple:
    out = []
    for shape in shapes:
        shape = tuple(shape)
        if len(shape) > len(out):
            out = [1] * (len(shape) - len(out)) + out
        for i, n in enumerate(shape):
            d = len(out) - len(shape) + i
            if n != 1 and out[d] not in (1, n):
                raise ValueError("shapes do not broadcast")
            out[d] = n if n != 1 else out[d]
    return tuple(out)


def _broadcast_numbers(shape, target) -> list:
    """For each position of ``target``, the element number of ``shape`` torch broadcasts there."""
    strides = _strides(shape)
    lead = len(target) - len(shape)
    out = []
    for pos in _positions(target):
        flat = 0
        for d, n in enumerate(shape):
            flat += strides[d] * (0 if n == 1 else pos[lead + d])
        out.append(flat)
    return out


def _check_row_size(tracer: _Tracer, shape, what: str) -> None:
    numel = 1
    for n in shape:
        numel *= n
    if numel > ROW_LIMIT:
        raise tracer.fail(
            f"{what} is combined with traced values element by element: {numel} elements "
            f"(shape {list(shape)}), more than the {ROW_LIMIT} flexgen unrolls per score element",
            "compute the reduction outside the mod into a table indexed by positions "
            "(e.g. dist = torch.cdist(means, means); use dist[q_idx, kv_idx]), or reduce "
            "the captured tensor alone first (x[b].sum(-1) is computed once, outside the kernel)")


def _is_position(k) -> bool:
    """A traced position or a 0-d integer tensor: an index that removes its dim, chosen at run time."""
    return isinstance(k, Proxy) or (isinstance(k, torch.Tensor) and not isinstance(k, (View, Row))
                                    and k.dim() == 0 and not k.dtype.is_floating_point)


def _expand_key(tracer: _Tracer, key, ndim: int) -> list:
    """``key`` as a list with its Ellipsis spelled out as slices."""
    parts = list(key) if isinstance(key, tuple) else [key]
    if sum(k is Ellipsis for k in parts) > 1:
        raise tracer.fail("an index with two '...'", "use at most one Ellipsis, as in torch")
    if any(k is Ellipsis for k in parts):                 # (identity: == on a proxy traces)
        i = next(n for n, k in enumerate(parts) if k is Ellipsis)
        used = sum(k is not None for k in parts) - 1
        parts[i:i + 1] = [slice(None)] * max(0, ndim - used)
    return parts


def _static_key(parts: list) -> tuple:
    """(key with each traced position replaced by ``:``, [(output dim, position)]): applying
    the key keeps a dim where a position is; selecting along it afterwards removes it."""
    static, picks, out = [], [], 0
    for k in parts:
        if _is_position(k):
            picks.append((out, k))
            static.append(slice(None))
            out += 1
        else:
            static.append(k)
            out += 0 if isinstance(k, int) else 1
    return static, picks


def _select(row: "Row", d: int, index):
    """``row`` at traced position ``index`` along dim ``d``."""
    n = row.shape[d]
    i = _operand(row._tracer, index)
    i = _where(_binary("lt", i, 0), _binary("add", i, n), i)      # -1 is the last, as in torch
    lead = (slice(None),) * d
    picked = row[lead + (0,)]
    for j in range(1, n):
        picked = _where(_binary("eq", i, j), row[lead + (j,)], picked)
    return picked


def _reduced_dims(tracer: _Tracer, ndim: int, dim, what: str) -> list:
    if dim is None:
        return list(range(ndim))
    dims = dim if isinstance(dim, (tuple, list)) else (dim,)
    out = []
    for d in dims:
        if not isinstance(d, int) or isinstance(d, bool) or not -max(ndim, 1) <= d < max(ndim, 1):
            raise tracer.fail(f"{what} over dim={dim!r} of a value with {ndim} dims",
                              f"pass dims from {-ndim} to {ndim - 1}")
        out.append(d % max(ndim, 1))
    return sorted(set(out))


def _row_used_as_value(row: "Row"):
    reduce = "reduce the rest to one value with .sum(-1) / .max() / .any(-1) / torch.dot(a, b)"
    if "not indexed" in row._what:
        # A captured tensor met whole (View._what): often a one-element offset, q_idx + pos.
        fix = ("index it with traced positions (e.g. bias[h, q_idx]), capture a 0-d tensor "
               "(pos[0], not pos) or a Python number, or " + reduce)
    else:
        fix = "index every dimension (bias[b, q_idx], or bias[b][q_idx]), or " + reduce
    return row._tracer.fail(
        f"{row._what} was used where one value is needed (it has shape {list(row._shape)})", fix)


def _rows_in(values) -> list:
    return [v for v in values if isinstance(v, (Row, View))]


def _as_row(value) -> "Row":
    return value._row() if isinstance(value, View) else value


def _map_rows(fn, args: tuple, kwargs: dict):
    """``fn`` applied element by element where arguments are rows (broadcast as in torch)."""
    rows = {i: _as_row(a) for i, a in enumerate(args) if isinstance(a, (Row, View))}
    krows = {k: _as_row(v) for k, v in kwargs.items() if isinstance(v, (Row, View))}
    every = list(rows.values()) + list(krows.values())
    tracer, what = every[0]._tracer, every[0]._what
    try:
        shape = _broadcast_shape([r.shape for r in every])
    except ValueError:
        raise tracer.fail("rows of shapes " + ", ".join(str(list(r.shape)) for r in every)
                          + " were combined", "give them shapes that broadcast, as in torch") from None
    _check_row_size(tracer, shape, what)
    # Each row's element at every position of the result, as torch broadcasts.
    spread = {i: [r._items[j] for j in _broadcast_numbers(r.shape, shape)] for i, r in rows.items()}
    kspread = {k: [r._items[j] for j in _broadcast_numbers(r.shape, shape)] for k, r in krows.items()}
    items = []
    for n in range(len(_positions(shape))):
        a = [spread[i][n] if i in spread else v for i, v in enumerate(args)]
        k = {name: kspread[name][n] if name in kspread else v for name, v in kwargs.items()}
        items.append(fn(*a, **k))
    return items[0] if not shape else Row(tracer, shape, items, what)


# ---------------------------------------------------------------------------- captured tensors

def _index(tracer: _Tracer, t, indices: tuple):
    """``t[indices]`` for a captured tensor: a load (every dim indexed) or a ``View``."""
    if isinstance(t, (Proxy, View, Row)):
        raise tracer.fail("a traced value was indexed", "index captured tensors only")
    if any(i is None or i is Ellipsis or isinstance(i, slice) for i in indices):
        return _sliced(tracer, t, indices)
    if any(isinstance(i, (Row, View)) for i in indices):
        # A row of positions (table[ids[b]] with ids[b] a row): one load per element.
        if len(indices) < t.dim():
            raise tracer.fail(f"a captured tensor of shape {list(t.shape)} was indexed with a row "
                              f"of positions and {len(indices)} indices",
                              f"give all {t.dim()} indices when one of them is a row")
        return _map_rows(lambda *ix: _index(tracer, t, ix), tuple(indices), {})
    if t.dtype not in KIND_OF_DTYPE:
        raise tracer.fail(f"captured tensor dtype {t.dtype} is not supported",
                          "use a bool, integer or floating tensor")
    if len(indices) > t.dim():
        raise tracer.fail(f"a captured tensor of shape {list(t.shape)} was indexed with "
                          f"{len(indices)} indices", f"give at most {t.dim()} indices, one per dimension")
    nodes = []
    for i, idx in enumerate(indices):
        if isinstance(idx, (slice, type(None), type(Ellipsis))) or isinstance(idx, View):
            raise tracer.fail(f"index {i} of a captured tensor is {idx!r}",
                              "index with traced integer positions or Python ints only")
        if isinstance(idx, torch.Tensor) and not isinstance(idx, Proxy) and (
                idx.dim() != 0 or idx.dtype.is_floating_point or idx.dtype == torch.bool):
            raise tracer.fail(f"index {i} of a captured tensor is a tensor of shape "
                              f"{list(idx.shape)} and dtype {idx.dtype}",
                              "index with traced positions, Python ints or 0-d integer tensors")
        p = _operand(tracer, idx)
        if p._kind != "i":
            if p._kind == "b":
                p = _cast(p, torch.int32)
            else:
                raise tracer.fail(f"index {i} of a captured tensor has dtype {p.dtype}",
                                  "indices must be integers: use // instead of /, or "
                                  ".to(torch.int32) after torch.floor")
        nodes.append(p)
    if len(indices) < t.dim():
        return View(tracer, t, tuple(indices))
    slot = tracer.slot(t)
    kind = KIND_OF_DTYPE[t.dtype]
    return _proxy(tracer, f"load {kind} {slot} " + " ".join(f"%{p._node}" for p in nodes), kind)


def _sliced(tracer: _Tracer, t, indices: tuple):
    """``t[indices]`` with slices, None or ... among the positions (``bias[q_idx, 1:]``).

    The slices apply to the captured tensor itself (a view, no copy); a traced position
    removes its dim as in torch, so the dims left, in order, are those of the result.
    """
    parts = _expand_key(tracer, indices, t.dim())
    if any(isinstance(k, (Row, View)) for k in parts):
        raise tracer.fail("a captured tensor was indexed with a row of positions and a slice",
                          "index it with one traced position per dim, Python ints or slices")
    static, picks = _static_key(parts)
    moved = t[tuple(static)]
    dims = [d for d, _ in picks]
    moved = moved.movedim(dims, list(range(len(dims)))) if dims else moved
    if not picks:
        return _row_of_tensor(tracer, moved)
    return _index(tracer, moved, tuple(k for _, k in picks))


def _row_of_tensor(tracer: _Tracer, t):
    """A captured tensor sliced statically (``bias[1:3]``): a row of its elements."""
    return View(tracer, t, ())._row() if t.dim() else _index(tracer, t, ())


# Imported after this module's definitions: the note at the end of proxy.py says why.
from .proxy import Proxy, Row, ROW_LIMIT, _Tracer, View  # noqa: E402
from .builders import _as_bool, _binary, _cast, _kind, _operand, _proxy, _where  # noqa: E402
