"""Eager validation of factory parameters.

Factories check their parameters once, when the mod is built, so a bad
window or a too-small table fails here with a message that names the
argument, not later inside a kernel as an out-of-bounds read.
"""
from __future__ import annotations

import numbers

import torch

from flexgen.errors import expected


def _is_int(value) -> bool:
    return isinstance(value, numbers.Integral) and not isinstance(value, bool)


def positive_int(name: str, value, fix: str) -> int:
    """``value`` as an int >= 1, else InputError."""
    if not _is_int(value) or value < 1:
        raise expected(name, "a positive int", repr(value), fix)
    return int(value)


def nonnegative_int(name: str, value, fix: str) -> int:
    """``value`` as an int >= 0, else InputError."""
    if not _is_int(value) or value < 0:
        raise expected(name, "an int >= 0", repr(value), fix)
    return int(value)


def int_scalar(name: str, value, fix: str):
    """An int, or a 0-d integer tensor (a runtime scalar in the kernel)."""
    if _is_int(value):
        return int(value)
    if isinstance(value, torch.Tensor) and value.dim() == 0 and not value.is_floating_point() \
            and value.dtype != torch.bool and not value.is_complex():
        return value
    raise expected(name, "an int or a 0-d integer tensor", _describe(value), fix)


def positive_number(name: str, value, fix: str) -> float:
    """A finite real number > 0, else InputError."""
    if isinstance(value, bool) or not isinstance(value, numbers.Real) \
            or not (0 < float(value) < float("inf")):
        raise expected(name, "a finite number > 0", repr(value), fix)
    return value


def int_tensor(name: str, value, ndims: tuple, fix: str, min_value: int | None = 0) -> torch.Tensor:
    """A non-empty integer tensor with ``dim() in ndims`` and values >= ``min_value``."""
    if not isinstance(value, torch.Tensor) or value.dtype == torch.bool \
            or value.is_floating_point() or value.is_complex():
        raise expected(name, "an integer tensor", _describe(value), fix)
    if value.dim() not in ndims:
        want = " or ".join(f"{d}-D" for d in ndims)
        raise expected(name, f"a {want} tensor", f"shape {list(value.shape)}", fix)
    if value.numel() == 0:
        raise expected(name, "a non-empty tensor", f"shape {list(value.shape)}", fix)
    if min_value is not None and int(value.min()) < min_value:
        raise expected(name, f"values >= {min_value}", f"a minimum of {int(value.min())}", fix)
    return value


def float_tensor(name: str, value, ndims: tuple, fix: str) -> torch.Tensor:
    """A non-empty floating-point tensor with ``dim() in ndims``."""
    if not isinstance(value, torch.Tensor) or not value.is_floating_point():
        raise expected(name, "a floating-point tensor", _describe(value), fix)
    if value.dim() not in ndims:
        want = " or ".join(f"{d}-D" for d in ndims)
        raise expected(name, f"a {want} tensor", f"shape {list(value.shape)}", fix)
    if value.numel() == 0:
        raise expected(name, "a non-empty tensor", f"shape {list(value.shape)}", fix)
    return value


def callables(name: str, mods: tuple) -> tuple:
    """Every element of ``mods`` callable, else InputError naming the first that is not."""
    for i, mod in enumerate(mods):
        if not callable(mod):
            raise expected(f"{name}[{i}]", "a callable mod", _describe(mod),
                           "pass functions (mods), not their results")
    return mods


def _describe(value) -> str:
    if isinstance(value, torch.Tensor):
        return f"a {value.dtype} tensor of shape {list(value.shape)}"
    return f"{type(value).__name__} {value!r}"
