"""The eager memo's identity checks: what a mod reads, and whether all of it is still the
very same objects (``flexgen.frontend.trace.trace_cached`` uses them)."""
from __future__ import annotations

import dataclasses
import inspect
import types

import torch

from .torch_functions import _FUNCTIONS


# ---------------------------------------------------------------------------- the eager memo
#
# A training or serving loop passes the same mod every step; tracing it again costs far
# more than the rest of a warm call. A trace is reused while the mod provably computes
# the same program: same function, same code, and the very same objects behind every
# name it reads (its globals, closure cells, defaults and keyword defaults, and those of
# the functions it calls), each of a kind whose identity pins what the mod can read
# from it. A tensor counts by identity (its values are read by the kernel at run time);
# a module only if it is a library's (a user module's attributes can be reassigned); a
# class, a config object, a list, a bound method or a partial cannot be pinned: such a
# mod is traced on every call (correct, slower). torch.compile traces every time and
# guards on what the mod read itself.
_RECENT: dict = {}             # id(mod) -> (mod, kind, checks, traced)
# Each entry keeps its mod alive, and with it the tensors the mod captured: a loop that makes
# a mod per step (a document mask per batch) would keep that many batches' tensors. Such mods
# find their program through the shape memo below, so few entries do.
RECENT_MAX = 256
_STABLE_VALUES = (int, float, bool, str, bytes, type(None), torch.Tensor, torch.dtype, torch.device,
                  types.BuiltinFunctionType, type(Ellipsis))
_LIBRARY_MODULES = ("torch", "math", "operator", "numpy", "flexgen", "builtins", "functools",
                    "transformers.masking_utils")


class _Missing:
    """A name a function's code uses that is not one of its globals (an attribute, a builtin)."""


_MISSING = _Missing()


def _pinned(value) -> bool:
    """Whether identity pins everything a mod can read from ``value`` (functions aside)."""
    if isinstance(value, _STABLE_VALUES) or value is _MISSING:
        return True
    if isinstance(value, types.ModuleType):
        name = value.__name__
        return any(name == lib or name.startswith(lib + ".") for lib in _LIBRARY_MODULES)
    if isinstance(value, (tuple, frozenset)):
        return all(_pinned(v) or inspect.isfunction(v) for v in value)
    return _hashable(value) and value in _LIBRARY_CALLABLES


def _library_callables() -> frozenset:
    found = set(_FUNCTIONS)
    for obj in (torch.where, torch.clamp, torch.tensor, torch.full, torch.ones, torch.zeros):
        found.add(obj)
    return frozenset(o for o in found if _hashable(o))


def _hashable(o) -> bool:
    try:
        hash(o)
        return True
    except TypeError:
        return False


def _checks(mod, out: list, depth: int = 0) -> bool:
    """Append (holder, key, expected) identity checks covering what ``mod`` reads; False
    where something it reads cannot be pinned (then the mod is not memoized)."""
    if depth > 8 or not inspect.isfunction(mod):
        return False
    code = mod.__code__
    out.append((mod, "__code__", code))
    out.append((mod, "__defaults__", mod.__defaults__))
    values = list(mod.__defaults__ or ())
    kwdefaults = mod.__kwdefaults__
    out.append((mod, "__kwdefaults__", kwdefaults))
    if kwdefaults:
        # A dict: its entries can change in place, so each one is checked.
        for name, value in kwdefaults.items():
            out.append((kwdefaults, name, value))
            values.append(value)
    g = mod.__globals__
    for name in code.co_names:
        value = g.get(name, _MISSING)
        out.append((g, name, value))
        values.append(value)
    for cell in mod.__closure__ or ():
        try:
            value = cell.cell_contents
        except ValueError:          # an empty cell: calling the mod fails anyway
            return False
        out.append((cell, None, value))
        values.append(value)
    for value in values:
        if inspect.isfunction(value):
            if value is not mod and not _checks(value, out, depth + 1):
                return False
        elif isinstance(value, (tuple, frozenset)):
            for item in value:
                if inspect.isfunction(item) and not _checks(item, out, depth + 1):
                    return False
            if not _pinned(value):
                return False
        elif not _pinned(value):
            return False
    return True


# ---------------------------------------------------------------------------- the shape memo
#
# A mod made afresh at each call, of the same functions over new tensors (transformers builds
# its mask closures at every forward; a training loop makes a document mask per batch), is a
# new object: the memo above misses and tracing costs more than the rest of the mask's build.
# Two such mods compute the same program when they read the same code, the same values where
# they read values, and tensors of the same kind at the same places: their shape (below).
# The program is then the first one's, over the second one's tensors.
_SHAPES: dict = {}             # (kind, shape) -> (the trace without its tensors, where each was read)


def shape_of(mod, checks: list):
    """(the shape of what ``mod`` reads, a hashable key, and the tensors it reads in order of
    first reading), or None where it cannot be pinned. ``checks``: what ``_checks(mod, checks)``
    gave (True)."""
    tensors, first = [], {}

    def shape(value):
        if isinstance(value, torch.Tensor):
            at = first.setdefault(id(value), len(tensors))
            if at == len(tensors):
                tensors.append(value)
            # What a trace reads of a tensor: its kind and layout (never its values), and
            # which other reads are this very tensor (one buffer slot, not two).
            return ("tensor", at, type(value), value.dtype, tuple(value.shape), value.stride(),
                    value.device, value.requires_grad)
        if inspect.isfunction(value):
            return ("function",)              # (its own reads follow in ``checks``)
        if isinstance(value, tuple):
            return ("tuple",) + tuple(shape(v) for v in value)
        if isinstance(value, dict):
            return ("dict",) + tuple(value)   # (its entries follow in ``checks``)
        if isinstance(value, float):
            return (float, repr(value))       # -0.0 and 0.0 are two programs
        if isinstance(value, frozenset) and any(isinstance(v, torch.Tensor) or inspect.isfunction(v)
                                                for v in value):
            raise TypeError                   # (no order to place them in)
        return (type(value), value)           # a code object, a number, a library object...

    try:
        key = (getattr(mod, "__name__", None),) + tuple(shape(value) for _, _, value in checks)
        hash(key)
    except (TypeError, RuntimeError):         # unhashable, or a tensor without strides
        return None
    return key, tensors


def remember_shape(kind: str, shape, traced) -> None:
    """Keep ``traced`` (a trace of a mod whose ``shape_of`` is ``shape``) for mods of that shape."""
    key, tensors = shape
    where = {id(t): i for i, t in enumerate(tensors)}
    if any(id(b) not in where for b in traced.buffers):
        return                   # a buffer the walk does not reach (made by the mod itself)
    if len(_SHAPES) >= 4096:
        _SHAPES.clear()
    # Without its tensors: the entry must not keep a batch's tensors alive.
    _SHAPES[(kind, key)] = (dataclasses.replace(traced, buffers=()),
                            tuple(where[id(b)] for b in traced.buffers))


def recall_shape(kind: str, shape):
    """The trace of a mod of ``shape`` over its own tensors, or None."""
    key, tensors = shape
    hit = _SHAPES.get((kind, key))
    if hit is None:
        return None
    traced, where = hit
    return dataclasses.replace(traced, buffers=tuple(tensors[i] for i in where))


def _unchanged(checks) -> bool:
    for holder, key, expected in checks:
        if key is None:                                   # a closure cell
            try:
                if holder.cell_contents is not expected:
                    return False
            except ValueError:
                return False
        elif isinstance(holder, dict):
            if holder.get(key, _MISSING) is not expected:
                return False
        elif getattr(holder, key) is not expected:
            return False
    return True


_LIBRARY_CALLABLES = _library_callables()
