"""Tile configuration: the table lookup, the autotuner's search, its disk store and its guards.

The search itself needs a GPU to time; here ``do_bench`` is replaced by a
fake clock that makes one known configuration fastest, so the choice, the
stored winner and its reuse by a fresh process are checked on CPU. The GPU
test at the end tunes a real kernel and checks its output.
"""
import dataclasses
import json

import pytest
import torch

import flexgen
from flexgen.runtime import tuning
from flexgen.runtime.checks import DTYPES
from flexgen.codegen.spec import KernelSpec

from conftest import make_qkv, run_and_check

CUDA = torch.device("cuda")
FAST = dict(BLOCK_M=64, BLOCK_N=32, num_warps=4, num_stages=3)


@pytest.fixture
def fresh_store(monkeypatch, tmp_path):
    """An empty autotune store in a private cache dir, as a new process would see it."""
    monkeypatch.setenv("FLEXGEN_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(tuning, "_STORED", None)
    monkeypatch.setattr(tuning, "_CHOSEN", {})
    monkeypatch.setattr(tuning, "gpu_name", lambda device: "H100")
    return tmp_path


def _new_process(monkeypatch):
    monkeypatch.setattr(tuning, "_STORED", None)
    monkeypatch.setattr(tuning, "_CHOSEN", {})


def _spec(**fields):
    base = dict(qk_head=64, v_head=64, dtype="bfloat16", block_m=128, block_n=64, num_warps=4,
                num_stages=3)
    return KernelSpec("forward", **{**base, **fields})


def _inputs(q_len=1000, kv_len=1000, B=2, H=4):
    return dict(q=torch.empty(B, H, q_len, 64), k=torch.empty(B, H, kv_len, 64))


@pytest.fixture
def fake_clock(monkeypatch):
    """do_bench that runs the launch once and says FAST takes 1 ms, everything else 2+ ms."""
    import triton.testing
    timed = []

    def do_bench(fn, warmup=None, rep=None):
        fn()
        config = timed[-1]
        return 1.0 if config == FAST else 2.0 + config["BLOCK_M"] / 1000

    monkeypatch.setattr(triton.testing, "do_bench", do_bench)

    def launch_fn(spec):
        config = {k: getattr(spec, f) for k, f in tuning.FIELDS.items()}
        if config["BLOCK_N"] == 128 and config["num_stages"] == 4:
            raise RuntimeError("out of resource: shared memory")   # as Triton says for a too-big tile
        timed.append(config)

    return launch_fn, timed


def test_cpu_uses_the_interpreter_row():
    assert tuning.options("forward", 128, "bfloat16", torch.device("cpu"), 128, 128) == tuning.DEFAULTS["forward"]["cpu"]


def test_table_lookup_order(monkeypatch):
    monkeypatch.setattr(tuning, "gpu_name", lambda device: "H100")
    row = dict(BLOCK_M=128, BLOCK_N=128, num_warps=8, num_stages=2)
    monkeypatch.setattr(tuning, "TUNED", {("forward", "H100", "bfloat16", 128): row})
    assert tuning.table_row("forward", 128, "bfloat16", CUDA) == row
    assert tuning.table_row("forward", 80, "bfloat16", CUDA) == row, "80 pads to the 128 row"
    assert tuning.table_row("forward", 128, "float16", CUDA) == row, "fp16 falls back to bf16's row"
    # fp32 without a row of its own: its smaller default (shared memory), not bf16's row
    assert tuning.table_row("forward", 128, "float32", CUDA) == tuning.FLOAT32[("forward", 128)]
    assert tuning.table_row("forward", 256, "float32", CUDA) == tuning.DEFAULTS["forward"][256]
    assert tuning.table_row("forward", 64, "bfloat16", CUDA) == tuning.DEFAULTS["forward"][64]
    monkeypatch.setattr(tuning, "gpu_name", lambda device: "A100")
    assert tuning.table_row("forward", 128, "bfloat16", CUDA) == tuning.DEFAULTS["forward"][128]
    # clamped to the sparse blocks, and the table itself is not modified
    assert tuning.options("forward", 128, "bfloat16", CUDA, 64, 32)["BLOCK_N"] == 32
    monkeypatch.setattr(tuning, "gpu_name", lambda device: "H100")
    assert tuning.table_row("forward", 128, "bfloat16", CUDA)["BLOCK_N"] == 128


def test_a_gpu_on_another_s_die_takes_its_rows(monkeypatch):
    """An H200 (the H100's die) takes the H100's rows where it has none of its own, and its
    own row first where it has one; a GPU of another die keeps the defaults."""
    h100 = dict(BLOCK_M=128, BLOCK_N=128, num_warps=8, num_stages=2)
    h200 = dict(BLOCK_M=64, BLOCK_N=64, num_warps=4, num_stages=3)
    monkeypatch.setattr(tuning, "TUNED", {("forward", "H100", "bfloat16", 128): h100,
                                          ("forward:dense", "H200", "bfloat16", 128): h200})
    monkeypatch.setattr(tuning, "gpu_name", lambda device: "H200")
    assert tuning.table_row("forward", 128, "bfloat16", CUDA) == h100
    assert tuning.table_row("forward:dense", 128, "bfloat16", CUDA) == h200
    assert tuning.table_row("forward:transcendental", 128, "float16", CUDA) == h100
    monkeypatch.setattr(tuning, "gpu_name", lambda device: "A100")
    assert tuning.table_row("forward", 128, "bfloat16", CUDA) == tuning.DEFAULTS["forward"][128]


def test_checked_in_table_is_well_formed():
    for (kernel, gpu, dtype, head), config in tuning.TUNED.items():
        assert kernel in tuning.KERNELS and dtype in DTYPES.values() and head in (64, 128, 256)
        assert tuning._valid(config, (128, 128)), (kernel, gpu, dtype, head, config)


def test_candidates_divide_the_sparse_blocks():
    for sparse in ((128, 128), (64, 32), (32, 128)):
        found = tuning.candidates(_spec(), sparse)
        assert found and all(sparse[0] % c["BLOCK_M"] == 0 and sparse[1] % c["BLOCK_N"] == 0 for c in found)
        assert all(tuning._valid(c, sparse) for c in found)
    big = tuning.candidates(_spec(qk_head=256, v_head=256), (128, 128))
    assert max(c["BLOCK_M"] * c["BLOCK_N"] for c in big) <= 64 * 64


def test_outside_autotune_mode_nothing_changes(fresh_store, fake_clock):
    launch_fn, timed = fake_clock
    spec = _spec()
    assert not tuning.needs_lookup()
    assert tuning.choose(spec, CUDA, _inputs(), (128, 128), launch_fn) is spec
    assert timed == [] and not (fresh_store / tuning.STORE_NAME).exists()


def test_search_stores_the_winner_and_a_new_process_reuses_it(fresh_store, fake_clock, monkeypatch):
    launch_fn, timed = fake_clock
    spec = _spec()
    with flexgen.autotune():
        chosen = tuning.choose(spec, CUDA, _inputs(), (128, 128), launch_fn)
    assert {k: getattr(chosen, f) for k, f in tuning.FIELDS.items()} == FAST
    assert chosen.score == spec.score and chosen.qk_head == spec.qk_head
    searched = len(timed)
    assert searched >= len(tuning.candidates(spec, (128, 128))) - 6   # minus the ones that "failed"
    stored = json.loads((fresh_store / tuning.STORE_NAME).read_text())
    (entry,) = stored["entries"].values()
    assert entry["config"] == FAST and entry["ms"] == 1.0 and entry["gpu"] == "H100"

    # Same process, same bucket: no search. A longer sequence is another bucket.
    assert tuning.choose(spec, CUDA, _inputs(), (128, 128), launch_fn) is chosen
    assert len(timed) == searched

    _new_process(monkeypatch)
    assert tuning.needs_lookup(), "winners on disk are used without autotune mode"
    again = tuning.choose(spec, CUDA, _inputs(q_len=900, kv_len=1020), (128, 128), launch_fn)
    assert again == chosen and len(timed) == searched
    assert tuning.choose(spec, CUDA, _inputs(kv_len=5000), (128, 128), launch_fn) is spec


def test_winner_must_divide_the_calls_sparse_blocks(fresh_store, fake_clock, monkeypatch):
    launch_fn, _ = fake_clock
    spec = _spec(block_m=64, block_n=64)
    with flexgen.autotune():
        tuning.choose(spec, CUDA, _inputs(), (128, 128), launch_fn)
    _new_process(monkeypatch)
    # A stored BLOCK_N=32 winner is fine for 64-wide sparse blocks; 48-wide ones can't use it.
    assert tuning.choose(spec, CUDA, _inputs(), (64, 64), launch_fn).block_n == 32
    _new_process(monkeypatch)
    assert tuning.choose(spec, CUDA, _inputs(), (16, 16), launch_fn) is spec


@pytest.mark.parametrize("text", [
    "not json at all {",
    json.dumps([1, 2, 3]),
    json.dumps({"version": 99, "entries": {}}),
    json.dumps({"version": 1, "entries": []}),
])
def test_a_corrupt_store_is_ignored_and_rewritten(fresh_store, fake_clock, text):
    launch_fn, _ = fake_clock
    (fresh_store / tuning.STORE_NAME).write_text(text)
    spec = _spec()
    assert tuning.choose(spec, CUDA, _inputs(), (128, 128), launch_fn) is spec
    with flexgen.autotune():
        chosen = tuning.choose(spec, CUDA, _inputs(), (128, 128), launch_fn)
    assert chosen.block_m == FAST["BLOCK_M"]
    assert json.loads((fresh_store / tuning.STORE_NAME).read_text())["version"] == tuning.STORE_VERSION


@pytest.mark.parametrize("config", [
    dict(BLOCK_M=48, BLOCK_N=64, num_warps=4, num_stages=3),         # not a power of two
    dict(BLOCK_M=1024, BLOCK_N=64, num_warps=4, num_stages=3),       # bigger than any tile
    dict(BLOCK_M="64", BLOCK_N=64, num_warps=4, num_stages=3),       # a string
    dict(BLOCK_M=64, BLOCK_N=64, num_warps=3, num_stages=3),         # odd warps
    dict(BLOCK_M=64, BLOCK_N=64, num_warps=4),                       # a missing field
    dict(BLOCK_M=64, BLOCK_N=64, num_warps=4, num_stages=3, grid="evil()"),   # an extra one
    "BLOCK_M=64",
])
def test_a_tampered_winner_is_never_launched(fresh_store, fake_clock, config):
    launch_fn, _ = fake_clock
    spec = _spec()
    key = tuning._store_key(spec, CUDA, tuning._bucket(_inputs()))
    (fresh_store / tuning.STORE_NAME).write_text(json.dumps(
        {"version": 1, "entries": {key: {"config": config}}}))
    assert tuning.choose(spec, CUDA, _inputs(), (128, 128), launch_fn) is spec


def test_kernels_that_accumulate_are_not_tuned(fresh_store, fake_clock):
    from flexgen.kernels.backward import BackwardSpec
    launch_fn, timed = fake_clock
    accumulating = BackwardSpec("backward", part="dq", scatters=("grad",), qk_head=64, v_head=64,
                                dtype="bfloat16", block_m=64, block_n=64)
    with flexgen.autotune():
        assert tuning.choose(accumulating, CUDA, _inputs(), (128, 128), launch_fn) is accumulating
    assert timed == []


def test_cpu_launches_never_consult_the_tuner(monkeypatch):
    def boom(*args):
        raise AssertionError("tuning consulted for a CPU launch")
    monkeypatch.setattr(tuning, "choose", boom)
    q, k, v = make_qkv(1, 1, 70, 16)
    with flexgen.autotune():
        run_and_check(q, k, v)


def test_autotune_switch_is_restored():
    before = tuning._ACTIVE[0]
    with flexgen.autotune():
        assert tuning._ACTIVE[0]
        with flexgen.autotune(False):
            assert not tuning._ACTIVE[0]
        assert tuning._ACTIVE[0]
    assert tuning._ACTIVE[0] == before


def test_progress_bar_without_tqdm(capsys):
    bar = tuning._Bar(4, "tune")
    with bar:
        for _ in range(4):
            bar.set_postfix_str("best 1.0 ms")
            bar.update(1)
    err = capsys.readouterr().err
    assert "4/4" in err and "best 1.0 ms" in err


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device to time configurations")
def test_autotune_on_the_gpu(fresh_store, monkeypatch):
    """A real search: every candidate compiles or is skipped, the winner's output is right."""
    monkeypatch.setattr(tuning, "gpu_name", lambda device: "test-gpu")
    # A few candidates (compiling all of them takes minutes), one with 128 x 128 tiles at
    # 4 stages that may not fit in shared memory: it must be skipped, not fatal.
    monkeypatch.setattr(tuning, "candidates", lambda spec, sparse: [
        dict(BLOCK_M=64, BLOCK_N=64, num_warps=4, num_stages=2),
        dict(BLOCK_M=128, BLOCK_N=32, num_warps=8, num_stages=3),
        dict(BLOCK_M=128, BLOCK_N=128, num_warps=8, num_stages=4)])
    q, k, v = make_qkv(2, 4, 1000, 64, device="cuda", dtype=torch.bfloat16)
    block_mask = flexgen.create_block_mask(lambda b, h, q_idx, kv_idx: q_idx >= kv_idx, None, None,
                                           1000, 1000, device="cuda")
    with flexgen.autotune():
        run_and_check(q, k, v, block_mask=block_mask)
    (entry,) = json.loads((fresh_store / tuning.STORE_NAME).read_text())["entries"].values()
    assert entry["ms"] > 0 and tuning._valid(entry["config"], (128, 128))


def test_flex_attention_reads_the_table_with_its_own_dtype_names(monkeypatch):
    """The planning code and the table must agree on the key (a dtype spelled differently never matches)."""
    from flexgen.runtime.options import parse_options
    from flexgen.runtime.plan import tiles
    monkeypatch.setattr(tuning, "gpu_name", lambda device: "H100")
    for dtype in (torch.bfloat16, torch.float16):
        opts = tiles("forward", parse_options(None), "", 128, DTYPES[dtype], CUDA, 128, 128)
        assert opts == tuning.TUNED[("forward", "H100", "bfloat16", 128)]


def test_tiles_that_do_not_fit_step_down(monkeypatch):
    """OutOfResources on a GPU launch retries smaller tiles, and remembers what fit."""
    from triton.runtime.errors import OutOfResources

    from flexgen.runtime import launch
    tried = []

    def launch_once(spec, device, inputs):
        tried.append((spec.block_m, spec.block_n, spec.num_stages))
        if spec.block_n * spec.num_stages > 128:
            raise OutOfResources(360448, 232448, "shared memory")

    monkeypatch.setattr(launch, "_launch_once", launch_once)
    monkeypatch.setattr(launch, "_FITS", {})
    spec = _spec(block_m=128, block_n=128, num_stages=3)
    launch._launch(spec, CUDA, {})
    assert tried == [(128, 128, 3), (128, 128, 2), (128, 64, 2)]
    tried.clear()
    launch._launch(spec, CUDA, {})
    assert tried == [(128, 64, 2)], "the second call goes straight to the tiles that fit"

    # The autotuner's launches do not step down: a candidate that does not fit must fail.
    def choose(spec, device, inputs, sparse, launch_fn):
        with pytest.raises(OutOfResources):
            launch_fn(spec)
        return dataclasses.replace(spec, block_n=32)
    monkeypatch.setattr(tuning, "choose", choose)
    tried.clear()
    with flexgen.autotune():
        launch.run(spec, CUDA, {}, tune_blocks=(128, 128))
    assert tried == [(128, 128, 3), (128, 32, 3)]


def test_smaller_tiles_keep_dividing_the_sparse_blocks():
    spec = _spec(block_m=128, block_n=128, num_stages=4, num_warps=8)
    seen = []
    while spec is not None:
        seen.append((spec.block_m, spec.block_n, spec.num_stages))
        assert 128 % spec.block_m == 0 and 128 % spec.block_n == 0 and spec.block_n >= 32
        spec = tuning.smaller(spec)
    assert seen[-1] == (32, 32, 1)
    assert tuning.smaller(KernelSpec("decode", block_m=16, block_n=64, num_stages=3)) is None


def test_smaller_linear_keeps_the_chunk():
    """Linear attention's kernels step down stages, then the key slice, then the value slice."""
    from flexgen.kernels.linear import linear_spec
    spec = linear_spec("linear", part="output", block_m=128, block_n=32, block_k=0, qk_head=64, v_head=32,
                       num_stages=3)
    steps = []
    while spec is not None:
        steps.append((spec.block_m, spec.block_k, spec.block_n, spec.num_stages))
        spec = tuning.smaller(spec)
    assert steps == [(128, 0, 32, 3), (128, 0, 32, 2), (128, 32, 32, 2), (128, 16, 32, 2), (128, 16, 16, 2),
                     (128, 16, 16, 1)]
    assert tuning.smaller(linear_spec("linear", part="grad", block_m=64, block_n=64, num_stages=1)).block_n == 32
    assert tuning.smaller(linear_spec("linear", part="gates", block_m=64, num_stages=3)) is None


def test_a_forward_takes_the_row_of_its_most_specific_name(monkeypatch):
    """A forward kernel's table names run most specific first (``forward_kernel``), each falling
    back to the next where the table has no row: soft-caps (tanh) and plain rows without a block
    mask have rows of their own at head dim 128; at 64 a mask reading captured tensors and a
    score_mod taken as terms (ALiBi) keep 64-key tiles, which the 64 x 128 row would slow."""
    from flexgen.frontend.lowering import lower
    from flexgen.frontend.trace import trace_cached
    monkeypatch.setattr(tuning, "gpu_name", lambda device: "H200")

    def softcap(score, b, h, q_idx, kv_idx):
        return 20.0 * torch.tanh(score / 20.0)

    def alibi(score, b, h, q_idx, kv_idx):
        return score + (kv_idx - q_idx) * 0.25

    def lowered(mod, kind):
        return lower(trace_cached(mod, kind))

    softcap, alibi = lowered(softcap, "score_mod"), lowered(alibi, "score_mod")
    causal = lowered(flexgen.mods.causal_mask, "mask_mod")
    document = lowered(flexgen.mods.document_mask(torch.zeros(1, 64, dtype=torch.int32)), "mask_mod")
    names = tuning.forward_kernel
    assert names(softcap, causal) == ("forward:transcendental", "forward")
    assert names(alibi, None) == ("forward:terms", "forward")
    assert names(None, causal) == ("forward",)
    assert names(None, None, has_block_mask=False) == ("forward:dense", "forward")
    assert names(alibi, None, has_block_mask=False) == ("forward:terms", "forward:dense", "forward")
    assert names(softcap, None, has_block_mask=False) == ("forward:transcendental", "forward:dense", "forward")
    assert names(alibi, document) == ("forward:mask_loads", "forward:terms", "forward")

    def row(names, head, dtype="bfloat16"):
        return tuning.table_row(names, head, dtype, CUDA)

    dense = tuning.TUNED[("forward:dense", "H100", "bfloat16", 128)]
    assert row(("forward:dense", "forward"), 128) == dense != row("forward", 128)
    assert row(("forward:terms", "forward:dense", "forward"), 128) == dense
    heavy = tuning.TUNED[("forward:transcendental", "H100", "bfloat16", 128)]
    assert row(("forward:transcendental", "forward"), 128) == heavy != row("forward", 128)
    # at head dim 64: no rows for soft-caps or dense calls (the forward row: 64 x 128), but
    # for captured mask tensors and terms (64 x 64), in fp16 as in bf16
    assert row(("forward:transcendental", "forward:dense", "forward"), 64) == row("forward", 64)
    assert row("forward", 64)["BLOCK_N"] == 128
    assert row(("forward:mask_loads", "forward"), 64, "float16")["BLOCK_N"] == 64
    assert row(("forward:terms", "forward:dense", "forward"), 64)["BLOCK_N"] == 64
    assert tuning.table_row(("forward:transcendental", "forward"), 64, "bfloat16", torch.device("cpu")) == \
        tuning.DEFAULTS["forward"]["cpu"]


def test_kernels_without_a_winner_are_looked_up_once(fresh_store, fake_clock, monkeypatch):
    """Winners on disk for one kernel must not make every other kernel's call hash its spec again."""
    launch_fn, _ = fake_clock
    with flexgen.autotune():
        tuning.choose(_spec(), CUDA, _inputs(), (128, 128), launch_fn)
    _new_process(monkeypatch)
    lookups = []
    store_key = tuning._store_key
    monkeypatch.setattr(tuning, "_store_key", lambda *a: lookups.append(a) or store_key(*a))
    other = _spec(qk_head=128, v_head=128)
    assert tuning.needs_lookup()
    for _ in range(3):
        assert tuning.choose(other, CUDA, _inputs(), (128, 128), launch_fn) is other
    assert len(lookups) == 1


def test_fp32_dots_keep_float32_accuracy_on_the_gpu():
    """fp32 on CUDA: tf32 where torch allows it, else FP32_DOT (tf32x3: tensor cores at float32's
    accuracy, not the unrolled FMA loops of "ieee" that took 24.6 s to compile); the interpreter
    and half precision stay "ieee"."""
    from types import SimpleNamespace

    from flexgen.codegen import spec
    cuda_query = SimpleNamespace(dtype=torch.float32, device=CUDA)     # what dot_precision reads
    matmul = torch.backends.cuda.matmul        # (its flags are properties: set and put back by hand)
    before = matmul.allow_tf32
    try:
        matmul.allow_tf32 = False
        assert spec.dot_precision(cuda_query) == spec.FP32_DOT == "tf32x3"
        matmul.allow_tf32 = True
        assert spec.dot_precision(cuda_query) == "tf32"
    finally:
        matmul.allow_tf32 = before
    assert spec.dot_precision(SimpleNamespace(dtype=torch.bfloat16, device=CUDA)) == "ieee"
    assert spec.dot_precision(torch.empty(1, 1, 1, 16)) == "ieee"
