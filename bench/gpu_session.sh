#!/usr/bin/env bash
# One GPU machine for a few minutes, most important first: the single-GPU speed table (bench.sweep --preset
# gpu-speed), then the device paths against the CPU reference and the pipeline's throughput (bench/gpu_check.sh).
# Records and logs go to OUT as they are measured, so a session cut short keeps what it finished; render the
# README table afterwards with `python -m bench.report --results OUT/train.jsonl`.
#
#   bash bench/gpu_session.sh OUT [WHEELS]   # WHEELS: from bench/offline_wheels.sh, where DeepSpeed is missing
set -uo pipefail
cd "$(dirname "$0")/.."
out="${1:?usage: bench/gpu_session.sh OUT [WHEELS]}"
py="${PYTHON:-python3}"
mkdir -p "$out"
if [ -n "${2:-}" ]; then
  "$py" -m pip install --quiet --no-index --no-deps --target /tmp/gpu-session-site "$2"/*.whl || exit 2
  export PYTHONPATH="/tmp/gpu-session-site${PYTHONPATH:+:$PYTHONPATH}"
fi
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv > "$out/gpu.txt" 2>&1
"$py" -m bench.sweep --preset gpu-speed --no_report --out "$out/train.jsonl" 2>&1 | tee "$out/speed.log"
speed=${PIPESTATUS[0]}
PYTHON="$py" bash bench/gpu_check.sh "$out/pipeline.jsonl" 2>&1 | tee "$out/check.log"
check=${PIPESTATUS[0]}
exit $((speed || check))
