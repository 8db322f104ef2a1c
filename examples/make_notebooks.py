"""Write the example notebooks (examples/*.ipynb) from the cells below.

The notebooks are committed with their outputs cleared; this script is
where they are edited. After changing a cell here, run::

    python examples/make_notebooks.py           # rewrite examples/*.ipynb
    python examples/make_notebooks.py --check   # exit 1 if a notebook differs (tests run this)

Cell ids are derived from the notebook name and the cell's position, so the
files are byte-for-byte reproducible. tests/test_notebooks.py executes each
notebook top to bottom (CPU, Triton interpreter) with nbclient.
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

import nbformat
from nbformat.v4 import new_code_cell, new_markdown_cell, new_notebook

HERE = Path(__file__).resolve().parent


def md(text: str):
    return new_markdown_cell(text.strip("\n"))


def code(text: str):
    return new_code_cell(text.strip("\n"))


SETUP = """
import torch

import flexgen
from flexgen import create_block_mask, flex_attention
from flexgen.reference import flex_attention_reference

# A GPU runs the compiled kernel; without one, the same kernel runs on CPU
# tensors through the Triton interpreter (slow, so the sizes here are small).
device = "cuda" if torch.cuda.is_available() else "cpu"
torch.manual_seed(0)
print("flexgen", flexgen.__version__, "on", device)
"""

QUICKSTART = [
    md("""
# 01 · Quickstart

This notebook teaches the whole flexgen call in five minutes:

1. `flexgen.flex_attention(q, k, v)` is the same call as
   `torch.nn.attention.flex_attention`: plain attention first;
2. a **mask_mod** (`causal`) turned into a `BlockMask` by `create_block_mask`,
   which lets the kernel skip the blocks the mask rules out;
3. a **score_mod** (logit soft-capping) that rewrites every score;
4. bf16 inputs with grouped-query attention (`enable_gqa=True`) and the logsumexp;
5. where the generated kernel lives, and what a repeated call reuses.

Every result is checked against `flexgen.reference.flex_attention_reference`,
the plain-torch oracle computed in float64. On a machine without a GPU the
kernel runs under the Triton interpreter; the sizes are small so that the
whole notebook runs in well under a minute.
"""),
    code(SETUP),
    md("""
## Plain attention

Inputs are `[batch, heads, length, head_dim]`, as in torch. Without mods the
result is `softmax(q kᵀ / √d) v`, the same as
`torch.nn.functional.scaled_dot_product_attention`.
"""),
    code("""
B, H, L, D = 1, 4, 256, 64
q, k, v = (torch.randn(B, H, L, D, device=device) for _ in range(3))

out = flex_attention(q, k, v)
expected = torch.nn.functional.scaled_dot_product_attention(q, k, v)
torch.testing.assert_close(out, expected, atol=1e-4, rtol=1e-4)
print("output", tuple(out.shape), "max |difference| from SDPA:", (out - expected).abs().max().item())
"""),
    md("""
## A mask: causal attention

A mask_mod answers one question per position: may query `q_idx` attend to key
`kv_idx`? `create_block_mask` classifies each `BLOCK_SIZE × BLOCK_SIZE` tile of
the score matrix as *full* (every position kept: `█`), *partial* (the kernel
evaluates the mask: `░`) or *empty* (skipped). It never builds the dense
`[L, L]` mask. `B=None, H=None` share one mask across the batch and heads.
"""),
    code("""
def causal(b, h, q_idx, kv_idx):
    return q_idx >= kv_idx

block_mask = create_block_mask(causal, None, None, L, L, device=device, BLOCK_SIZE=64)
print(block_mask)
"""),
    code("""
out = flex_attention(q, k, v, block_mask=block_mask)
reference = flex_attention_reference(q, k, v, mask_mod=causal)   # float64, dense
torch.testing.assert_close(out.double(), reference, atol=1e-4, rtol=1e-4)
print("max |difference| from the reference:", (out.double() - reference).abs().max().item())
"""),
    md("""
## A score_mod: soft-capping

A score_mod gets each scaled score and its indices and returns a new score.
Gemma 2 squashes attention logits into `(-cap, cap)`. The score_mod and the
mask end up in **one** generated kernel.
"""),
    code("""
def softcap(score, b, h, q_idx, kv_idx):
    return 20.0 * torch.tanh(score / 20.0)

out = flex_attention(q, k, v, score_mod=softcap, block_mask=block_mask)
reference = flex_attention_reference(q, k, v, score_mod=softcap, mask_mod=causal)
torch.testing.assert_close(out.double(), reference, atol=1e-4, rtol=1e-4)
print("soft-capped causal attention matches the reference")
"""),
    md("""
## bf16, grouped-query attention and the logsumexp

With `enable_gqa=True` the query may have a multiple of the key/value heads
(here 8 query heads share 2 KV heads). `return_lse=True` also returns the
natural-log logsumexp of each row, in float32. Ready-made mods live in
`flexgen.mods`; `sliding_window(64)` keeps the 64 most recent keys.
"""),
    code("""
from flexgen.mods import sliding_window

qb = torch.randn(B, 8, L, D, device=device, dtype=torch.bfloat16)
kb, vb = (torch.randn(B, 2, L, D, device=device, dtype=torch.bfloat16) for _ in range(2))
window = sliding_window(64)
window_mask = create_block_mask(window, None, None, L, L, device=device, BLOCK_SIZE=64)

out, lse = flex_attention(qb, kb, vb, block_mask=window_mask, enable_gqa=True, return_lse=True)
ref_out, ref_lse = flex_attention_reference(qb, kb, vb, mask_mod=window, enable_gqa=True,
                                            return_lse=True)
torch.testing.assert_close(out.double(), ref_out, atol=2e-2, rtol=2e-2)   # bf16 output
torch.testing.assert_close(lse.double(), ref_lse, atol=1e-4, rtol=1e-4)   # float32 LSE
print(out.dtype, tuple(out.shape), "| lse", lse.dtype, tuple(lse.shape),
      f"| {window_mask.sparsity():.1f}% of the scores skipped")
"""),
    md("""
## What happened behind the call

The first call with a new combination of mods, dtypes and head dims traces
the mods, simplifies them with sympy, renders a Triton kernel from a
template and writes it to the kernel cache on disk. A repeated call (even with
a new sequence length: lengths are runtime arguments) reuses that kernel:
no sympy, no rendering, no compiling. On CPU nearly all of its time is the
Triton interpreter running the kernel; on a GPU it is a fraction of a millisecond.
`flexgen.kernel_source(...)` shows the generated source; notebook 02 reads one.
"""),
    code("""
import time

from flexgen.codegen.cache import cache_dir

start = time.perf_counter()
flex_attention(q, k, v, score_mod=softcap, block_mask=block_mask)
print(f"repeated call: {time.perf_counter() - start:.3f} s on {device}")
print("generated kernels are kept in", cache_dir())
source = flexgen.kernel_source(q, k, v, score_mod=softcap, block_mask=block_mask)
print("\\n".join(line for line in source.splitlines() if line.startswith("# ")))
"""),
    md("""
## Next

* `02_write_your_own_mod.ipynb`: the rules a mod follows, and reading its kernel;
* `03_mask_gallery.ipynb`: every mask of `flexgen.mods` with its picture;
* `04_composing_variants.ipynb`: `and_masks`, `or_masks` and `compose_score_mods`.
"""),
]

OWN_MOD = [
    md("""
# 02 · Write your own mod, and read the kernel it becomes

This notebook teaches how to write score_mods and mask_mods that flexgen can
compile, and how to read the Triton kernel it generates for them with
`flexgen.kernel_source`. You will see:

1. a score_mod (a relative-position bias) and the exact line of the kernel it becomes;
2. that flexgen simplifies mods with sympy, so equivalent mods share one kernel;
3. captured tensors (kernel arguments, values free to change) versus captured
   Python numbers (constants baked into the kernel);
4. a mask_mod of your own and its `BlockMask`;
5. the one rule that trips people up: no Python `if` on indices; use
   `torch.where`, `&`, `|`, `~`.

Every output is checked against `flexgen.reference.flex_attention_reference`.
"""),
    code(SETUP),
    code("""
B, H, L, D = 1, 2, 128, 32
q, k, v = (torch.randn(B, H, L, D, device=device) for _ in range(3))

def check(out, **mods):
    \"\"\"Compare a flexgen output with the float64 reference for the same mods.\"\"\"
    reference = flex_attention_reference(q, k, v, **mods)
    torch.testing.assert_close(out.double(), reference, atol=1e-4, rtol=1e-4)
    print("matches the reference; max |difference|", f"{(out.double() - reference).abs().max().item():.1e}")
"""),
    md("""
## A score_mod

The signature is torch's: `score_mod(score, b, h, q_idx, kv_idx) -> score`.
The arguments are tensors inside the kernel (a tile of scores and the
matching indices), so write the mod with tensor arithmetic and `torch.*`
functions, as if for one element.
"""),
    code("""
def relative_positional(score, b, h, q_idx, kv_idx):
    return score + (q_idx - kv_idx) / 32

check(flex_attention(q, k, v, score_mod=relative_positional), score_mod=relative_positional)
"""),
    md("""
## Reading the generated kernel

`flexgen.kernel_source` takes the same arguments as `flex_attention` and
returns the module flexgen writes to its cache, without launching anything.
The comment block at the top says what it computes; the score_mod appears
in the kernel loop as the statement that rewrites `qk` right after
`score = qk * SM_SCALE`. The rest is a Flash-Attention-style kernel: an
online softmax over blocks of keys.
"""),
    code("""
source = flexgen.kernel_source(q, k, v, score_mod=relative_positional)
print(source)
"""),
    md("""
## Equivalent mods share one kernel

The traced expression is simplified and put in a canonical form with sympy
before it is printed, so the same arithmetic written differently gives the
same source (and the same cache key). A mod that simplifies to nothing costs
nothing.
"""),
    code("""
def written_differently(score, b, h, q_idx, kv_idx):
    return (score - 0.03125 * kv_idx) + q_idx / 32.0

def does_nothing(score, b, h, q_idx, kv_idx):
    return score * 2.0 / 2.0 + 0.0

def mod_line(score_mod):
    src = flexgen.kernel_source(q, k, v, score_mod=score_mod)
    return next(line for line in src.splitlines() if line.startswith("# score_mod:"))

same = flexgen.kernel_source(q, k, v, score_mod=written_differently) == source
print("same kernel:", same)
print(mod_line(relative_positional))
print(mod_line(written_differently))
print(mod_line(does_nothing))
assert same
"""),
    md("""
## Captured tensors and captured numbers

A mod may read tensors it closes over, indexed by the mod's arguments:
`bias[h, kv_idx]` becomes a load in the kernel, and the tensor is passed as
a kernel argument, so new values never need a new kernel. Keep captured
tensors on the device of `q`. A captured Python number is different: it is
a constant in the kernel, and a new value means a new kernel. Use a 0-d
tensor for a number that changes from call to call.
"""),
    code("""
bias = torch.randn(H, L, device=device)

def learned_bias(score, b, h, q_idx, kv_idx):
    return score + bias[h, kv_idx]

check(flex_attention(q, k, v, score_mod=learned_bias), score_mod=learned_bias)
src = flexgen.kernel_source(q, k, v, score_mod=learned_bias)
print("\\n".join(line.strip() for line in src.splitlines() if "tl.load(sbuf" in line))
"""),
    code("""
def shifted_by(offset):
    def shift(score, b, h, q_idx, kv_idx):
        return score + offset
    return shift

def source_of(mod):
    return flexgen.kernel_source(q, k, v, score_mod=mod)

numbers = source_of(shifted_by(1.0)) == source_of(shifted_by(2.0))
tensors = source_of(shifted_by(torch.tensor(1.0))) == source_of(shifted_by(torch.tensor(2.0)))
print("Python numbers 1.0 and 2.0 share a kernel:", numbers)
print("0-d tensors 1.0 and 2.0 share a kernel:   ", tensors)
assert tensors and not numbers
"""),
    md("""
## A mask_mod of your own

`mask_mod(b, h, q_idx, kv_idx) -> bool`. Combine conditions with `&`, `|`
and `~` (not `and`, `or`, `not`). This one is causal but lets every query see
only every other key, plus itself: a strided pattern. `create_block_mask`
works out which blocks need the mask evaluated (partial) and which can be
skipped; the kernel then applies the mask only in partial blocks.
"""),
    code("""
def strided_causal(b, h, q_idx, kv_idx):
    return (kv_idx <= q_idx) & ((kv_idx % 2 == 0) | (kv_idx == q_idx))

strided_mask = create_block_mask(strided_causal, None, None, L, L, device=device, BLOCK_SIZE=32)
print(strided_mask)
out = flex_attention(q, k, v, score_mod=relative_positional, block_mask=strided_mask)
check(out, score_mod=relative_positional, mask_mod=strided_causal)
src = flexgen.kernel_source(q, k, v, score_mod=relative_positional, block_mask=strided_mask)
print(next(line for line in src.splitlines() if line.startswith("# mask_mod:")))
"""),
    md("""
## The rule: no Python control flow on indices

Inside the kernel `q_idx > kv_idx` is a whole tile of booleans, not one
`True` or `False`, so `if`, `and`, `or`, `not` and `bool()` cannot work.
flexgen says so when it traces the mod, names the mod and the line, and
tells you the fix: `torch.where(cond, a, b)`, and `& | ~`.
"""),
    code("""
def with_an_if(score, b, h, q_idx, kv_idx):
    if q_idx >= kv_idx:
        return score
    return score - 1.0

try:
    flex_attention(q, k, v, score_mod=with_an_if)
except flexgen.TraceError as error:
    print(type(error).__name__ + ":", error)
else:
    raise AssertionError("expected a TraceError")

def with_where(score, b, h, q_idx, kv_idx):
    return torch.where(q_idx >= kv_idx, score, score - 1.0)

check(flex_attention(q, k, v, score_mod=with_where), score_mod=with_where)
"""),
]

MASKS = [
    ("causal_mask", "the lower triangle: a query sees itself and every key before it.",
     "M.causal_mask"),
    ("causal_lower_right", "causal for 64 queries that are the last 64 of 128 keys (decoding "
     "with a KV cache): the triangle's diagonal ends in the bottom-right corner.",
     "M.causal_lower_right(64, 128)", 64, 128),
    ("sliding_window", "each query sees its 24 most recent keys: a diagonal band. Blocks far "
     "from the diagonal are skipped, so the cost grows linearly with the length.",
     "M.sliding_window(24)"),
    ("sliding_window, two-sided", "every key within 12 positions either way.",
     "M.sliding_window(12, causal=False)"),
    ("prefix_lm", "a bidirectional prefix of 40 tokens, then causal: full columns on the left.",
     "M.prefix_lm(40)"),
    ("document_mask", "packed sequences: three documents of 40, 50 and 38 tokens, each "
     "attending only to itself: squares on the diagonal.",
     "M.document_mask(M.doc_ids_from_lengths([40, 50, 38], device=device))"),
    ("attention_sinks", "StreamingLLM: the first 4 tokens plus a window of 16, cut to causal.",
     "M.attention_sinks(4, 16)"),
    ("chunked_local", "causal inside chunks of 32 tokens (Llama 4's local layers): "
     "triangles on the diagonal.", "M.chunked_local(32)"),
    ("dilated_sliding_window", "8 keys spread 3 apart: parallel diagonals.",
     "M.dilated_sliding_window(8, 3)"),
    ("block_causal", "full inside frames of 32 tokens, causal between frames: a staircase.",
     "M.block_causal(32)"),
    ("neighborhood_2d", "a 3 × 5 window around each pixel of an 8 × 16 image (NATTEN): "
     "one band of blocks per image row.", "M.neighborhood_2d(8, 16, 3, 5)"),
    ("kv_padding", "the batch's first sequence has 90 valid keys; padded keys are blank "
     "columns. (The picture shows batch 0.)", "M.kv_padding(torch.tensor([90, 128], device=device))"),
]


def _gallery_cells():
    cells = [
        md("""
# 03 · Mask gallery

This notebook teaches what the masks of `flexgen.mods` look like, and what a
`BlockMask` does with them. `BlockMask.plot()` evaluates the mask on every
position (first batch and head) and draws it with the block grid on top:

* **dark blue**: a *full* block: every position is kept, the kernel skips the mask;
* **orange / pale orange**: a *partial* block: the kernel evaluates the mask
  (kept / masked positions);
* **light grey**: an *empty* block: the kernel never visits it;
* **magenta** would mark a position whose block state is wrong; there is none.

The title gives the block counts and the sparsity, the share of blocks
skipped, which is the share of the work saved. Pictures use 128 tokens and
blocks of 16 so the structure is visible (real runs use blocks of 128; a
picture of a long sequence is refused: build a small mask to look at). The
last cell runs every mask through the generated kernel and checks it
against `flexgen.reference`.
"""),
        code("""
%matplotlib inline
import tempfile
from pathlib import Path

import torch

import flexgen
from flexgen import create_block_mask, flex_attention
from flexgen import mods as M
from flexgen.masks.plot import element_picture
from flexgen.reference import flex_attention_reference

device = "cuda" if torch.cuda.is_available() else "cpu"
L, BLOCK = 128, 16
gallery = {}   # name -> (mask_mod, Q_LEN, KV_LEN)

def show(name, mask_mod, q_len=L, kv_len=L):
    \"\"\"Build the BlockMask of mask_mod, remember it for the final check, return its picture.\"\"\"
    gallery[name] = (mask_mod, q_len, kv_len)
    block_mask = create_block_mask(mask_mod, 2, None, q_len, kv_len, device=device, BLOCK_SIZE=BLOCK)
    return block_mask.plot()
"""),
    ]
    for entry in MASKS:
        name, text, expr = entry[:3]
        sizes = entry[3:]
        cells.append(md(f"## `{name}`\n\n{text[0].upper()}{text[1:]}"))
        args = f"{name!r}, {expr}" + (f", {sizes[0]}, {sizes[1]}" if sizes else "")
        cells.append(code(f"show({args})"))
    cells += [
        md("""
## Saving a picture

`plot(path)` also writes the figure (PNG for a `.png` name). A sequence longer
than `max_len` (256 by default) is refused, since the picture has one cell per
position: build a smaller mask for the picture.
"""),
        code("""
path = Path(tempfile.mkdtemp()) / "causal.png"
create_block_mask(M.causal_mask, 1, 1, L, L, device=device, BLOCK_SIZE=BLOCK).plot(path)
print("wrote", path.name, path.stat().st_size, "bytes")

try:
    create_block_mask(M.causal_mask, 1, 1, 4096, 4096, device=device).plot()
except flexgen.InputError as error:
    print("InputError:", error)
"""),
        md("""
## Every mask, checked

For each mask of the gallery: the block states agree with the dense mask
(no magenta), and the generated kernel's output matches the float64
reference, with GQA (4 query heads, 2 KV heads) and a batch of 2.
"""),
        code("""
torch.manual_seed(0)
for name, (mask_mod, q_len, kv_len) in gallery.items():
    block_mask = create_block_mask(mask_mod, 2, None, q_len, kv_len, device=device, BLOCK_SIZE=32)
    _, _, counts = element_picture(block_mask)
    assert counts["wrong"] == 0, name
    q = torch.randn(2, 4, q_len, 16, device=device)
    k, v = (torch.randn(2, 2, kv_len, 16, device=device) for _ in range(2))
    out = flex_attention(q, k, v, block_mask=block_mask, enable_gqa=True)
    reference = flex_attention_reference(q, k, v, mask_mod=mask_mod, enable_gqa=True)
    torch.testing.assert_close(out.double(), reference, atol=1e-4, rtol=1e-4)
    print(f"{name:28s} ok, {block_mask.sparsity():5.1f}% of the scores skipped")
"""),
    ]
    return cells


COMPOSING = [
    md("""
# 04 · Composing variants

Real models stack several attention variants: packed documents *and* causal,
a sliding window *or* a few sink tokens, ALiBi *then* soft-capping. This
notebook teaches the three combinators of `flexgen.mods`, the same as
torch's:

* `and_masks(a, b, ...)`: keep a position only where every mask keeps it
  (the intersection of the pictures);
* `or_masks(a, b, ...)`: keep it where any one does (the union);
* `compose_score_mods(f, g, ...)`: apply `f`, then `g` to its result.

The result of a combinator is an ordinary mod: it traces like a hand-written
one and compiles into **one** kernel, however many parts it has. Each
composition below is checked against `flexgen.reference`, and its picture
shows how the block sparsity of the parts combines.
"""),
    code("""
%matplotlib inline
import torch

import flexgen
from flexgen import create_block_mask, flex_attention
from flexgen import mods as M
from flexgen.reference import flex_attention_reference

device = "cuda" if torch.cuda.is_available() else "cpu"
torch.manual_seed(0)
B, HQ, HKV, L, D = 2, 4, 2, 128, 32
q = torch.randn(B, HQ, L, D, device=device)
k, v = (torch.randn(B, HKV, L, D, device=device) for _ in range(2))

def run_and_check(score_mod=None, mask_mod=None, mask_batch=None):
    \"\"\"flex_attention with the mods, checked against the float64 reference.\"\"\"
    block_mask = None
    if mask_mod is not None:
        block_mask = create_block_mask(mask_mod, mask_batch, None, L, L, device=device, BLOCK_SIZE=32)
    out = flex_attention(q, k, v, score_mod=score_mod, block_mask=block_mask, enable_gqa=True)
    reference = flex_attention_reference(q, k, v, score_mod=score_mod, mask_mod=mask_mod,
                                         enable_gqa=True)
    torch.testing.assert_close(out.double(), reference, atol=1e-4, rtol=1e-4)
    return block_mask
"""),
    md("""
## `and_masks`: causal attention over packed documents

Two sequences per batch, each packed with documents of different lengths
(`doc_ids` is `[B, L]`, so the mask reads `doc_ids[b, q_idx]`). The
intersection keeps the causal triangle inside each document's square; every
block outside the squares is skipped. Note the sparsity: higher than
either part alone.
"""),
    code("""
doc_ids = torch.stack([M.doc_ids_from_lengths([50, 30, 48]),
                       M.doc_ids_from_lengths([20, 100], total_length=L)]).to(device)
documents = M.document_mask(doc_ids)
packed_causal = M.and_masks(M.causal_mask, documents)
for name, mod in (("causal", M.causal_mask), ("documents", documents), ("both", packed_causal)):
    block_mask = run_and_check(mask_mod=mod, mask_batch=B)
    print(f"{name:10s} {block_mask.sparsity():5.1f}% of the scores skipped (both sequences)")
block_mask.plot()
"""),
    md("""
## `or_masks`: a sliding window plus attention sinks and a prefix

The union of three masks: a causal window of 16 keys, the first 4 tokens
(sinks), and a bidirectional 24-token prefix. The union of parts that are
each sparse can be dense near the left edge; the block mask tracks that.
"""),
    code("""
union = M.or_masks(M.sliding_window(16), M.attention_sinks(4, 1), M.prefix_lm(24))
block_mask = run_and_check(mask_mod=union)
print(block_mask)
block_mask.plot()
"""),
    md("""
## `compose_score_mods`: ALiBi, then soft-capping

Order matters: `compose_score_mods(f, g)` computes `g(f(score))`. Here the
ALiBi distance penalty is added first, and the sum is soft-capped, as in
models that use both. The header of the generated kernel shows the single
expression the two mods became.
"""),
    code("""
alibi_then_cap = M.compose_score_mods(M.alibi(HQ), M.tanh_softcap(5.0))
cap_then_alibi = M.compose_score_mods(M.tanh_softcap(5.0), M.alibi(HQ))
run_and_check(score_mod=alibi_then_cap)
run_and_check(score_mod=cap_then_alibi)

def header(score_mod=None, block_mask=None):
    src = flexgen.kernel_source(q, k, v, score_mod=score_mod, block_mask=block_mask, enable_gqa=True)
    return [line for line in src.splitlines() if line.startswith(("# score_mod:", "# mask_mod:"))]

print(*header(alibi_then_cap), sep="\\n")
print(*header(cap_then_alibi), sep="\\n")
"""),
    md("""
## Everything at once

Packed causal documents, restricted to a 48-token window, with ALiBi and
soft-capping: two combinators nested in one mask, two score_mods composed,
GQA, bf16 inputs. Still one kernel.
"""),
    code("""
mask_mod = M.and_masks(packed_causal, M.sliding_window(48))
score_mod = M.compose_score_mods(M.alibi(HQ), M.tanh_softcap(5.0))
block_mask = create_block_mask(mask_mod, B, None, L, L, device=device, BLOCK_SIZE=32)

qb, kb, vb = (t.to(torch.bfloat16) for t in (q, k, v))
out = flex_attention(qb, kb, vb, score_mod=score_mod, block_mask=block_mask, enable_gqa=True)
reference = flex_attention_reference(qb, kb, vb, score_mod=score_mod, mask_mod=mask_mod,
                                     enable_gqa=True)
torch.testing.assert_close(out.double(), reference, atol=2e-2, rtol=2e-2)
print(*header(score_mod, block_mask), sep="\\n")
print(f"{block_mask.sparsity():.1f}% of the scores skipped; max |difference| from the reference",
      f"{(out.double() - reference).abs().max().item():.1e} (bf16)")
block_mask.plot()
"""),
    md("""
## Writing a combinator by hand

A combinator is nothing special: any function that calls mods and combines
their results with `&`, `|` or `~` is a mod. Here "outside the window but
inside the document" (the positions the windowed model loses), written
directly.
"""),
    code("""
window = M.sliding_window(48)

def lost_to_the_window(b, h, q_idx, kv_idx):
    return packed_causal(b, h, q_idx, kv_idx) & ~window(b, h, q_idx, kv_idx)

block_mask = run_and_check(mask_mod=lost_to_the_window, mask_batch=B)
block_mask.plot()
"""),
]

WITHOUT_SOFTMAX = [
    md("""
# 05 · Attention without softmax

Softmax is one choice of how a query spreads its weight over the keys. The same
generator builds two others, from the same kind of small traced functions:

1. **sigmoid attention**, `flexgen.sigmoid_attention`: every weight is
   `sigmoid(score + bias)` on its own, with no normalization over the row. Every
   `score_mod` and block mask of `flex_attention` works unchanged; the kernel is
   the softmax kernel without its running max, row sum and rescaling.
2. **decayed linear attention**, `flexgen.linear_attention`: no score matrix at
   all, but a `[Dk, Dv]` state per head carried along the sequence,
   `S_t = exp(g_t) S_{t-1} + φ(k_t)ᵀ v_t` and `o_t = scale · φ(q_t) S_t`. The
   log-decay `g` is a **decay_mod** `(b, h, t) -> float` (a constant per head:
   lightning attention / retention; a captured per-token tensor: gated linear
   attention) and `φ` a **feature_map** `x -> float`. It runs in chunks (work
   linear in the length), and a few tokens at a time from a cache of states.

Each result is checked against `flexgen.reference`, which computes the
definitions in float64 (the linear one step by step). On a CPU the kernels run
under the Triton interpreter, so the sizes are small.
"""),
    code("""
import torch
import torch.nn.functional as F

import flexgen
from flexgen import create_block_mask, linear_attention, sigmoid_attention
from flexgen import mods as M
from flexgen.reference import linear_attention_reference, sigmoid_attention_reference

device = "cuda" if torch.cuda.is_available() else "cpu"
torch.manual_seed(0)
B, H, L, D = 1, 2, 64, 32
q, k, v = (torch.randn(B, H, L, D, device=device) for _ in range(3))

def check(got, want, tol=1e-4):
    torch.testing.assert_close(got.double(), want.double(), atol=tol, rtol=tol)
    return "matches the float64 reference"
"""),
    md("""
## Sigmoid attention: the softmax call with another activation

`bias` defaults to `-log(L)`, which keeps the weights of a row summing to about
one at initialization. A causal mask and a soft-capping `score_mod` are the very
same objects `flex_attention` takes.
"""),
    code("""
causal = create_block_mask(M.causal_mask, None, None, L, L, device=device, BLOCK_SIZE=32)
softcap = M.tanh_softcap(20.0)
out = sigmoid_attention(q, k, v, score_mod=softcap, block_mask=causal)
print(check(out, sigmoid_attention_reference(q, k, v, softcap, causal)))

# Nothing normalizes a row: a row whose keys are all masked out is exactly zero.
late = create_block_mask(M.causal(-8), None, None, L, L, device=device, BLOCK_SIZE=32)
out = sigmoid_attention(q, k, v, block_mask=late)
print("rows 0-7:", out[0, 0, :8].abs().max().item(), "| row 8:", out[0, 0, 8].abs().max().item())
"""),
    md("""
The generated kernel keeps the block-sparse loop and the mod code; where softmax
keeps a running maximum and rescales its accumulator, the sigmoid kernel adds
each weight in directly. The lines that compute the weights, side by side:
"""),
    code("""
def weight_lines(source, start, stop):
    lines = source.split("\\n")
    first = next(i for i, line in enumerate(lines) if start in line)
    last = next(i for i in range(first, len(lines)) if stop in lines[i])
    return "\\n".join(lines[first:last + 1])

softmax_src = flexgen.kernel_source(q, k, v, score_mod=softcap, block_mask=causal)
sigmoid_src = flexgen.sigmoid_kernel_source(q, k, v, score_mod=softcap, block_mask=causal)
print("softmax:\\n" + weight_lines(softmax_src, "score = qk * SM_SCALE", "m_i = m_new"))
print("\\nsigmoid:\\n" + weight_lines(sigmoid_src, "score = qk * SM_SCALE", "acc = _dot"))
"""),
    md("""
## Decayed linear attention: a decay_mod and a feature_map

A decay_mod returns the log-decay `g <= 0` of query head `h` at position `t`.
Three of them, and the classic `elu(x) + 1` feature map:
"""),
    code("""
slopes = torch.tensor([0.5, 0.05], device=device)

def lightning(b, h, t):                 # a constant per head: lightning attention, retention
    return -slopes[h]

gates = F.logsigmoid(torch.randn(B, H, L, device=device) + 2.0)

def gated(b, h, t):                     # one gate per token: gated linear attention
    return gates[b, h, t]

def elu1(x):                            # the feature map, on every entry of q and k
    return F.elu(x) + 1

for name, decay in (("no decay", None), ("lightning", lightning), ("gated", gated)):
    out = linear_attention(q, k, v, decay_mod=decay, feature_map=elu1)
    want = linear_attention_reference(q, k, v, decay_mod=decay, feature_map=elu1)
    print(f"{name:10s}", check(out, want, tol=1e-3 * want.abs().max().item()))
"""),
    md("""
The mods become a few lines of the generated kernels, like a score_mod does. A
decay_mod that reads `t` runs once, in a small prefix kernel that writes its
running sums `G` within each chunk; the chunked forward's output kernel reads them
and folds the decay in (every exponent is a difference `G_i - G_j <= 0`), with the
feature map on the query tile. (A decay_mod that does not read `t`, like
`lightning`, needs no prefix kernel: its sums are `(i + 1) g`.)
"""),
    code("""
prefix = flexgen.linear_kernel_source(q, k, v, decay_mod=gated, feature_map=elu1, part="prefix")
print(weight_lines(prefix, "d_0 = tl.load", "tl.store(GCUM"))
source = flexgen.linear_kernel_source(q, k, v, decay_mod=gated, feature_map=elu1, part="output")
print(weight_lines(source, "# G and g_chunk", "g_chunk = "))
print(weight_lines(source, "x = q.to(tl.float32)", "qf = tl.where"))
print(weight_lines(source, "o = o * tl.exp(G)", "a = tl.where"))
"""),
    md("""
## Prefill in chunks, then decode from a cache of states

A serving loop keeps one state per sequence slot. `linear_attention` with
`output_final_state=True` returns the state after a prompt;
`linear_attention_decode` advances the states of the batch's slots in place, a
token at a time. Together they give what one long call gives. (Positions `t`
count from the start of each call, so the gates are sliced to match.)
"""),
    code("""
prompt = 48
first, state = linear_attention(q[:, :, :prompt], k[:, :, :prompt], v[:, :, :prompt],
                                decay_mod=lambda b, h, t: gates[b, h, t], feature_map=elu1,
                                output_final_state=True)
cache = torch.zeros(4, H, D, D, device=device)     # 4 slots; this sequence lives in slot 2
cache[2] = state[0]
outs = [first]
for t in range(prompt, L):
    step_gates = gates[:, :, t:t + 1]
    outs.append(flexgen.linear_attention_decode(
        q[:, :, t:t + 1], k[:, :, t:t + 1], v[:, :, t:t + 1], cache, [2],
        decay_mod=lambda b, h, t: step_gates[b, h, t], feature_map=elu1))
whole = linear_attention_reference(q, k, v, decay_mod=gated, feature_map=elu1)
print(check(torch.cat(outs, 2), whole, tol=1e-3 * whole.abs().max().item()))
"""),
    md("""
## Gradients, the gates' included

The backward runs in chunks too. Captured tensors of the decay_mod that require
grad (learned gates, learned slopes) get their gradients, and the feature map's
derivative comes from sympy, as a score_mod's does.
"""),
    code("""
learned = gates.clone().requires_grad_()
qg, kg, vg = (t.clone().requires_grad_() for t in (q, k, v))
def learned_gates(b, h, t):
    return learned[b, h, t]

out = linear_attention(qg, kg, vg, decay_mod=learned_gates, feature_map=elu1)
grads = torch.autograd.grad(out.sum(), [qg, kg, vg, learned])
want = torch.autograd.grad(
    linear_attention_reference(qg, kg, vg, learned_gates, elu1).sum(), [qg, kg, vg, learned])
for name, a, b in zip(["q", "k", "v", "gates"], grads, want):
    print(f"d{name:6s}", check(a, b, tol=1e-3 * b.abs().max().item()))
"""),
]

NOTEBOOKS = {
    "01_quickstart": QUICKSTART,
    "02_write_your_own_mod": OWN_MOD,
    "03_mask_gallery": _gallery_cells(),
    "04_composing_variants": COMPOSING,
    "05_attention_without_softmax": WITHOUT_SOFTMAX,
}


def build(name: str, cells: list) -> nbformat.NotebookNode:
    """The notebook ``name`` with outputs cleared and deterministic cell ids."""
    nb = new_notebook(cells=cells, metadata={
        "kernelspec": {"display_name": "Python 3 (ipykernel)", "language": "python",
                       "name": "python3"},
        "language_info": {"name": "python"},
    })
    for i, cell in enumerate(nb.cells):
        cell.id = f"{name[:2]}-{i:02d}"
        if cell.cell_type == "code":
            cell.outputs, cell.execution_count = [], None
    nbformat.validate(nb)
    return nb


def text(nb: nbformat.NotebookNode) -> str:
    return nbformat.writes(nb) + "\n"


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--check", action="store_true",
                        help="do not write; exit 1 if a notebook differs from its cells here")
    args = parser.parse_args(argv)
    stale = []
    for name, cells in NOTEBOOKS.items():
        path = HERE / f"{name}.ipynb"
        want = text(build(name, cells))
        have = path.read_text(encoding="utf-8") if path.exists() else None
        if have == want:
            continue
        if args.check:
            stale.append(path.name)
        else:
            path.write_text(want, encoding="utf-8")
            print("wrote", path.relative_to(HERE.parent))
    if stale:
        print("out of date (run python examples/make_notebooks.py):", ", ".join(stale))
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
