#!/usr/bin/env bash
# GPU check, under 5 minutes on one GPU: the pipeline's throughput at 64^3, batch 64, per backend and storage mode
# (dali-device is DALI's graph over GPU-resident volumes, torch-device the torch gather: backend auto takes torch for
# device storage on a GPU, docs/data.md says why with both figures), then the device paths against the CPU reference
# (tests/test_device_paths.py, CUDA variants included, with the proof that DALI copies no volume per batch, by the
# memory it allocates, which it prints; the fast paths' GPU tests).
# Where DALI is not installed it checks the torch backend and says that DALI was skipped.
#
#   bash tools/gpu_check.sh [RESULTS.jsonl]   # PYTHON=... picks the interpreter; needs torch (CUDA), h5py, pytest
#                                             # PIPELINE_DATA=... an HDF5 box to read (else a 256^3 one is written)
#                                             # TESTS=0 measures the throughput only
set -uo pipefail
cd "$(dirname "$0")/.." || exit 2
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
results="${1:-bench/results/pipeline.jsonl}"
py="${PYTHON:-python3}"
"$py" - <<'PY' || exit 2
import torch
assert torch.cuda.is_available(), "no CUDA device: this check is for a GPU machine"
print("GPU:", torch.cuda.get_device_name(0), "| torch", torch.__version__, "| CUDA", torch.version.cuda)
PY
if "$py" -c "import nvidia.dali" 2>/dev/null; then dali=(); else
  echo "DALI is not installed here: checking the torch backend only (DALI skipped)"; dali=(--no_dali)
fi
# The throughput first (its records are appended as each case is timed), then the tests, whose training runs
# (one compiles with CUDA graphs) take longest.
data=(); [ -n "${PIPELINE_DATA:-}" ] && [ -f "$PIPELINE_DATA" ] && data=(--data "$PIPELINE_DATA")
"$py" -m bench.pipeline --crops 64 --batch 64 --batches 20 --repeats 2 --out "$results" "${dali[@]}" "${data[@]}"
status=$?
if [ "${TESTS:-1}" = 1 ]; then
  "$py" -m pytest -q -rs -s -p no:cacheprovider tests/test_device_paths.py tests/test_fast_paths.py \
    -k "device or gpu or synchron" || status=1
fi
exit $status
