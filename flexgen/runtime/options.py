"""``kernel_options``: parsed once, checked once, read by every kernel through one object.

A call's ``kernel_options`` dict becomes a ``KernelOptions``; its ``text`` (a
canonical ``key=value;...`` string) is what the custom ops carry and the
planners key on, and ``KernelOptions.from_text`` gives the object back. Each
kernel reads the fields that apply to it (the table in ``OPTIONS``); a field
that does not apply to the kernel a call runs is checked and has no effect,
the same at 16 queries (the decode kernel) as at 17 (the forward kernel).

torch's FlexAttention options that only tune torch's own kernels are accepted
and dropped (``TORCH_ONLY``; their values are checked as torch types them), so a
call written for torch runs unchanged; an unknown key or a wrong value is an
``InputError``.
"""
from __future__ import annotations

from dataclasses import dataclass, fields

from ..errors import expected, reported

# name -> (type, the kernels it applies to, what it sets)
OPTIONS = {
    "BLOCK_M": (int, "forward, backward, decode", "query rows per program (a power of two >= 16)"),
    "BLOCK_N": (int, "forward, backward, decode", "keys per inner step (a power of two >= 16)"),
    "num_warps": (int, "every kernel", "warps per program"),
    "num_stages": (int, "every kernel", "software pipeline stages"),
    "BLOCK_M1": (int, "backward dK/dV", "its query rows (default BLOCK_M), as torch's"),
    "BLOCK_N1": (int, "backward dK/dV", "its key rows (default BLOCK_N), as torch's"),
    "BLOCK_M2": (int, "backward dQ", "its query rows (default BLOCK_M), as torch's"),
    "BLOCK_N2": (int, "backward dQ", "its key rows (default BLOCK_N), as torch's"),
    "USE_TMA": (bool, "forward, backward (sm_90+)", "Q, K, V through TMA descriptors"),
    "NUM_SPLITS": (int, "decode", "programs sharing one sequence's keys (split-K)"),
    "BACKEND": (str, "every call", "which kernel family runs"),
}
# BACKEND values: AUTO picks by shape (the decode kernel for at most 16 queries per
# sequence, else the forward kernel); TRITON always the forward kernel; TRITON_DECODE
# always the decode kernel (torch's names). "tl" is AUTO with Triton-language templates
# only; "gluon" always the Gluon forward kernel and the Gluon dQ and dK/dV backward kernels
# (sm_90, fp16 / bf16, head dims 64, 128 and 256 or padded to them, the backward's 64 and 128;
# anything else is an InputError saying why), or
# the fused Gluon backward where it can run. AUTO picks the Gluon forward for large calls
# (plan.GLUON_AUTO) and the Gluon backward kernels where they were measured ahead (plan's
# GLUON_BACKWARD_MIN_SCORES, GLUON_DKDV_BLOCK_M, GLUON_DQ_AUTO, GLUON_FUSED rules).
BACKENDS = ("AUTO", "TRITON", "TRITON_DECODE", "tl", "gluon")
# torch's options that tune torch's own kernels only: accepted (their values checked as
# torch types them), no effect here. FORCE_USE_FLEX_ATTENTION=True is BACKEND "TRITON".
TORCH_ONLY = {
    "PRESCALE_QK": bool, "ROWS_GUARANTEED_SAFE": bool, "BLOCKS_ARE_CONTIGUOUS": bool,
    "OUTPUT_LOGSUMEXP": bool, "OUTPUT_MAX": bool, "FORCE_USE_FLEX_ATTENTION": bool,
    "WRITE_DQ": bool, "SAFE_HEAD_DIM": bool, "USE_TMA_LOAD": bool, "num_consumer_groups": int,
    "num_buffers_warp_spec": int, "kpack": int, "matrix_instr_nonkdim": int, "waves_per_eu": int,
}


@dataclass(frozen=True)
class KernelOptions:
    """The checked kernel options of one call; None where the caller left the choice to flexgen."""
    BLOCK_M: int | None = None
    BLOCK_N: int | None = None
    num_warps: int | None = None
    num_stages: int | None = None
    BLOCK_M1: int | None = None
    BLOCK_N1: int | None = None
    BLOCK_M2: int | None = None
    BLOCK_N2: int | None = None
    USE_TMA: bool | None = None
    NUM_SPLITS: int | None = None
    BACKEND: str = "AUTO"

    def __post_init__(self):
        # Every flex_attention call reads ``text``: joined once here, not per call (~5 us a call
        # on the dev CPU). Not a cached_property: its lock stops torch.compile's tracing.
        object.__setattr__(self, "_text", ";".join(
            f"{f.name}={getattr(self, f.name)}" for f in fields(self)
            if getattr(self, f.name) is not None and not (f.name == "BACKEND" and self.BACKEND == "AUTO")))

    @property
    def text(self) -> str:
        """The canonical text of the options that are set (what ops carry and planners key on)."""
        return self._text

    @classmethod
    def from_text(cls, text: str) -> "KernelOptions":
        found = _FROM_TEXT.get(text)
        if found is None:
            values = {}
            for item in filter(None, text.split(";")):
                name, value = item.split("=", 1)
                kind = OPTIONS[name][0]
                values[name] = (value == "True") if kind is bool else kind(value)
            if len(_FROM_TEXT) >= 1024:
                _FROM_TEXT.clear()
            found = _FROM_TEXT[text] = cls(**values)
        return found

    def tiles(self, part: str = "") -> dict:
        """The tile fields the caller set, for a kernel ("" forward / decode, "dq", "dkdv" or
        "fused": the dK/dV kernel that also sums dQ)."""
        m, n = {"dkdv": ("BLOCK_M1", "BLOCK_N1"), "fused": ("BLOCK_M1", "BLOCK_N1"),
                "dq": ("BLOCK_M2", "BLOCK_N2")}.get(part, (None, None))
        chosen = {"BLOCK_M": (m and getattr(self, m)) or self.BLOCK_M,
                  "BLOCK_N": (n and getattr(self, n)) or self.BLOCK_N,
                  "num_warps": self.num_warps, "num_stages": self.num_stages}
        return {k: v for k, v in chosen.items() if v is not None}

    @property
    def sets_tiles(self) -> bool:
        """Whether the caller chose any tile (then the autotuner leaves the kernel alone)."""
        return bool(self.tiles()) or any(getattr(self, k) is not None
                                         for k in ("BLOCK_M1", "BLOCK_N1", "BLOCK_M2", "BLOCK_N2"))


_FROM_TEXT: dict = {}


def parse_options(kernel_options) -> KernelOptions:
    """Check a call's ``kernel_options`` (a dict or None) and return the ``KernelOptions``."""
    if kernel_options is None:
        return _DEFAULT
    if not isinstance(kernel_options, dict):
        raise reported(expected("kernel_options", "a dict such as {'BLOCK_M': 64} or None",
                                type(kernel_options).__name__, "pass a dict of option names to values"))
    values = {}
    for name, value in kernel_options.items():
        if name not in OPTIONS and name not in TORCH_ONLY:
            raise reported(expected("kernel_options", f"keys among {sorted(OPTIONS)} (or torch's "
                                    "own, which have no effect here)", repr(name),
                                    "remove the key or fix its spelling"))
        kind = OPTIONS[name][0] if name in OPTIONS else TORCH_ONLY[name]
        if kind is bool:
            if type(value) not in (bool, int) or value not in (0, 1):
                raise reported(expected(f"kernel_options[{name!r}]", "True or False", repr(value),
                                        "pass a bool"))
            value = bool(value)
        elif kind is int:
            # (ROCm's waves_per_eu and matrix_instr_nonkdim may be 0 in torch.)
            least = 1 if name in OPTIONS else 0
            if type(value) is not int or value < least:
                raise reported(expected(f"kernel_options[{name!r}]",
                                        "a positive int" if least else "an int >= 0", repr(value),
                                        "pass an int"))
        if name in TORCH_ONLY:
            if name == "FORCE_USE_FLEX_ATTENTION" and value:
                if "BACKEND" in kernel_options:
                    raise reported(expected("kernel_options", "BACKEND or the older "
                                            "FORCE_USE_FLEX_ATTENTION, not both (torch refuses it too)",
                                            kernel_options, "keep BACKEND only"))
                values["BACKEND"] = "TRITON"
            continue
        elif name == "BACKEND":
            if value not in BACKENDS:
                raise reported(expected("kernel_options['BACKEND']", f"one of {list(BACKENDS)}",
                                        repr(value), "use 'AUTO' (the default), 'TRITON' or "
                                        "'TRITON_DECODE' (or 'tl' / 'gluon'); torch's 'FLASH' is torch's "
                                        "own kernel"))
        values[name] = value
    return KernelOptions(**values) if values else _DEFAULT


_DEFAULT = KernelOptions()
