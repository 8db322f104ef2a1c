"""Render a ``KernelSpec`` into the Python/Triton source of a kernel module."""
from __future__ import annotations

import functools
import importlib.resources

import jinja2

from ..codegen.spec import KernelSpec


@functools.lru_cache(maxsize=1)
def _environment() -> jinja2.Environment:
    # The templates ship inside the package (flexgen.templates), in the wheel
    # and in an editable install alike.
    folder = importlib.resources.files("flexgen.templates")
    return jinja2.Environment(
        loader=jinja2.FileSystemLoader(str(folder)),
        undefined=jinja2.StrictUndefined,   # a missing name is a bug, not an empty hole
        trim_blocks=True, lstrip_blocks=True, keep_trailing_newline=True,
        autoescape=False,
    )


def spec_comment(spec: KernelSpec) -> str:
    """A comment block at the top of the module saying what it computes."""
    lines = [f"# key: {spec.key}", f"# dtype: {spec.dtype}, head dims: qk={spec.qk_head} v={spec.v_head}"]
    if spec.activation != "softmax":
        lines.append(f"# activation: {spec.activation}")
    for label, snippet in (("score_mod", spec.score), ("mask_mod", spec.mask),
                           ("decay_mod", getattr(spec, "decay", None)),
                           ("feature_map", getattr(spec, "feature", None))):
        if snippet is not None:
            lines.append(f"# {label}: {snippet.result}")
    return "\n".join(lines)


def render(spec: KernelSpec) -> str:
    """The complete module source for ``spec`` (deterministic: same spec, same text)."""
    template = _environment().get_template(f"{spec.template}.py.jinja")
    return template.render(**spec.render_context(), spec_comment=spec_comment(spec))
