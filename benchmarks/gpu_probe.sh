#!/usr/bin/env bash
# The two-minute GPU probe of fused_stable (benchmarks/gpu_probe.py): run it first whenever a GPU is lent.
#
#     OUT=/some/dir bash benchmarks/gpu_probe.sh
# From anywhere inside a copy of the working tree, on a machine with a CUDA GPU, torch and triton importable and
# no network. Writes under "$OUT" (default ./gpu_probe_out): gpu_probe.log (everything printed) and
# results/gpu-probe-<stamp>.json and .md (commit both under benchmarks/results/).
# Exit status: 0 when the probe wrote its results; 2 when there is no CUDA device (nothing is measured then:
# `python benchmarks/gpu_probe.py --dry-run` checks the probe's plan on CPU); 1 on any other failure.
set -uo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"
OUT="${OUT:-$ROOT/gpu_probe_out}"
PYTHON="${PYTHON:-python}"
BUDGET="${GPU_PROBE_BUDGET:-100}"      # seconds of measurements; compile and start-up come on top
TIMEOUT="${GPU_PROBE_TIMEOUT:-170}"    # hard stop for the whole probe

if ! "$PYTHON" -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)" 2>/dev/null; then
    echo "gpu_probe: FAILED: no CUDA device is visible (torch.cuda.is_available() is False)." >&2
    echo "gpu_probe: this probe measures only on a GPU; on CPU, check it with: $PYTHON benchmarks/gpu_probe.py --dry-run" >&2
    exit 2
fi

mkdir -p "$OUT"
export PYTHONPATH="$ROOT${PYTHONPATH:+:$PYTHONPATH}"
export TRITON_CACHE_DIR="${TRITON_CACHE_DIR:-${TMPDIR:-/tmp}/fused_stable_triton}"
export PYTHONDONTWRITEBYTECODE=1
unset TRITON_INTERPRET FUSED_STABLE_BACKEND
echo "== fused_stable gpu_probe in $ROOT, budget ${BUDGET}s, results under $OUT/results" | tee "$OUT/gpu_probe.log"
timeout -k 10 "$TIMEOUT" "$PYTHON" benchmarks/gpu_probe.py --out "$OUT" --budget "$BUDGET" 2>&1 | tee -a "$OUT/gpu_probe.log"
RC=${PIPESTATUS[0]}
case "$RC" in
    0) echo "== done: $(ls "$OUT"/results/gpu-probe-*.json 2>/dev/null | tail -n 1)" ;;
    124|137) echo "gpu_probe: FAILED: timed out after ${TIMEOUT}s (see $OUT/gpu_probe.log)" >&2; exit 1 ;;
    *) echo "gpu_probe: FAILED with exit $RC (see $OUT/gpu_probe.log)" >&2; exit 1 ;;
esac
