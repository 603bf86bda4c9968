#!/usr/bin/env bash
# GPU check of fused_stable: the CUDA tests, the full optimizer benchmark, the update rules against their references
# (benchmarks/rules_step.py: FusedLion, FusedMuon), then the trainer on the GPU (benchmarks/gpu_trainer.py: every
# recipe, and throughput against the HF Trainer), in under 8 minutes, offline.
#
# Run from anywhere inside a copy of the working tree on a machine with a CUDA GPU, torch and triton already
# importable, and no network:
#     OUT=/some/dir bash benchmarks/gpu_check.sh
# It writes at most 12 files under "$OUT" (never deeper than $OUT/results/<file>):
#     gpu_check.log            everything this script printed
#     env.txt                  nvidia-smi, python and library versions
#     tests.log                the CUDA test run
#     bench.log                the benchmark's progress and table
#     rules.log                rules_step.py's rows
#     trainer.log              gpu_trainer.py's progress and tables
#     results/<stem>.json      every row, the environment record, the goal checks (optimizer benchmark)
#     results/<stem>.md        the same as a markdown table (commit both under benchmarks/results/)
#     results/<trainer stem>.json and .md   the same for the trainer (gpu-trainer-<stamp>)
#     results/rules-step-<stamp>.json and .md   the rules' rows (lion-pytorch: carry its wheel, or its rows skip)
# QLoRA needs bitsandbytes, which the device image lacks: carry its wheel (docs/benchmarks.md, "The trainer on a
# GPU"); without it the QLoRA recipe says so and everything else runs.
# Exit status: 0 when the tests passed (or none were selected), the benchmark wrote its results and
# gpu_trainer.py ran every stage (its goals are in its report, not in the exit status).
#
# Dry run of the same logic on a CPU-only machine (tiny sizes, CPU timings; not GPU numbers):
#     GPU_CHECK_DEVICE=cpu OUT=/tmp/gc bash benchmarks/gpu_check.sh
set -uo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"
OUT="${OUT:-$ROOT/gpu_check_out}"
PYTHON="${PYTHON:-python}"
DEVICE="${GPU_CHECK_DEVICE:-cuda}"
TESTS_K="${GPU_CHECK_TESTS_K:-cuda or gpu or triton}"
# Time budget (seconds): install ~15, tests <= 100, optimizer benchmark <= 140 (rows stop at its --deadline of
# 110, then the results are written), rules <= 50 (4 rows of 2 s), trainer <= 160 (its --deadline of 130: recipes
# up to 40% of it, then the throughput rounds) -> at most 465 s, under 8 minutes with start-up and nvidia-smi.
TESTS_TIMEOUT="${GPU_CHECK_TESTS_TIMEOUT:-100}"
BENCH_DEADLINE="${GPU_CHECK_BENCH_DEADLINE:-110}"
BENCH_TIMEOUT="${GPU_CHECK_BENCH_TIMEOUT:-140}"
RULES_TIMEOUT="${GPU_CHECK_RULES_TIMEOUT:-50}"
RULES_ARGS=(--plan gpu --budget 2)
TRAINER_DEADLINE="${GPU_CHECK_TRAINER_DEADLINE:-130}"
TRAINER_TIMEOUT="${GPU_CHECK_TRAINER_TIMEOUT:-160}"
STAMP="$(date -u +%Y%m%dT%H%M%SZ)"

mkdir -p "$OUT/results"
exec > >(tee -a "$OUT/gpu_check.log") 2>&1
echo "== fused_stable gpu_check $STAMP in $ROOT (device $DEVICE) =="

# Compile caches go outside $OUT: only the files listed above may land there.
export TORCHINDUCTOR_CACHE_DIR="${TORCHINDUCTOR_CACHE_DIR:-${TMPDIR:-/tmp}/fused_stable_inductor}"
export TRITON_CACHE_DIR="${TRITON_CACHE_DIR:-${TMPDIR:-/tmp}/fused_stable_triton}"
export PYTHONDONTWRITEBYTECODE=1

if [ "$DEVICE" = "cpu" ]; then
    # CPU dry run: the gpu plan shrunk 1000-fold; the CUDA tests deselect or skip themselves.
    BENCH_ARGS=(--plan gpu --device cpu --size-scale 1e-3 --compile-timeout 60)
    BENCH_STEM="gpu-plan-dryrun-cpu-$STAMP"
    # a 2-core CPU needs far longer than the GPU's budgets (the tests through Triton's interpreter, the
    # trainer's tiny sizes): the CPU dry run keeps its own time boxes
    TESTS_TIMEOUT="${GPU_CHECK_TESTS_TIMEOUT:-900}"
    BENCH_DEADLINE="${GPU_CHECK_BENCH_DEADLINE:-240}"
    BENCH_TIMEOUT="${GPU_CHECK_BENCH_TIMEOUT:-290}"
    TRAINER_ARGS=(--device cpu --size tiny)
    TRAINER_STEM="gpu-trainer-dryrun-cpu-$STAMP"
    RULES_ARGS=(--plan smoke --budget 0.3)
    RULES_TIMEOUT="${GPU_CHECK_RULES_TIMEOUT:-300}"
    TRAINER_DEADLINE="${GPU_CHECK_TRAINER_DEADLINE:-1200}"
    TRAINER_TIMEOUT="${GPU_CHECK_TRAINER_TIMEOUT:-1500}"
else
    BENCH_ARGS=(--plan gpu --device "$DEVICE")
    BENCH_STEM="gpu-$STAMP"
    TRAINER_ARGS=(--device "$DEVICE")
    TRAINER_STEM="gpu-trainer-$STAMP"
fi

# --- environment -------------------------------------------------------------------------------------------
{
    echo "date: $STAMP"
    if command -v nvidia-smi >/dev/null 2>&1; then
        nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.max.memory,clocks.max.sm --format=csv
        nvidia-smi -L
    else
        echo "nvidia-smi: not found"
    fi
    "$PYTHON" - <<'PY'
import platform, torch
print("python", platform.python_version(), platform.platform())
print("torch", torch.__version__, "cuda", torch.version.cuda, "available", torch.cuda.is_available())
if torch.cuda.is_available():
    print("device", torch.cuda.get_device_name(0), torch.cuda.get_device_properties(0))
# bitsandbytes and torchao are the 8-bit contenders (bnb_8bit, torchao_8bit rows): skipped with
# the reason when absent; bring their wheels
for name in ("triton", "transformers", "peft", "accelerate", "bitsandbytes", "torchao"):
    try:
        print(name, __import__(name).__version__)
    except Exception as e:
        print(name, "not importable:", type(e).__name__, e)
PY
} > "$OUT/env.txt" 2>&1
cat "$OUT/env.txt"

# --- install (offline: no build isolation, no dependencies) ------------------------------------------------
if ! "$PYTHON" -c "import fused_stable.bench" >/dev/null 2>&1; then
    echo "== pip install -e . --no-deps"
    "$PYTHON" -m pip install -q -e . --no-deps --no-build-isolation \
        || "$PYTHON" -m pip install -q -e . --no-deps
fi
for module in rich pytest; do
    if ! "$PYTHON" -c "import $module" >/dev/null 2>&1; then
        echo "== $module missing: trying the local wheel cache"
        "$PYTHON" -m pip install -q --no-index "$module" || echo "could not install $module"
    fi
done
if ! "$PYTHON" -c "import fused_stable.bench"; then
    echo "FAIL: fused_stable is not importable; nothing else can run"
    exit 3
fi

# --- CUDA tests --------------------------------------------------------------------------------------------
echo "== CUDA tests: pytest -m 'not benchmark' tests -k '$TESTS_K' (time box ${TESTS_TIMEOUT}s)"
# --continue-on-collection-errors: a test module that cannot be imported here (a missing optional package, a
# clashing module name) must not stop the CUDA tests of the other modules from running; it still fails the run.
timeout -k 10 "$TESTS_TIMEOUT" "$PYTHON" -m pytest -q -rfE -p no:cacheprovider --continue-on-collection-errors \
    -m "not benchmark" tests -k "$TESTS_K" > "$OUT/tests.log" 2>&1
TESTS_RC=$?
tail -n 25 "$OUT/tests.log"
SUMMARY="$(tail -n 1 "$OUT/tests.log")"
case "$TESTS_RC" in
    0) echo "tests: passed ($SUMMARY)" ;;
    5) echo "tests: none selected by -k '$TESTS_K'"; TESTS_RC=0 ;;
    124|137) echo "tests: TIMED OUT after ${TESTS_TIMEOUT}s" ;;
    *) if [[ "$SUMMARY" == *failed* ]]; then echo "tests: FAILED (exit $TESTS_RC): $SUMMARY"
       else echo "tests: no test failed, but errors (collection or setup; see tests.log): $SUMMARY"; fi ;;
esac

# --- benchmark ---------------------------------------------------------------------------------------------
echo "== benchmark: fused-stable bench ${BENCH_ARGS[*]} --deadline $BENCH_DEADLINE (time box ${BENCH_TIMEOUT}s)"
timeout -k 10 "$BENCH_TIMEOUT" "$PYTHON" -m fused_stable.bench "${BENCH_ARGS[@]}" \
    --deadline "$BENCH_DEADLINE" --out "$OUT/results" --name "$BENCH_STEM" > "$OUT/bench.log" 2>&1
BENCH_RC=$?
# the profiler's start/stop lines are noise in the log shown here (bench.log keeps them)
grep -v -e '^USDT' -e 'SyncActivityProfiler' "$OUT/bench.log" | tail -n 60
if [ -s "$OUT/results/$BENCH_STEM.md" ]; then
    echo "== results: $OUT/results/$BENCH_STEM.json and .md (bench exit $BENCH_RC)"
    [ "$BENCH_RC" -eq 0 ] || echo "(partial: the benchmark was cut short; the files hold the rows it finished)"
else
    echo "FAIL: the benchmark wrote no results (exit $BENCH_RC)"
    BENCH_RC=${BENCH_RC:-1}; [ "$BENCH_RC" -eq 0 ] && BENCH_RC=1
fi

# --- the update rules against their references (lion-pytorch + clip; torch.optim.Muon + AdamW + clip) ----------
echo "== rules: benchmarks/rules_step.py ${RULES_ARGS[*]} (time box ${RULES_TIMEOUT}s)"
timeout -k 10 "$RULES_TIMEOUT" "$PYTHON" benchmarks/rules_step.py "${RULES_ARGS[@]}" --out "$OUT/results" \
    > "$OUT/rules.log" 2>&1
echo "rules exit $?"; tail -n 12 "$OUT/rules.log"

# --- the trainer on the device: every recipe, then throughput against the HF Trainer -------------------------
echo "== trainer: benchmarks/gpu_trainer.py ${TRAINER_ARGS[*]} --deadline $TRAINER_DEADLINE (time box ${TRAINER_TIMEOUT}s)"
timeout -k 10 "$TRAINER_TIMEOUT" "$PYTHON" benchmarks/gpu_trainer.py "${TRAINER_ARGS[@]}" \
    --deadline "$TRAINER_DEADLINE" --out "$OUT/results" --name "$TRAINER_STEM" > "$OUT/trainer.log" 2>&1
TRAINER_RC=$?
# the loop's progress lines are in trainer.log; the tables come last
grep -v -e '^step [0-9]' -e '^{' "$OUT/trainer.log" | tail -n 60
if [ -s "$OUT/results/$TRAINER_STEM.md" ]; then
    echo "== trainer results: $OUT/results/$TRAINER_STEM.json and .md (exit $TRAINER_RC)"
    case "$TRAINER_RC" in
        0) ;;
        124|137) echo "(partial: gpu_trainer.py was stopped by its time box; the files hold what it finished)" ;;
        *) echo "(a recipe or row failed: see its traceback in the .json)" ;;
    esac
else
    echo "FAIL: gpu_trainer.py wrote no results (exit $TRAINER_RC)"
    [ "$TRAINER_RC" -eq 0 ] && TRAINER_RC=1
fi

echo "== done: tests exit $TESTS_RC, bench exit $BENCH_RC, trainer exit $TRAINER_RC; files under $OUT:"
find "$OUT" -type f | sort
if [ "$TESTS_RC" -ne 0 ]; then exit "$TESTS_RC"; fi
if [ "$BENCH_RC" -ne 0 ]; then exit "$BENCH_RC"; fi
exit "$TRAINER_RC"
