#!/usr/bin/env bash
# The one command for a GPU machine: install flexgen, check it, time it.
#
#   bash benchmarks/run_all.sh            # results and logs in $OUT (default benchmarks/results)
#   SMOKE=1 bash benchmarks/run_all.sh    # the same steps on CPU at tiny sizes (tests the scripts)
#   STEPS=tune,backward bash benchmarks/run_all.sh
#
# Steps (STEPS, comma-separated, in this order; default check,forward,backward,decode), each
# bounded in time, each run even when an earlier one failed:
#   0. report the machine and the Python packages flexgen needs (no internet there: nothing is fetched)
#   1. pip install --no-deps --no-build-isolation --no-index -e .   (falls back to a copied tree on PYTHONPATH)
#   check     benchmarks/gpu_check.py       correctness at B=2 H=8 L=2048 D=128 against the float32 reference
#   tune      benchmarks/tune.py            measures rows of flexgen.runtime.tuning.TUNED (prints them)
#   gputests  pytest on the GPU: tests/test_tuning.py, tests/test_backward.py, tests/test_compile.py,
#             the Gluon kernels' tests/test_forward_gluon.py and tests/test_backward_gluon.py, and the
#             Gluon varlen forward of tests/test_varlen.py (-k GPUTESTS_K="gpu or tuning or gluon");
#             on a fresh H200 (cold kernel caches) all of them take ~20 min: raise GPUTESTS_BUDGET_S
#             and TOTAL_BUDGET_S for a full pass, or narrow GPUTESTS_K
#   sanitize  benchmarks/sanitize.py under compute-sanitizer: memcheck over every kernel family,
#             racecheck on one forward and one backward kernel, then tests/test_fuzz.py on the GPU
#             under memcheck (its stored examples, then SANITIZE_FUZZ_EXAMPLES=6 seeded ones per test)
#   gluonfuzz tests/test_fuzz.py on the GPU through the Gluon kernels (FLEXGEN_FUZZ_BACKEND=gluon):
#             GLUON_FUZZ_EXAMPLES=30 per test from seed GLUON_FUZZ_SEED=0 (each a few Gluon compiles)
#   forward   benchmarks/bench_forward.py   forward speed vs torch.compile(flex_attention) and SDPA
#   backward  benchmarks/bench_backward.py  backward and forward+backward speed vs the same peers
#   decode    benchmarks/bench_decode.py    decode (q_len=1), contiguous and paged, vs copy bandwidth
#   cold      benchmarks/bench_cold_start.py  a never-seen mod in a fresh process, vs torch.compile
#   host      benchmarks/profile_host.py    where a warm call's host time goes
#   models    benchmarks/bench_models.py    HF Llama / Gemma 2, a compiled training step, a compiled decode loop
#   nosoftmax benchmarks/bench_nosoftmax.py sigmoid and linear attention vs softmax and flash-linear-attention
#   gluon     benchmarks/bench_gluon.py     the Hopper Gluon forward vs the tl kernel and peers
#   serving   benchmarks/bench_serving.py   varlen, the fused RoPE append, mixed steps, restarts
# Then the summaries again, last, so they end up in the tail of the output.
#
# Environment (seconds): TOTAL_BUDGET_S=560 for the whole script; each step's budget is
# <STEP>_BUDGET_S (defaults: CHECK 100, TUNE 240, GPUTESTS 300, FORWARD 240, BACKWARD 150, DECODE 70,
# COLD 90, HOST 30, SANITIZE 300, MODELS 420, NOSOFTMAX 240, GLUON 300, SERVING 240, GLUONFUZZ 400), cut to what is left. Extra arguments: BENCH_FORWARD_ARGS, BENCH_BACKWARD_ARGS,
# BENCH_DECODE_ARGS, TUNE_ARGS, COLD_ARGS.  PYTHON=python3  SMOKE=0
set -u -o pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
ROOT=$PWD
PY=${PYTHON:-python3}
SMOKE=${SMOKE:-0}
TOTAL=${TOTAL_BUDGET_S:-560}
STEPS=${STEPS:-check,forward,backward,decode}
if [ -z "${OUT:-}" ]; then
    if [ "$SMOKE" = 1 ]; then OUT=/tmp/flexgen-run-all-smoke; else OUT=$ROOT/benchmarks/results; fi
fi
export OUT
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
export FLEXGEN_CACHE_DIR=${FLEXGEN_CACHE_DIR:-/tmp/flexgen-cache}   # shared by the steps: compile once
SUMMARY_DIR=$(mktemp -d)
START=$SECONDS
SMOKE_ARG=""
[ "$SMOKE" = 1 ] && SMOKE_ARG="--smoke"

elapsed() { echo $((SECONDS - START)); }
left() { echo $((TOTAL - (SECONDS - START))); }

budget_of() {     # the step's budget, cut to the time left
    local want
    case $1 in
        check) want=${CHECK_BUDGET_S:-100} ;;  tune) want=${TUNE_BUDGET_S:-240} ;;
        gputests) want=${GPUTESTS_BUDGET_S:-300} ;;  forward) want=${FORWARD_BUDGET_S:-240} ;;
        backward) want=${BACKWARD_BUDGET_S:-150} ;;  decode) want=${DECODE_BUDGET_S:-70} ;;
        cold) want=${COLD_BUDGET_S:-150} ;;  host) want=${HOST_BUDGET_S:-30} ;;
        sanitize) want=${SANITIZE_BUDGET_S:-300} ;;  models) want=${MODELS_BUDGET_S:-420} ;;
        nosoftmax) want=${NOSOFTMAX_BUDGET_S:-240} ;;  gluon) want=${GLUON_BUDGET_S:-300} ;;
        serving) want=${SERVING_BUDGET_S:-240} ;;  gluonfuzz) want=${GLUONFUZZ_BUDGET_S:-400} ;;
        *) want=0 ;;
    esac
    local rest=$(( $(left) - 10 ))
    [ "$want" -gt "$rest" ] && want=$rest
    echo "$want"
}

run_step() {
    local step=$1 budget log summary
    budget=$(budget_of "$step")
    if [ "$budget" -lt 20 ]; then
        echo "== $step: only ${budget}s left (or unknown step), skipped"
        return
    fi
    echo "== $step, budget ${budget}s ($(elapsed)s)"
    log=$SUMMARY_DIR/$step.log
    summary=$SUMMARY_DIR/$(printf '%02d' "$(ls "$SUMMARY_DIR" | wc -l)")_$step.txt
    local -a cmd
    case $step in
        check)    cmd=("$PY" benchmarks/gpu_check.py $SMOKE_ARG --budget "$budget") ;;
        tune)     cmd=("$PY" benchmarks/tune.py $SMOKE_ARG --budget "$budget" ${TUNE_ARGS:-}) ;;
        # From /tmp: `python -m` puts the cwd first on sys.path, and the repository's
        # flexgen/ there lacks the mods/templates mapping of the installed package.
        gputests) cmd=(bash -c "cd /tmp && FLEXGEN_TEST_AOT=0 '$PY' -m pytest -q -p no:cacheprovider \
                       '$ROOT/tests/test_tuning.py' '$ROOT/tests/test_backward.py' '$ROOT/tests/test_compile.py' \
                       '$ROOT/tests/test_forward_gluon.py' '$ROOT/tests/test_backward_gluon.py' \
                       '$ROOT/tests/test_varlen.py' \
                       -k '${GPUTESTS_K:-gpu or tuning or gluon}' --tb=short") ;;
        # The fuzzer's examples (tests/fuzz_db first) on the GPU under memcheck too, from /tmp
        # as gputests; SANITIZE_FUZZ_EXAMPLES per test.
        sanitize) cmd=(bash -c "compute-sanitizer --tool memcheck --error-exitcode 9 '$PY' benchmarks/sanitize.py; \
                       echo memcheck exit \$?; compute-sanitizer --tool racecheck --error-exitcode 9 \
                       '$PY' benchmarks/sanitize.py --only race; echo racecheck exit \$?; \
                       cd /tmp && FLEXGEN_FUZZ_DEVICE=cuda FLEXGEN_TEST_AOT=0 \
                       FLEXGEN_FUZZ_EXAMPLES=${SANITIZE_FUZZ_EXAMPLES:-6} compute-sanitizer --tool memcheck \
                       --error-exitcode 9 '$PY' -m pytest -q -p no:cacheprovider '$ROOT/tests/test_fuzz.py'; \
                       echo fuzz memcheck exit \$?") ;;
        # The fuzzer's mods through the Gluon kernels (from /tmp as gputests), the statistics
        # saying which kernels the examples reached.
        gluonfuzz) cmd=(bash -c "cd /tmp && FLEXGEN_FUZZ_DEVICE=cuda FLEXGEN_FUZZ_BACKEND=gluon FLEXGEN_TEST_AOT=0 \
                       FLEXGEN_FUZZ_EXAMPLES=${GLUON_FUZZ_EXAMPLES:-30} FLEXGEN_FUZZ_SEED=${GLUON_FUZZ_SEED:-0} \
                       '$PY' -m pytest -q -p no:cacheprovider '$ROOT/tests/test_fuzz.py' --hypothesis-show-statistics") ;;
        models)   cmd=("$PY" benchmarks/bench_models.py $SMOKE_ARG --budget "$budget" ${BENCH_MODELS_ARGS:-}) ;;
        nosoftmax) cmd=("$PY" benchmarks/bench_nosoftmax.py $SMOKE_ARG ${BENCH_NOSOFTMAX_ARGS:-}) ;;
        gluon)    cmd=("$PY" benchmarks/bench_gluon.py $SMOKE_ARG --budget "$((budget - 60))" \
                       --json "$OUT/bench_gluon.json" ${BENCH_GLUON_ARGS:-}) ;;
        serving)  cmd=("$PY" benchmarks/bench_serving.py $SMOKE_ARG ${BENCH_SERVING_ARGS:-}) ;;
        forward)  cmd=("$PY" benchmarks/bench_forward.py $SMOKE_ARG --budget "$budget" ${BENCH_FORWARD_ARGS:-}) ;;
        backward) cmd=("$PY" benchmarks/bench_backward.py $SMOKE_ARG --budget "$budget" ${BENCH_BACKWARD_ARGS:-}) ;;
        decode)   cmd=("$PY" benchmarks/bench_decode.py $SMOKE_ARG --budget "$((budget - 10))" ${BENCH_DECODE_ARGS:-}) ;;
        # Both dtypes of the issue's restart targets, one cold start each, then the warm restart.
        cold)     cmd=("$PY" benchmarks/bench_cold_start.py $SMOKE_ARG --budget "$budget" \
                       ${COLD_ARGS:---mods causal_softcap --repeats 1 --dtypes bfloat16,float32}) ;;
        host)     cmd=("$PY" benchmarks/profile_host.py $SMOKE_ARG) ;;
    esac
    GPU_CHECK_SUMMARY=$summary BENCH_FORWARD_SUMMARY=$summary BENCH_BACKWARD_SUMMARY=$summary \
    BENCH_COLD_START_SUMMARY=$summary \
        timeout -k 10 $((budget + 20)) "${cmd[@]}" 2>&1 | tee "$log"
    echo "  $step exit ${PIPESTATUS[0]}"
    # Scripts without a summary file of their own: their table is the end of their output.
    [ -s "$summary" ] || tail -n 30 "$log" > "$summary"
}

main() {
    echo "== run_all: $(date -u +%FT%TZ), budget ${TOTAL}s, OUT=$OUT, smoke=$SMOKE"
    echo "== 0. machine and packages"
    if command -v nvidia-smi >/dev/null 2>&1; then
        # Read-only queries: the card's settings are left as found.
        nvidia-smi --query-gpu=name,driver_version,memory.total,memory.used,clocks.sm,clocks.max.sm,power.draw,power.limit,temperature.gpu,utilization.gpu --format=csv || true
    fi
    "$PY" - <<'EOF'
import importlib, sys
print(f"  python {sys.version.split()[0]} at {sys.executable}")
for name in ("torch", "triton", "jinja2", "sympy", "numpy", "matplotlib", "setuptools", "pip"):
    try:
        module = importlib.import_module(name)
        print(f"  {name:<11} {getattr(module, '__version__', '?')}")
    except Exception as e:
        print(f"  {name:<11} MISSING ({type(e).__name__}: {e})")
try:
    import torch
    ok = torch.cuda.is_available()
    print(f"  cuda {torch.version.cuda}, available {ok}, devices {torch.cuda.device_count()}"
          + (f", {torch.cuda.get_device_name(0)}" if ok else ""))
except Exception as e:
    print(f"  torch.cuda: {e}")
EOF

    echo "== 1. install flexgen ($(elapsed)s)"
    here=$("$PY" -c "import flexgen, os; print(os.path.dirname(os.path.dirname(os.path.abspath(flexgen.__file__))))" 2>/dev/null || true)
    if [ "$here" = "$ROOT" ] && "$PY" -c "import flexgen.mods, flexgen.templates" 2>/dev/null; then
        echo "  flexgen already importable from $ROOT: no install"
    elif "$PY" -m pip install -q --no-deps --no-build-isolation --no-index -e . 2>&1 | tail -5; \
         "$PY" -c "import flexgen, flexgen.mods, flexgen.templates" 2>/dev/null; then
        echo "  pip install -e . done"
    else
        # Offline and without a recent setuptools an editable install can fail: lay the
        # package out as the wheel would (flexgen/, flexgen/mods, flexgen/templates).
        echo "  pip install -e . failed; using a copied tree on PYTHONPATH"
        site=/tmp/flexgen-site
        rm -rf "$site" && mkdir -p "$site"
        cp -r flexgen "$site/flexgen" && cp -r mods "$site/flexgen/mods" && cp -r templates "$site/flexgen/templates"
        export PYTHONPATH="$site${PYTHONPATH:+:$PYTHONPATH}"
    fi
    "$PY" -c "import flexgen, flexgen.mods, flexgen.templates; print('  flexgen', flexgen.__version__, 'from', flexgen.__file__)" \
        || echo "  flexgen NOT importable: the steps below will fail"

    for step in ${STEPS//,/ }; do
        run_step "$step"
    done

    if command -v nvidia-smi >/dev/null 2>&1; then
        nvidia-smi --query-gpu=clocks.sm,clocks.max.sm,power.draw,temperature.gpu,clocks_throttle_reasons.active --format=csv,noheader || true
    fi
    echo
    echo "================ summaries ================"
    for f in "$SUMMARY_DIR"/*.txt; do
        [ -f "$f" ] && { cat "$f"; echo; }
    done
    echo "files in $OUT: $(ls "$OUT" | tr '\n' ' ')"
    echo "== run_all done in $(elapsed)s"
}

main 2>&1 | tee "$OUT/run_all.log"
