#!/usr/bin/env bash
# The one command for a GPU machine: install flexgen, check it, time it.
#
#   bash benchmarks/run_all.sh            # results and logs in $OUT (default benchmarks/results)
#   SMOKE=1 bash benchmarks/run_all.sh    # the same steps on CPU at tiny sizes (tests the scripts)
#
# Steps, each bounded in time, each run even when an earlier one failed:
#   0. report the machine and the Python packages flexgen needs (no internet there: nothing is fetched)
#   1. pip install --no-deps --no-build-isolation --no-index -e .   (falls back to a copied tree on PYTHONPATH)
#   2. benchmarks/gpu_check.py      correctness at B=2 H=8 L=2048 D=128 against the float32 reference
#   3. benchmarks/bench_forward.py  forward speed vs torch.compile(flex_attention) and SDPA
#   4. benchmarks/bench_decode.py   if it exists
# Then the summaries again, last, so they end up in the tail of the output.
#
# Environment (seconds unless said):
#   TOTAL_BUDGET_S=440       the whole script, install included (keep under the 8-minute hard limit)
#   GPU_CHECK_BUDGET_S=100   gpu_check stops starting cases after this (0 skips the step)
#   DECODE_BUDGET_S=70       bench_decode's share (reserved out of the forward benchmark's time)
#   BENCH_FORWARD_ARGS=""    extra arguments, e.g. "--variants full,causal --lengths 1k,2k,4k,8k,16k --dims 64,128"
#   BENCH_DECODE_ARGS=""     extra arguments for bench_decode.py
#   PYTHON=python3  SMOKE=0
set -u -o pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
ROOT=$PWD
PY=${PYTHON:-python3}
SMOKE=${SMOKE:-0}
TOTAL=${TOTAL_BUDGET_S:-440}
CHECK_BUDGET=${GPU_CHECK_BUDGET_S:-100}
DECODE_BUDGET=${DECODE_BUDGET_S:-70}
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

    if [ "$CHECK_BUDGET" -gt 0 ]; then
        echo "== 2. gpu_check, budget ${CHECK_BUDGET}s ($(elapsed)s)"
        GPU_CHECK_SUMMARY=$SUMMARY_DIR/1_gpu_check.txt \
            timeout -k 10 $((CHECK_BUDGET + 40)) "$PY" benchmarks/gpu_check.py $SMOKE_ARG --budget "$CHECK_BUDGET"
        echo "  gpu_check exit $?"
    fi

    decode_reserve=0
    [ -f benchmarks/bench_decode.py ] && decode_reserve=$DECODE_BUDGET
    fwd=$(( $(left) - decode_reserve - 15 ))
    [ "$fwd" -lt 60 ] && fwd=$(( $(left) - 15 ))     # short of time: bench_decode gives its share up
    [ "$fwd" -lt 30 ] && fwd=30
    echo "== 3. bench_forward, budget ${fwd}s ($(elapsed)s)"
    # shellcheck disable=SC2086
    BENCH_FORWARD_SUMMARY=$SUMMARY_DIR/2_bench_forward.txt \
        timeout -k 10 $((fwd + 20)) "$PY" benchmarks/bench_forward.py $SMOKE_ARG --budget "$fwd" ${BENCH_FORWARD_ARGS:-}
    echo "  bench_forward exit $?"

    if [ -f benchmarks/bench_decode.py ]; then
        dec=$(( $(left) - 5 ))
        [ "$dec" -gt "$DECODE_BUDGET" ] && dec=$DECODE_BUDGET
    fi
    if [ -f benchmarks/bench_decode.py ] && [ "$dec" -lt 25 ]; then
        echo "== 4. bench_decode: only ${dec}s left, skipped"
    elif [ -f benchmarks/bench_decode.py ]; then
        echo "== 4. bench_decode, budget ${dec}s ($(elapsed)s)"
        extra=""
        grep -q -- "--budget" benchmarks/bench_decode.py && extra="--budget $((dec - 10))"
        [ "$SMOKE" = 1 ] && { grep -q -- "--smoke" benchmarks/bench_decode.py && extra="$extra --smoke"; }
        # shellcheck disable=SC2086
        BENCH_DECODE_BUDGET_S=$((dec - 10)) timeout -k 5 "$dec" "$PY" benchmarks/bench_decode.py $extra ${BENCH_DECODE_ARGS:-} \
            2>&1 | tee "$SUMMARY_DIR/decode.log"
        echo "  bench_decode exit ${PIPESTATUS[0]}"
        # its table is the end of its output
        tail -n 24 "$SUMMARY_DIR/decode.log" > "$SUMMARY_DIR/3_bench_decode.txt"
    else
        echo "== 4. bench_decode: benchmarks/bench_decode.py not there, skipped"
    fi

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
