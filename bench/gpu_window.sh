#!/usr/bin/env bash
# One lent GPU window (issue 51), in under 9 minutes: benchmarks first, then as many rows of the
# paper table as the time left allows. Run from the repository root on the device machine:
#
#     bash bench/gpu_window.sh                  # writes $OUT/gpu-window.jsonl and $OUT/gpu-window.log
#     GPU_WINDOW_BUDGET_S=300 bash bench/gpu_window.sh      # a shorter window
#     GPU_WINDOW_DRY=1 OUT=/tmp/w bash bench/gpu_window.sh  # print the steps, run nothing
#
# For a CPU smoke test of the steps and the packing (tests/test_bench_recipe_speed.py):
# GPU_WINDOW_DEVICE=cpu, SPEED_EXTRA (arguments added to every bench/recipe_speed.py call) and
# GPU_WINDOW_STEPS (the names of the steps to run; default all).
#
# Every step is one command under `timeout`, given at most what is left of the budget (default
# 510 s, so that packing ends inside 9 minutes). A step that finishes writes its records to
# .device/gpu-window/STEP.jsonl (git-ignored; a warm machine keeps it between calls, and a later
# session can carry it back): a second call skips the steps already done and re-packs their
# records, so an interrupted window resumes. Every record, done now or before, is packed into ONE
# file, $OUT/gpu-window.jsonl (one JSON object a line: {"step", "status", "record"}), beside the log.
#
# Needs python3 with torch there. fedmeta runs from this checkout's source roots; a missing
# dependency is installed from the wheels in $WHEELS (default .device/wheels, carried with the
# tree) into /tmp/site. bench/paper_table.py (the table's command) is called only through its
# command line, with --side-by-side 3 (three runs of a row at once, issue 51), on the Omniglot npz
# in $OMNIGLOT_DIR or .device/omniglot (carried); PAPER_TABLE_ARGS replaces its rows
# (default: --ways 5 20 --rows a b c) and may add arguments (a later --side-by-side wins).
# After it, bench/sample_table.py (issue 53's sample-level rows, SAMPLE_TABLE_ARGS) with what is
# left, on the same npz.
set -u
: "${OUT:?OUT must name the folder whose files come back}"
cd "$(dirname "$0")/.." || exit 2
START=$(date +%s)
BUDGET=${GPU_WINDOW_BUDGET_S:-510}
STATE=${GPU_WINDOW_STATE:-.device/gpu-window}
PY=${PYTHON:-python3}
mkdir -p "$OUT" "$STATE"
LOG="$OUT/gpu-window.log"
PACK="$OUT/gpu-window.jsonl"

left() { echo $((BUDGET - ($(date +%s) - START))); }
say() { echo "[gpu-window +$(($(date +%s) - START))s] $*" | tee -a "$LOG"; }

# fedmeta from the checkout; missing dependencies from carried wheels.
roots=$(for d in */fedmeta; do dirname "$d"; done | paste -sd:)
export PYTHONPATH="$roots${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1 FLWR_TELEMETRY_ENABLED=0
need="import torch, numpy, flwr, pydantic, prometheus_client, dp_accounting, randomgen, scipy, cryptography"
if [ -z "${GPU_WINDOW_DRY:-}" ] && ! $PY -c "$need" 2>/dev/null; then
    wheels=${WHEELS:-.device/wheels}
    say "installing carried wheels from $wheels"
    $PY -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
        --target /tmp/site "$wheels"/*.whl >>"$LOG" 2>&1
    export PYTHONPATH="$PYTHONPATH:/tmp/site"
    $PY -c "$need" 2>>"$LOG" || { say "missing Python packages (see the log); stopping"; exit 2; }
fi

# step NAME MAX_SECONDS COMMAND...: run once (skipped when done before), its records kept.
step() {
    local name=$1 max=$2; shift 2
    local file="$STATE/$name.jsonl" budget
    if [ -n "${GPU_WINDOW_STEPS:-}" ] && [[ " $GPU_WINDOW_STEPS " != *" $name "* ]]; then return 0; fi
    if [ -s "$file" ]; then say "$name: done before, kept"; return 0; fi
    budget=$(left)
    [ "$budget" -gt "$max" ] && budget=$max
    if [ "$budget" -lt 20 ]; then say "$name: skipped, $budget s left"; return 0; fi
    if [ "$1" = speed ]; then  # bench/recipe_speed.py on the device, 3 timed calls and rounds
        # shellcheck disable=SC2086  # SPEED_EXTRA is a list of words
        set -- "$PY" bench/recipe_speed.py --device "${GPU_WINDOW_DEVICE:-cuda}" --repeat 3 \
            "${@:2}" ${SPEED_EXTRA:-}
    fi
    say "$name: up to ${budget}s: $*"
    [ -n "${GPU_WINDOW_DRY:-}" ] && return 0
    timeout -s INT -k 15 "$budget" "$@" --out "$file.part" >>"$LOG" 2>&1
    local rc=$?
    if [ $rc -eq 0 ] && [ -s "$file.part" ]; then mv "$file.part" "$file"; say "$name: ok"
    else say "$name: failed or cut off (exit $rc)"; fi
}


{ nvidia-smi --query-gpu=name,driver_version,memory.used,memory.total,clocks.sm --format=csv
  $PY -c "import torch; print('torch', torch.__version__, torch.cuda.get_device_name())"; } \
    >>"$LOG" 2>&1
# The reduced-precision path on the GPU first: float32 rows, the clip, the query pass's direction.
say "precision tests (pytest -m gpu)"
[ -z "${GPU_WINDOW_DRY:-}${GPU_WINDOW_STEPS:-}" ] && timeout 90 $PY -m pytest -q -p no:cacheprovider -m gpu \
    tests/metalearning/test_precision.py >>"$LOG" 2>&1
# 5-way, second order, 5 steps at 0.1, one query per class; 1,600 tasks a round (20 x 80).
# 192 tasks a call: about 28 GiB in float32 on an H100 (docs/benchmarks.md), inside 40 GiB.
step 5way-fp32     75 speed --way 5  --tasks-per-call 192 --precision fp32
step 5way-bf16     75 speed --way 5  --tasks-per-call 192 --precision bf16
step 20way-fp32    90 speed --way 20 --tasks-per-call 48  --precision fp32
# One process alone, then three side by side (about 3 x 28 GiB of the 139).
step 5way-3seeds  150 speed --way 5  --tasks-per-call 192 --precision fp32 --seeds 3
step 20way-bf16    90 speed --way 20 --tasks-per-call 48  --precision bf16
step 5way-tf32     60 speed --way 5  --tasks-per-call 192 --precision tf32
step 5way-bf16-384 60 speed --way 5  --tasks-per-call 384 --precision bf16

# The table's rows with what is left, three runs of a row side by side on the GPU (issue 51): each
# its own process, ledger, sampling and noise. Records go to $STATE/paper-table (a warm machine
# keeps it; seeded with the committed ones, so rows that have their runs are skipped) and each into
# $OUT/paper-table-records.jsonl as it ends (`python bench/paper_table.py --unpack` files them).
# The Omniglot npz: $OMNIGLOT_DIR, else .device/omniglot (carried with the tree, like the wheels).
TABLE_DATA=${OMNIGLOT_DIR:-.device/omniglot}
TABLE_ARGS="--run --scale gpu --side-by-side 3 --records $STATE/paper-table --pack $OUT"
if [ -n "${GPU_WINDOW_STEPS:-}" ]; then
    say "paper table: not asked for (GPU_WINDOW_STEPS)"
elif ! $PY bench/paper_table.py --help 2>/dev/null | grep -q -- --side-by-side; then
    say "paper table: bench/paper_table.py with --side-by-side is not in this checkout; skipped"
elif [ ! -f "$TABLE_DATA/images_background.npz" ]; then
    say "paper table: no Omniglot npz in $TABLE_DATA (set OMNIGLOT_DIR or carry .device/omniglot); skipped"
else
    budget=$(($(left) - 30))
    # shellcheck disable=SC2086  # TABLE_ARGS and PAPER_TABLE_ARGS are lists of words
    set -- $PY bench/paper_table.py $TABLE_ARGS ${PAPER_TABLE_ARGS:---ways 5 20 --rows a b c}
    if [ -n "${GPU_WINDOW_DRY:-}" ]; then
        say "paper table: up to ${budget}s: OMNIGLOT_DIR=$TABLE_DATA $*"
    elif [ "$budget" -ge 60 ]; then
        mkdir -p "$STATE/paper-table"
        cp -n results/paper-table/*.json "$STATE/paper-table/" 2>/dev/null
        say "paper table: up to ${budget}s: $*"
        # SIGINT: every run in progress stops and is recorded as interrupted (never counted);
        # 30 s later a kill (the runs die with the command).
        OMNIGLOT_DIR=$(cd "$TABLE_DATA" && pwd) timeout -s INT -k 30 "$budget" "$@" >>"$LOG" 2>&1
        say "paper table: exit $?"
    else
        say "paper table: ${budget}s left, not started"
    fi
fi

# Issue 53's sample-level rows (bench/sample_table.py: Omniglot 5-way K-shot at a valid example-level
# (1.18, 1e-5)) with what the paper table left, one run at a time, each an experiment with its own
# ledger. Records go to $STATE/sample-table (seeded with the committed ones, so rows that have
# their runs are skipped) and each into $OUT/sample-table-records.jsonl as it ends (`python
# bench/sample_table.py --unpack` files them). SAMPLE_TABLE_ARGS replaces its rows (default
# --shots 8 1 5: K = 8 first, the row DP-MAML's text gives a number for).
SAMPLE_ARGS="--run --scale gpu --records $STATE/sample-table --pack $OUT"
if [ -n "${GPU_WINDOW_STEPS:-}" ]; then
    say "sample table: not asked for (GPU_WINDOW_STEPS)"
elif [ ! -f bench/sample_table.py ]; then
    say "sample table: bench/sample_table.py is not in this checkout; skipped"
elif [ ! -f "$TABLE_DATA/images_background.npz" ]; then
    say "sample table: no Omniglot npz in $TABLE_DATA (set OMNIGLOT_DIR or carry .device/omniglot); skipped"
else
    budget=$(($(left) - 30))
    # shellcheck disable=SC2086  # SAMPLE_ARGS and SAMPLE_TABLE_ARGS are lists of words
    set -- $PY bench/sample_table.py $SAMPLE_ARGS ${SAMPLE_TABLE_ARGS:---shots 8 1 5}
    if [ -n "${GPU_WINDOW_DRY:-}" ]; then
        say "sample table: up to ${budget}s: OMNIGLOT_DIR=$TABLE_DATA $*"
    elif [ "$budget" -ge 60 ]; then
        mkdir -p "$STATE/sample-table"
        cp -n results/sample-table/*.json "$STATE/sample-table/" 2>/dev/null
        say "sample table: up to ${budget}s: $*"
        OMNIGLOT_DIR=$(cd "$TABLE_DATA" && pwd) timeout -s INT -k 30 "$budget" "$@" >>"$LOG" 2>&1
        say "sample table: exit $?"
    else
        say "sample table: ${budget}s left, not started"
    fi
fi

# Pack every record (done now or before) into one file.
: >"$PACK"
for f in "$STATE"/*.jsonl; do
    [ -e "$f" ] || continue
    name=$(basename "$f" .jsonl)
    while IFS= read -r line; do
        printf '{"step": "%s", "status": "done", "record": %s}\n' "$name" "$line" >>"$PACK"
    done <"$f"
done
say "packed $(wc -l <"$PACK") records into $PACK"
