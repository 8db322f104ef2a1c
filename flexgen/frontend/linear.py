"""The linear-attention mods as kernel code: a decay_mod and a feature_map, with derivatives.

``decay_mod(b, h, t)`` gives the log-decay ``g`` of query head ``h`` at position ``t``;
``feature_map(x)`` maps each entry of the query and the key. Both are traced by the one
tracer (kinds "decay_mod" and "feature_map"), put in canonical form by sympy and printed
like the attention mods (``flexgen.frontend.lowering``). The backward needs:

- ``φ'(x)``, printed together with ``φ(x)`` so what they share is computed once (elu + 1:
  ``where(x > 0, 1, exp(x))``);
- for each captured tensor of the decay_mod that requires grad (the gates), the partial
  derivative of ``g`` with respect to each load of it, and where that load read: the gates
  kernel scatters ``dg * dg/d load`` there (``GateScatter``).

A derivative that does not exist (a feature map through floor, a gate used as an index)
is a ``GradientError`` naming the mod.
"""
from __future__ import annotations

from dataclasses import dataclass

from ..codegen.printer import Address, Snippet, print_address, print_joint
from ..codegen.spec import BufferSig
from ..errors import GradientError
from .expr import FEATURE, POSITION, NotDifferentiable, derivative, load_applications
from .grad import user_text
from .lowering import lower
from .trace import TracedMod


@dataclass(frozen=True)
class GateScatter:
    """One load of a decay_mod's captured tensor whose gradient the gates kernel scatters."""
    buffer: str            # the loaded buffer ("dbuf0")
    grad_name: str         # its float32 gradient buffer ("dbuf0_grad")
    index_text: str        # the index, for the kernel's comment
    partial: str           # code of d g / d (this load), after the statements
    reduce_t: bool         # the index ignores t: sum the tile over its positions first
    address: Address       # where the load read, as an offset into the gradient buffer


@dataclass(frozen=True)
class DecayGrad:
    """What the gates kernel needs: statements, then one GateScatter per differentiated load."""
    lines: tuple
    scatters: tuple
    grad_buffers: tuple    # BufferSig per gradient buffer, in slot order


def _user_text(err) -> str:
    """The sub-expression a NotDifferentiable names, in the mod's own terms."""
    return f"`{user_text(err.part)}`"


def feature_code(traced: TracedMod | None, with_grad: bool) -> tuple:
    """(Snippet computing φ(x), code of φ'(x) after its lines or None) of a feature_map.

    ``with_grad``: the snippet computes the derivative too (the backward kernel); a
    feature_map that cannot be differentiated raises GradientError.
    """
    if traced is None:
        return None, None
    lowered = lower(traced)
    if not with_grad:
        return lowered.snippet, None
    try:
        d = derivative(lowered.expr, FEATURE)
    except NotDifferentiable as err:
        raise GradientError(
            f"feature_map '{traced.name}': its derivative cannot be computed: {err.reason} "
            f"({_user_text(err)}). Fix: keep floor / ceil / sign / integer casts off x, or run "
            "without gradients for query and key") from None
    try:
        joint = print_joint([lowered.expr, d], "f_")
    except RuntimeError as err:
        raise GradientError(f"feature_map '{traced.name}': its derivative cannot be turned into "
                            f"kernel code ({err}). Fix: use the elementwise torch functions the "
                            "tracer lists, or run without gradients") from None
    grad = joint.results[1] if joint.kinds[1] == "float" else f"({joint.results[1]}).to(tl.float32)"
    return Snippet(joint.lines, joint.results[0], joint.kinds[0]), grad


def decay_grad(traced: TracedMod, grad_slots: tuple) -> DecayGrad:
    """The partial derivatives of ``g = decay_mod(b, h, t)`` with respect to the loads of the
    captured tensors in ``grad_slots``, and where each load read."""
    lowered = lower(traced)
    expr = lowered.expr
    names = {f"dbuf{i}": i for i in grad_slots}
    loads, partials = [], []
    for app in load_applications(expr, names):
        slot = names[app.func.__name__]
        try:
            d = derivative(expr, app)
        except NotDifferentiable as err:
            raise GradientError(
                f"decay_mod '{traced.name}': the gradient with respect to captured{slot} (shape "
                f"{list(traced.buffers[slot].shape)}, requires_grad=True) cannot be computed: "
                f"{err.reason} ({_user_text(err)}). Fix: index with integer positions only "
                "and keep the loaded value off floor / ceil / sign / integer casts, or pass the "
                "tensor .detach()-ed if it should not be trained") from None
        if d != 0:
            loads.append(app)
            partials.append(d)
    joint = print_joint(partials, "dg_") if partials else None
    scatters = []
    for n, (app, code) in enumerate(zip(loads, joint.results if joint else ())):
        grad_name = f"{app.func.__name__}_grad"
        scatters.append(GateScatter(
            buffer=app.func.__name__, grad_name=grad_name,
            index_text=", ".join(str(a) for a in app.args), partial=code,
            reduce_t=POSITION not in app.free_symbols,
            address=print_address(app, grad_name, f"a{n}_")))
    grad_buffers = tuple(BufferSig(f"dbuf{i}_grad", traced.buffers[i].dim(), "float32")
                         for i in grad_slots)
    return DecayGrad(joint.lines if joint else (), tuple(scatters), grad_buffers)


__all__ = ["GateScatter", "DecayGrad", "feature_code", "decay_grad"]
