#!/usr/bin/env bash
# One GPU machine for a few minutes, most important first: the single-GPU speed table (bench.sweep --preset
# gpu-speed, headline cases first) for at most SPEED_S seconds, then the device paths against the CPU reference
# and the pipeline's throughput (bench/gpu_check.sh) for at most CHECK_S. Records and logs go to OUT as they are
# measured, so a part cut short keeps what it finished; render the README table afterwards with
# `python -m bench.report --results OUT/train.jsonl`. The defaults fit one 600 s call.
#
#   bash bench/gpu_session.sh OUT [WHEELS]   # WHEELS: from bench/offline_wheels.sh, where DeepSpeed is missing;
#                                            # DALI from the parts in WHEELS-dali (or DALI_PARTS) where they are
set -uo pipefail
cd "$(dirname "$0")/.."
out="${1:?usage: bench/gpu_session.sh OUT [WHEELS]}"
py="${PYTHON:-python3}"
mkdir -p "$out"
site=/tmp/gpu-session-site
if [ -n "${2:-}" ]; then
  if ! "$py" -m pip install --quiet --no-index --no-deps --target "$site" "$2"/*.whl; then
    echo "the wheels in $2 do not install here: build them for $("$py" -V) with bench/offline_wheels.sh DIR X.Y" >&2
    exit 2
  fi
fi
# DALI's wheel in parts, carried one per call before this one (bench/offline_wheels.sh with WITH_DALI=1).
parts="${DALI_PARTS:-${2:-wheels}-dali}"
if [ -f "$parts/SHA256" ]; then
  wheel=$(awk '{print $2}' "$parts/SHA256")
  cat "$parts/$wheel".part* > "/tmp/$wheel"
  if ! (cd /tmp && sha256sum --quiet -c -) < "$parts/SHA256" \
      || ! "$py" -m pip install --quiet --no-index --no-deps --target "$site" "/tmp/$wheel"; then
    echo "DALI's parts in $parts are incomplete or do not install ($(ls "$parts" | grep -c part) here): DALI skipped"
  fi
fi
[ -d "$site" ] && export PYTHONPATH="$site${PYTHONPATH:+:$PYTHONPATH}"
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
# DeepSpeed JIT-builds FusedAdam on the first case: for this GPU's architecture only, not for every one.
TORCH_CUDA_ARCH_LIST="${TORCH_CUDA_ARCH_LIST:-$("$py" -c 'import torch; print("%d.%d" % torch.cuda.get_device_capability())')}"
export TORCH_CUDA_ARCH_LIST
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv > "$out/gpu.txt" 2>&1
# timeout signals the sweep's whole process group: the running case goes too, its finished records stay.
timeout --kill-after 10 "${SPEED_S:-390}" "$py" -m bench.sweep --preset gpu-speed --no_report --out "$out/train.jsonl" \
  2>&1 | tee "$out/speed.log"
speed=${PIPESTATUS[0]}
[ "$speed" = 124 ] && echo "speed sweep stopped after ${SPEED_S:-390} s: the cases finished by then are in $out/train.jsonl"
PIPELINE_DATA=data/bench/gpu_train.h5 PYTHON="$py" timeout --kill-after 10 "${CHECK_S:-170}" \
  bash bench/gpu_check.sh "$out/pipeline.jsonl" 2>&1 | tee "$out/check.log"
check=${PIPESTATUS[0]}
exit $((speed || check))
