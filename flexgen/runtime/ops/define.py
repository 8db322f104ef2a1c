"""``op``: a typed Python function as the operator ``torch.ops.flexgen.<name>``.

The schema comes from the function's annotations (``torch.library.infer_schema``,
as ``torch.library.custom_op`` reads it); ``autograd`` says how the op differentiates:

- ``"formula"``: its caller registers a backward (``Op.register_autograd``), as for
  the forward ops (``attention``, ``varlen_attention``, ...);
- ``"none"``: no autograd kernel at all, for the backward ops (``attention_backward``,
  ...). They run inside their forward's formula, which ``once_differentiable`` runs
  without recording a graph (a second derivative through it raises there); called
  with a gradient wanted anyway, the op raises rather than return outputs a backward
  would silently skip;
- ``"integer"``: the outputs are integer tensors, which carry no gradient whatever the
  inputs (a block mask's lists): no autograd kernel, and no guard either;
- ``"raises"``: a call works and a backward through its outputs raises (decode, the
  paged cache's writes): ``torch.library.custom_op`` with no formula.

Why not ``custom_op`` throughout: the first three kinds are defined through one
``torch.library.Library`` instead, the same operator to the dispatcher, dynamo,
AOTAutograd, inductor and torch.export, without custom_op's per-call Python layers
(a wrapper per backend that re-enters dynamo's disable and checks the outputs'
aliasing; an autograd kernel even for an op no gradient passes through). Interleaved in
one process (benchmarks/bench_op_host.py), the attention layer of a compiled training step
(its forward and backward op, with ``Op.register_autograd``'s direct path) took 66-80 us less
host time this way on H200 hosts (forward 26-28, backward 41-52; dev CPU 11 and 33), where
such steps are bound by their host (benchmarks/NOTES.md, 2026-11-28). Our implementations
return fresh tensors, which is what custom_op's aliasing check verified.
"""
from __future__ import annotations

import functools

import torch
from torch.utils import _pytree

from ...errors import FlexgenError

LIBRARY = torch.library.Library("flexgen", "DEF")
# Real tensors: FakeTensor, FunctionalTensor and the other tracing wrappers are subclasses.
PLAIN = (torch.Tensor, torch.nn.Parameter)


def _runs_directly(args) -> bool:
    """Whether a call reaching an op's autograd kernel can run the implementation right there:
    no gradient wanted, and nothing below autograd to pass through (real tensors of no subclass,
    no dispatch mode, no functorch transform), as in a compiled graph's forward at run time."""
    if torch.is_grad_enabled() and torch._C._any_requires_grad(*args):
        return False
    if torch._C._len_torch_dispatch_stack() or torch._C._are_functorch_transforms_active():
        return False
    return all(type(t) in PLAIN for a in args for t in (a if isinstance(a, list) else (a,))
               if isinstance(t, torch.Tensor))


class Op:
    """``torch.ops.flexgen.<name>.default``, callable, with custom_op's ``register_fake`` and
    ``register_autograd``."""

    def __init__(self, name: str, impl):
        self.name, self.qualname, self.impl = name, f"flexgen::{name}", impl
        self.default = getattr(torch.ops.flexgen, name).default

    def __call__(self, *args, **kwargs):
        return self.default(*args, **kwargs)

    def register_fake(self, fn):
        torch.library.register_fake(self.qualname, fn, lib=LIBRARY)
        return fn

    def register_autograd(self, backward, *, setup_context):
        """torch.library.register_autograd's kernel, in front of which a call that wants no
        gradient and has nothing below autograd to pass through runs the implementation at
        once: torch's kernel redispatches it (the arguments boxed and unboxed a second time),
        ~35 us of the forward op's ~100 on the H200's host. Where torch lacks the private
        pieces this takes, its public registration alone."""
        try:
            from torch._library.autograd import Info, make_autograd_impl
        except ImportError:
            torch.library.register_autograd(self.qualname, backward, setup_context=setup_context,
                                            lib=LIBRARY)
            return
        formula = make_autograd_impl(self.default, Info(backward, setup_context))
        impl = self.impl

        def kernel(keyset, *args):
            return impl(*args) if _runs_directly(args) else formula(keyset, *args)
        LIBRARY.impl(self.name, torch._disable_dynamo(kernel), "Autograd", with_keyset=True)


def _not_differentiable(name: str, fn):
    """``fn`` that refuses a call wanting a gradient: with no autograd kernel the dispatcher's
    fallback would give its outputs no backward, and a second derivative would be silently 0."""
    def guarded(*args, **kwargs):
        if torch.is_grad_enabled() and torch._C._any_requires_grad(*args, **kwargs):
            raise FlexgenError(
                f"torch.ops.flexgen.{name} is a backward and has no derivative of its own; it was "
                "called with inputs that require grad while grad mode is on (a second derivative, "
                "e.g. backward(create_graph=True) differentiated again). Fix: differentiate "
                "flexgen's attention once, or call the op under torch.no_grad()")
        return fn(*args, **kwargs)
    return guarded


def op(name: str, *, mutates_args=(), tags=(), autograd: str = "raises"):
    """Decorator: the function as ``torch.ops.flexgen.<name>`` (see the module docstring)."""
    def define(fn):
        if autograd == "raises":
            return torch.library.custom_op(f"flexgen::{name}", fn, mutates_args=mutates_args, tags=tags)
        if autograd not in ("formula", "none", "integer"):
            raise ValueError(f"autograd: 'formula', 'none', 'integer' or 'raises', not {autograd!r}")
        LIBRARY.define(name + torch.library.infer_schema(fn, mutates_args=mutates_args), tags=tags)
        impl = _not_differentiable(name, fn) if autograd == "none" else fn
        # Dynamo never traces into an implementation (the op is opaque to it), as custom_op's;
        # torch._dynamo (and sympy with it) is imported at the op's first call, not here.
        LIBRARY.impl(name, torch._disable_dynamo(impl), "CompositeExplicitAutograd")
        return Op(name, fn)
    return define


def once_differentiable(formula):
    """A registered backward ``formula`` run without recording a graph (its backward op has no
    derivative: autograd="none"), as ``torch.autograd.function.once_differentiable`` runs an
    autograd.Function's, for results that hold lists of gradients too. Where the incoming
    gradients require grad (backward(create_graph=True)), its tensors come out behind a node
    that raises if they are differentiated again."""
    @functools.wraps(formula)
    def run(ctx, *grads):
        with torch.no_grad():
            result = formula(ctx, *grads)
        if not (torch.is_grad_enabled()
                and any(isinstance(g, torch.Tensor) and g.requires_grad for g in grads)):
            return result
        flat, spec = _pytree.tree_flatten(result)
        at = [i for i, x in enumerate(flat) if isinstance(x, torch.Tensor)]
        delayed = torch._C._functions.DelayedError(
            b"flexgen's attention is differentiable once: its backward has no derivative", len(at))
        guarded = delayed(*[flat[i].detach().requires_grad_() for i in at])
        for i, t in zip(at, guarded if isinstance(guarded, tuple) else (guarded,)):
            flat[i] = t
        return _pytree.tree_unflatten(flat, spec)
    return run
