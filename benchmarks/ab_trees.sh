#!/usr/bin/env bash
# A/B on one GPU machine: the working tree against another copy of flexgen, in one run.
#
#   git archive REV | tar -x -C .ab/base            # here: the baseline (an ignored folder, carried)
#   bash benchmarks/ab_trees.sh 'CMD' ['CMD' ...]   # there: each CMD under the baseline, then the tree
#
# Both trees are installed (not editable) into folders of their own, /tmp/ab-base and /tmp/ab-new,
# each command runs once per tree with that folder first on PYTHONPATH, its own kernel cache
# (FLEXGEN_CACHE_DIR) and AB_SIDE=base or new in its environment (to name its output files).
# The commands are the working tree's (a benchmark script new in the tree runs against the
# baseline's package too). PYTHONSAFEPATH keeps the current folder (this tree) off sys.path, so
# `python -c` and `python -m` import the installed package of their side; the benchmarks put
# their own folder on sys.path themselves. AB_BASE names the baseline folder (default .ab/base).
set -u -o pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
BASE=${AB_BASE:-.ab/base}
PY=${PYTHON:-python3}
export PYTHONUNBUFFERED=1
for side in base new; do
    src=$([ "$side" = base ] && echo "$BASE" || echo .)
    rm -rf "/tmp/ab-$side"
    "$PY" -m pip install -q --no-deps --no-build-isolation --no-index --target "/tmp/ab-$side" "$src" \
        || { echo "ab_trees: installing $src failed" >&2; exit 2; }
done
status=0
for cmd in "$@"; do
    for side in base new; do
        echo "== ab_trees [$side] $cmd"
        AB_SIDE=$side PYTHONSAFEPATH=1 PYTHONPATH="/tmp/ab-$side${PYTHONPATH:+:$PYTHONPATH}" \
            FLEXGEN_CACHE_DIR="/tmp/ab-cache-$side" bash -c "$cmd" || status=$?
    done
done
exit $status
