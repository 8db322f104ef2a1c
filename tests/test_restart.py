"""Fast restarts: a second process that finds a known mod's kernels in the disk cache (and its
lowered facts and module sources in the restart index, flexgen.codegen.index) runs the
serving path's first calls without importing sympy or jinja2, and gets the same results."""
from __future__ import annotations

import json
import os
import subprocess
import sys

SCRIPT = r"""
import json, sys, torch
import flexgen
imported_at_start = [m for m in ("sympy", "jinja2") if m in sys.modules]

def causal(b, h, q_idx, kv_idx):
    return q_idx >= kv_idx

def softcap(score, b, h, q_idx, kv_idx):
    return 20.0 * torch.tanh(score / 20.0)

torch.manual_seed(0)
x = torch.randn(40, 2, 16)
cu = torch.tensor([0, 9, 9, 40], dtype=torch.int32)
packed = flexgen.varlen_attention(x, x, x, cu, cu, 31, 31, score_mod=softcap, mask_mod=causal)
q = torch.randn(1, 2, 40, 16)
dense = flexgen.flex_attention(q, q, q, score_mod=softcap)
cache = flexgen.PagedKVCache(num_pages=4, page_size=16, num_kv_heads=2, head_dim=16, max_batch=1,
                             max_pages_per_seq=4, dtype=torch.float32, device="cpu")
slot = cache.add_sequence()
k = torch.randn(1, 2, 5, 16)
q_rot = cache.append([slot], k, k, rope=flexgen.RoPE(), query=torch.randn(1, 2, 5, 16))
paged = cache.attention(q_rot, [slot], mask_mod=causal)
print(json.dumps({"start": imported_at_start,
                  "after": [m for m in ("sympy", "jinja2") if m in sys.modules],
                  "sums": [float(t.double().sum()) for t in (packed, dense, paged)]}))
"""


def _run(cache_dir, script=SCRIPT) -> dict:
    env = dict(os.environ, FLEXGEN_CACHE_DIR=str(cache_dir))
    env.pop("FLEXGEN_RESTART_INDEX", None)
    done = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True,
                          timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


# Mods of forms flexgen does not ship (flexgen.frontend.seeds): the first process lowers them.
UNSHIPPED = (SCRIPT.replace("return q_idx >= kv_idx", "return q_idx + 2 > kv_idx")
             .replace("20.0 * torch.tanh(score / 20.0)", "20.0 * torch.tanh(score / 20.0) + 0.5 * torch.sin(score)"))


def test_warm_restart_needs_neither_sympy_nor_jinja(tmp_path):
    cold = _run(tmp_path, UNSHIPPED)
    assert cold["start"] == [] and "sympy" in cold["after"]      # the first process lowers
    warm = _run(tmp_path, UNSHIPPED)
    assert warm["start"] == [] and warm["after"] == [], warm
    assert warm["sums"] == cold["sums"]


def test_cold_start_of_everyday_mods_needs_no_sympy(tmp_path):
    # A causal mask and a soft-cap (of any cap: 17.3 is a parameter of its form) have forms
    # flexgen ships: an empty cache directory renders and runs them without importing sympy.
    cold = _run(tmp_path, SCRIPT.replace("20.0", "17.3"))
    assert cold["start"] == [] and cold["after"] == ["jinja2"], cold
    assert "sympy" in _run(tmp_path / "other", UNSHIPPED)["after"]


# What a serving or training loop calls around a block mask: the mask itself, the forward
# with it, decode steps against a cache with it, and a backward. flexgen's own modules that
# need sympy (the tracer's expressions, the printer, the index checks) must stay unloaded.
MASK_SCRIPT = r"""
import json, sys, torch
import flexgen

def causal(b, h, q_idx, kv_idx):
    return q_idx >= kv_idx

def window(b, h, q_idx, kv_idx):
    return (q_idx >= kv_idx) & (q_idx - kv_idx < 40)

def softcap(score, b, h, q_idx, kv_idx):
    return 20.0 * torch.tanh(score / 20.0)

torch.manual_seed(0)
q = torch.randn(1, 2, 96, 16)
mask = flexgen.create_block_mask(causal, 1, 1, 96, 96, device="cpu", BLOCK_SIZE=32)
wmask = flexgen.create_block_mask(window, None, None, 96, 96, device="cpu", BLOCK_SIZE=32)
dense = flexgen.flex_attention(q, q, q, block_mask=mask, score_mod=softcap)
windowed = flexgen.flex_attention(q, q, q, block_mask=wmask)
step = flexgen.decode_attention(q[:, :, -1:], q, q, block_mask=mask)
serving = [m for m in ("sympy", "jinja2") if m in sys.modules]
x = q.clone().requires_grad_()
flexgen.flex_attention(x, x, x, block_mask=mask).sum().backward()
own = ("flexgen.frontend.expr", "flexgen.codegen.printer", "flexgen.frontend.bounds_check", "jinja2")
print(json.dumps({"serving": serving, "after_backward": [m for m in own if m in sys.modules],
                  "sums": [float(t.double().sum()) for t in (dense, windowed, step, x.grad)],
                  "blocks": [int(m.kv_num_blocks.sum() + m.full_kv_num_blocks.sum())
                             for m in (mask, wmask)]}))
"""


def test_warm_block_mask_needs_neither_sympy_nor_jinja(tmp_path):
    """create_block_mask reads the mask's recorded block-bounds program, and the backward the
    recorded derivatives: a warm process builds masks and runs forward, decode and backward
    without flexgen importing sympy or jinja2. (A backward goes through torch's custom-op
    autograd, which imports torch._dynamo and with it sympy: torch's cost, not flexgen's, so
    the backward is checked on flexgen's own modules.)"""
    cold = _run(tmp_path, MASK_SCRIPT)
    assert "sympy" in cold["serving"]                     # the first process lowers
    warm = _run(tmp_path, MASK_SCRIPT)
    assert warm["serving"] == [] and warm["after_backward"] == [], warm
    assert warm["sums"] == cold["sums"] and warm["blocks"] == cold["blocks"]


WARMUP_MODULE = r"""
import torch
import flexgen

def causal(b, h, q_idx, kv_idx):
    return q_idx >= kv_idx

def calls():
    x = torch.randn(24, 2, 16)
    cu = torch.tensor([0, 7, 24], dtype=torch.int32)
    return [lambda: flexgen.varlen_attention(x, x, x, cu, cu, 17, 17, mask_mod=causal),
            lambda: flexgen.flex_attention(x.transpose(0, 1)[None], x.transpose(0, 1)[None],
                                           x.transpose(0, 1)[None])]
"""

AFTER_WARMUP = r"""
import sys, torch, flexgen
sys.path.insert(0, "")
from serving_mods import causal
x = torch.randn(40, 2, 16)
cu = torch.tensor([0, 30, 40], dtype=torch.int32)
flexgen.varlen_attention(x, x, x, cu, cu, 30, 30, mask_mod=causal)
print([m for m in ("sympy", "jinja2") if m in sys.modules])
"""


def test_warmup_cli_fills_the_caches(tmp_path):
    (tmp_path / "serving_mods.py").write_text(WARMUP_MODULE)
    env = dict(os.environ, FLEXGEN_CACHE_DIR=str(tmp_path / "cache"), PYTHONPATH=str(tmp_path))
    done = subprocess.run([sys.executable, "-m", "flexgen", "warmup", "serving_mods:calls", "--no-progress"],
                          env=env, cwd=tmp_path, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "2 calls, 2 kernels" in done.stdout, done.stdout
    # Other lengths, the same mods: a new process needs neither sympy nor jinja2.
    after = subprocess.run([sys.executable, "-c", AFTER_WARMUP], env=env, cwd=tmp_path, capture_output=True,
                           text=True, timeout=300)
    assert after.returncode == 0, after.stderr[-3000:]
    assert after.stdout.strip().splitlines()[-1] == "[]"
    bad = subprocess.run([sys.executable, "-m", "flexgen", "warmup", "serving_mods"], env=env, cwd=tmp_path,
                         capture_output=True, text=True, timeout=300)
    assert bad.returncode == 2 and "module:function" in bad.stderr


KEY_SCRIPT = r"""
import json, sys
import triton.runtime.cache as triton_cache
from flexgen.runtime import compiler_key
original = triton_cache.triton_key
if len(sys.argv) > 1:                      # as if a Triton file had changed since the record
    compiler_key._stamp = lambda *a: "another stamp"
compiler_key.install()
print(json.dumps({"computed": triton_cache.triton_key is original and original.cache_info().currsize == 1,
                  "key": triton_cache.triton_key()}))
"""


def test_triton_key_comes_from_a_stamp_of_its_files(tmp_path):
    """Triton's compiler key (a hash of its files, ~0.4 s a process) is never computed: two
    processes install the same key from a stamp of those files (paths, sizes, mtimes), and
    a change in them gives another key."""
    def run(*argv):
        env = dict(os.environ, FLEXGEN_CACHE_DIR=str(tmp_path))
        env.pop("FLEXGEN_RESTART_INDEX", None)
        done = subprocess.run([sys.executable, "-c", KEY_SCRIPT, *argv], env=env,
                              capture_output=True, text=True, timeout=120)
        assert done.returncode == 0, done.stderr[-3000:]
        return json.loads(done.stdout.strip().splitlines()[-1])

    first, second, changed = run(), run(), run("changed")
    assert not first["computed"] and not second["computed"] and not changed["computed"]
    assert first["key"] == second["key"] != changed["key"]
    import triton
    assert first["key"].startswith(triton.__version__)

def test_a_flex_attention_call_registers_only_its_ops():
    """Defining a custom op costs ~4 ms (~10 ms on a slow host): a process that only calls
    flex_attention registers the attention and block-mask ops, not the other families."""
    script = r"""
import sys, torch, flexgen
q = torch.randn(1, 1, 16, 16)
bm = flexgen.create_block_mask(lambda b, h, q_idx, kv_idx: q_idx >= kv_idx, None, None, 16, 16, device="cpu")
flexgen.flex_attention(q, q, q, block_mask=bm)
# (ops.define: the helper every family defines its ops with)
print(sorted(m for m in sys.modules if m.startswith("flexgen.runtime.ops") and m != "flexgen.runtime.ops.define"))
"""
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.strip().splitlines()[-1] == "['flexgen.runtime.ops']"


def test_a_first_call_runs_its_cold_steps_with_the_collector_paused(tmp_path):
    """A cold first call's lowering, rendering, module load and kernel-module imports allocate
    hundreds of thousands of long-lived objects; they run with Python's cyclic collector paused
    (full collections cost 0.2 s each on the H100's host), which is on again afterwards, and a
    collector the application turned off stays off."""
    script = r"""
import gc, json, sys, torch
import flexgen
from flexgen.codegen import cache
from flexgen.frontend import lowering
seen = {}
def spy(name, fn):
    def wrapped(*args, **kwargs):
        seen[name] = gc.isenabled()
        return fn(*args, **kwargs)
    return wrapped
lowering._lower = spy("lower", lowering._lower)
cache.source = spy("render", cache.source)
cache._execute = spy("execute", cache._execute)
q = torch.randn(1, 1, 16, 16)
bm = flexgen.create_block_mask(lambda b, h, q_idx, kv_idx: q_idx >= kv_idx, None, None, 16, 16, device="cpu")
flexgen.flex_attention(q, q, q, score_mod=lambda s, b, h, i, j: s * 0.5, block_mask=bm)
after = gc.isenabled()
gc.disable()
flexgen.flex_attention(q, q, q, score_mod=lambda s, b, h, i, j: s * 0.25)
print(json.dumps({"seen": seen, "after": after, "kept_off": not gc.isenabled()}))
"""
    out = _run(tmp_path, script)
    assert out["seen"] == {"lower": False, "render": False, "execute": False}, out
    assert out["after"] and out["kept_off"]


def test_a_mask_build_asks_for_a_recorded_kernel_without_rendering_it(tmp_path):
    """Whether a first mask build may launch its kernel (``launch.ready``) starts with
    ``cache.loaded_or_recorded``: False for a kernel neither loaded nor in the restart index,
    found without rendering its module (Jinja's import and the template's compile, ~0.2 s of
    a cold mask step on the H100's host); True in a later process once one rendered it."""
    script = r"""
import json, sys, torch
from flexgen.codegen import cache
from flexgen.frontend.lowering import lower
from flexgen.frontend.trace import trace_cached
from flexgen.masks import builder
spec = builder.block_mask_spec(lower(trace_cached(lambda b, h, q_idx, kv_idx: q_idx >= kv_idx - 3,
                                                  "mask_mod")), dense=True)
before, jinja = cache.loaded_or_recorded(spec), "jinja2" in sys.modules
if sys.argv[1] == "render":
    cache.module_text(spec)
print(json.dumps({"before": before, "jinja": jinja}))
"""
    first = _run(tmp_path, script.replace("sys.argv[1]", "'render'"))
    second = _run(tmp_path, script.replace("sys.argv[1]", "'no'"))
    assert first == {"before": False, "jinja": False}
    assert second == {"before": True, "jinja": False}


DOCUMENT_SCRIPT = r"""
import json, sys, torch
import flexgen
from flexgen.mods import alibi, and_masks, causal_mask, document_mask, doc_ids_from_lengths

torch.manual_seed(0)
L, H = 200, 4
doc = doc_ids_from_lengths([70, 30, 100])
step = -7.1234 / H        # a hand-written ALiBi of some max bias
def hand_alibi(score, b, h, q_idx, kv_idx):
    return score + torch.exp2(step * (h + 1)) * (kv_idx - q_idx)

q = torch.randn(1, H, L, 16)
mask = flexgen.create_block_mask(and_masks(causal_mask, document_mask(doc)), None, None, L, L,
                                 device="cpu")
out = flexgen.flex_attention(q, q, q, score_mod=hand_alibi, block_mask=mask)
slopes = flexgen.flex_attention(q, q, q, score_mod=alibi(slopes=torch.rand(H)), block_mask=mask)
print(json.dumps({"start": [], "after": [m for m in ("sympy", "jinja2") if m in sys.modules],
                  "sums": [float(out.double().sum()), float(slopes.double().sum())]}))
"""


def test_cold_start_of_a_document_mask_needs_no_sympy(tmp_path):
    # Captured tensors read at affine positions are checked and proven from plain data, and
    # the document form, its proven snippet and ALiBi's form with any max bias are shipped.
    assert _run(tmp_path, DOCUMENT_SCRIPT)["after"] == ["jinja2"]
