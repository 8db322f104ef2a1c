"""The frozen description of one generated kernel.

A ``KernelSpec`` holds everything the rendered source depends on and nothing
else: the template, the mods' printed snippets (which come from their
canonical sympy form), the captured buffers' dtypes and ranks, head dims,
dtype, and the constexpr launch options. Its ``key`` names the kernel in both
caches. Lengths, batch and head counts are not in it: they are runtime
arguments, so a new length reuses the kernel.
"""
from __future__ import annotations

import functools
import hashlib
import os
from dataclasses import astuple, dataclass

import torch
import triton

from .. import __version__
from ..codegen import debug
from .snippet import Snippet

# (The sigmoid activation left the softmax kernels' sources as they were: no new versions.
# Full-tile mod results and FLEXGEN_DEBUG's kernel_jit changed forward, backward, decode
# and block_mask's; the fused RoPE paged_write's, packed mixed steps decode's. backward 6: the
# tile macros of common.py.jinja; the dQ kernel's dO and out loads spell out their mask
# instead of sharing a v_mask variable. forward 6: varlen's full tiles without bounds checks;
# forward_gluon 2: its varlen form; 3: the Gluon helpers moved into common.py.jinja
# macros shared with backward_gluon; 4: the sigmoid activation, its softmax source unchanged;
# 5 (with forward 7, backward 9, backward_gluon 3): the clamped positions that proven
# captured-tensor loads read. linear 4: key-dim slices (state, output), the prefix kernel
# and the decay forms. block_mask 4: the dense kernel's EVERY, for grids small enough to
# classify every block without the bounds. forward 8: float32 with a block mask visits the
# partial and the full blocks in one loop; other dtypes' sources unchanged. forward 9: every
# dtype does (faster to compile and, on the H100, mostly faster to run). block_lists 1: a
# mask's eight lists from its flags in one launch, on a GPU. Every template's next version
# (forward 10, forward_gluon 6, ...): the exact _tanh of the common helpers takes its series
# below |x| = 1/4, where 1 - exp(-2|x|) cancelled. backward_gluon 5: a query tile's LSE and
# delta rows loaded one element per thread, where they spilled in the score tile's layout.
# forward_gluon 7, backward_gluon 6: the Gluon descriptor helper takes a column count and
# float32 (the fused backward's dQ sum). backward_delta: the fused backward's delta and zeroed
# dQ sum. backward_gluon 8: the fused kernel's shared dSᵀ tile at head dim 128 too (and dK's
# operand there), dQ's product before dK's, the last tile's wait before dK leaves. forward_gluon 8:
# the partial and the full kv tiles in loops of their own. backward_gluon 9: likewise the dQ
# kernel's. forward 11, forward_gluon 9, backward 11, backward_gluon 10: one-dimensional grids,
# block-major where they are a few waves (common.program_block, launch.block_major). forward 12,
# forward_gluon 11, backward 13, backward_gluon 12: a score_mod score + c + a * q_idx + k * kv_idx
# taken as a key term and a row term (KernelSpec.score_terms, flexgen.frontend.terms). forward 13,
# forward_gluon 12: a tile's key term as a shift of the rows' maxima. backward_gluon 13: the dK/dV
# and fused kernels' producer puts each query tile's lse2 and delta rows beside its Q tile.
# backward_delta 2, decode 5: their padded tile loads through common.load_tile, DQ by strides.
# forward_gluon 13: tiles of the padded head dim (HEAD_COLS), the descriptors' blocks too.
# backward_gluon 14: the dQ kernel adds captured tensors' gradients (common.scatter_gradients);
# 15: its diagonal sums rotate the tile in a layout of one thread per column (ROTATE_LAYOUT),
# while dQ's product runs.) forward_gluon 15: the second consumer warpgroup starts a softmax behind.
# forward_gluon 16: an integer-valued score_mod's tile made float32 (it failed to compile).
SIGMOID_REVISION = 4
TEMPLATE_VERSIONS = {"forward": 14, "forward_gluon": 16, "backward_gluon": 16, "backward_delta": 2, "block_mask": 5,
                     "block_lists": 2, "decode": 5, "decode_merge": 2, "paged_write": 3,
                     "backward": 14, "linear": 5, "linear_decode": 2}


def pad_head_dim(d: int) -> int:
    """The power of two >= ``d`` (tl.arange needs one); extra lanes are masked."""
    return max(16, 1 << (d - 1).bit_length())


@dataclass(frozen=True)
class BufferSig:
    """A captured tensor as the kernel sees it: a name, a rank and a dtype."""
    name: str
    ndim: int
    dtype: str


@dataclass(frozen=True)
class KernelSpec:
    template: str
    score: Snippet | None = None
    mask: Snippet | None = None
    # A score_mod score + c + a * q_idx + k * kv_idx: its (k, a, c(anchor)) as Snippets
    # (``flexgen.frontend.terms``), which a softmax template may take instead of ``score`` per
    # element: key steps per score, the row's part in its statistics.
    score_terms: tuple | None = None
    score_buffers: tuple = ()
    mask_buffers: tuple = ()
    qk_head: int = 0
    v_head: int = 0
    dtype: str = ""
    has_block_mask: bool = False
    block_m: int = 0
    block_n: int = 0
    num_warps: int = 4
    num_stages: int = 1
    dot_precision: str = "ieee"
    use_tma: bool = False          # forward, backward: the [B, H, L, D] tensors through TMA descriptors
    # forward, backward, decode, decode_merge: "softmax" (flex_attention) or "sigmoid"
    # (sigmoid_attention: each weight sigmoid(z + bias) on its own, no row normalization).
    activation: str = "softmax"
    debug: bool = debug.DEBUG      # FLEXGEN_DEBUG: loads of captured tensors asserted in bounds
    flexgen_version: str = __version__
    triton_version: str = triton.__version__

    @property
    def template_version(self) -> int:
        return TEMPLATE_VERSIONS[self.template]

    @functools.cached_property
    def key(self) -> str:
        text = repr((self.template_version,) + astuple(self))
        if self.activation == "sigmoid":
            # The sigmoid kernels' own revision (3: tanh.approx on the GPU, from the half argument;
            # 4: the dQ kernel's dz with p's factor first), kept out of the template versions so
            # that the softmax kernels' keys and sources stay as they were.
            text += f" sigmoid revision {SIGMOID_REVISION}"
        return hashlib.sha256(text.encode()).hexdigest()

    @property
    def kernel_name(self) -> str:
        return f"flexgen_{self.template}_{self.key[:12]}"

    def render_context(self) -> dict:
        """The names the Jinja templates use."""
        ctx = {f: getattr(self, f) for f in self.__dataclass_fields__}
        ctx.update(template_version=self.template_version, kernel_name=self.kernel_name,
                   qk_pad=pad_head_dim(self.qk_head) if self.qk_head else 0,
                   v_pad=pad_head_dim(self.v_head) if self.v_head else 0)
        return ctx


@dataclass(frozen=True)
class BlockMaskSpec(KernelSpec):
    """The block-mask builder's ``KernelSpec``: ``dense`` classifies every block of the grid in
    place (no list of the undecided ones, so no host read of its length)."""
    dense: bool = False


@dataclass(frozen=True)
class VarlenSpec(KernelSpec):
    """A forward ``KernelSpec`` over packed variable-length sequences (``flexgen.varlen_attention``).

    The mask's band ``q_idx + kv_lo <= kv_idx <= q_idx + kv_hi`` (``flexgen.masks.ranges``;
    either bound None where the mask sets none) decides which key tiles a query tile
    visits; ``band_exact``: the mask is exactly that band, so tiles inside it skip it.
    """
    varlen: bool = True
    kv_lo: int | None = None
    kv_hi: int | None = None
    band_exact: bool = False


def mod_fields(score, mask, proven=((), ()), terms: bool = True) -> dict:
    """The KernelSpec fields of a lowered score_mod and mask_mod (either may be None).

    A mask that keeps everything (noop_mask) adds no mask code. ``proven``: (score_mod's,
    mask_mod's) loads the host proved in bounds for the call, which the snippets read
    without checks (``flexgen.frontend.lowering.proven_snippet``). ``terms``: whether the
    template takes a separable score_mod's terms (``KernelSpec.score_terms``).
    """
    if any(proven):
        from ..frontend.lowering import proven_snippet
        snippets = [None if m is None else proven_snippet(m, p) for m, p in zip((score, mask), proven)]
    else:
        snippets = [None if m is None else m.snippet for m in (score, mask)]
    return dict(score=snippets[0], score_terms=score.terms if terms and score is not None else None,
                mask=None if mask is None or mask.is_true else snippets[1],
                score_buffers=() if score is None else score.buffers,
                mask_buffers=() if mask is None else mask.buffers)


# fp32 dots on the GPU where torch does not allow tf32: "tf32x3" (three tensor-core products of
# the operands split into high and low tf32 parts: float32's accuracy, not tf32's) rather than
# "ieee", which Triton lowers to unrolled FMA loops: 4.5x the PTX of a bf16 kernel and a first
# compile of 9.2 s against 1.6 s for bf16 on the dev CPU (benchmarks/NOTES.md, "fp32 first
# call"), 24.6 s on the H100 host; tf32x3 compiled in 3.8-4.4 s on the dev CPU (triton 3.9,
# no JIT specialization); in one pass over the block lists (templates/forward.py.jinja,
# one_pass) 1.2 s against 2.3-2.8 s (triton 3.6, "fp32 forward compile").
# FLEXGEN_FP32_DOT=ieee restores plain FMA products (bit-for-bit torch's fp32 matmul without tf32).
FP32_DOT = os.environ.get("FLEXGEN_FP32_DOT", "tf32x3")


def dot_precision(query: torch.Tensor) -> str:
    """fp32 inputs use tf32 on the GPU only where torch allows it for matmuls, as torch does;
    otherwise ``FP32_DOT`` there (float32 accuracy), and "ieee" everywhere else (the CPU's
    interpreter, fp16 / bf16, where the precision does not apply)."""
    if query.dtype != torch.float32 or query.device.type != "cuda":
        return "ieee"
    return gpu_fp32_dot_precision()


def gpu_fp32_dot_precision() -> str:
    """What fp32 dots take on the GPU (``dot_precision``): tf32 where torch allows it."""
    return "tf32" if torch.backends.cuda.matmul.allow_tf32 else FP32_DOT


def tma_layout_ok(shape, strides, itemsize) -> bool:
    """Whether TMA can step through a [B, H, L, D] layout (the base's alignment aside).

    Memoized: a warm backward asks it of eight tensors, ~2.6 us each on the dev CPU."""
    try:
        return _tma_layout_ok(shape, strides, itemsize)
    except TypeError:       # symbolic sizes (dynamic shapes under torch.compile) do not hash
        return _tma_layout_ok.__wrapped__(shape, strides, itemsize)


@functools.lru_cache(maxsize=1024)
def _tma_layout_ok(shape, strides, itemsize) -> bool:
    # A dim of size 1 is never stepped: its stride does not matter (the descriptor gets a
    # valid one, see _descriptor in common.py.jinja). A stepped dim needs a positive stride
    # in 16-byte units: an expanded tensor (stride 0) takes the pointer kernel.
    return (len(shape) == 4 and min(shape) >= 1 and strides[3] == 1
            and all(n == 1 or (s > 0 and (s * itemsize) % 16 == 0)
                    for n, s in zip(shape[:3], strides[:3])))


def tma_addressable(t: torch.Tensor) -> bool:
    """Whether a [B, H, L, D] tensor can back a TMA descriptor: a 16-byte-aligned base, a
    contiguous last dim, and every stepped dim's stride a positive multiple of 16 bytes."""
    return t.data_ptr() % 16 == 0 and tma_layout_ok(t.shape, t.stride(), t.element_size())


@functools.lru_cache(maxsize=None)
def has_tma(device: torch.device) -> bool:
    """Whether kernels on ``device`` can use TMA descriptors (sm_90+; the interpreter emulates them)."""
    if device.type != "cuda":
        return True      # the interpreter emulates descriptors (tests run the TMA kernel on CPU)
    return torch.cuda.get_device_capability(device) >= (9, 0)


_SPECS: dict = {}


def kernel_spec(template: str, spec_class: type = KernelSpec, **fields) -> KernelSpec:
    """The ``KernelSpec`` (or ``spec_class``) for these fields, one instance per distinct spec.

    Reusing the instance keeps its cached key: hashing a new spec (sha256 of
    its fields) costs more than the rest of a warm call.
    """
    memo = (spec_class, template, *sorted(fields.items()))
    spec = _SPECS.get(memo)
    if spec is None:
        if len(_SPECS) > 4096:       # specs made per call (a new mod each time): stay bounded
            _SPECS.clear()
        spec = _SPECS[memo] = spec_class(template, **fields)
    return spec


def clear_memos() -> None:
    _SPECS.clear()
