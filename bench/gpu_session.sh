#!/usr/bin/env bash
# The GPU measurements in one time-boxed run, most important first, for a short allocation on a GPU node: the
# single-GPU speed table (bench.sweep --preset gpu-speed, headline cases first) until SPEED_S seconds (300) into the
# script, then the device paths against the CPU reference and the pipeline's throughput (bench/gpu_check.sh) for at
# most CHECK_S (150), then bench.tune on bs64_opt's micro-batch and precision for TUNE_S (90; 0 skips it). Records
# and logs go to OUT as they are measured, so a part cut short keeps what it finished;
# render the table of docs/benchmarks.md afterwards with `python -m bench.report --results OUT/train.jsonl`. The
# defaults fit a 10-minute allocation.
#
#   bash bench/gpu_session.sh OUT [WHEELS]   # WHEELS: from bench/offline_wheels.sh, where DeepSpeed is missing;
#                                            # DALI from the parts in WHEELS-dali (or DALI_PARTS) where they are
set -uo pipefail
cd "$(dirname "$0")/.." || exit 2
out="${1:?usage: bench/gpu_session.sh OUT [WHEELS]}"
py="${PYTHON:-python3}"
mkdir -p "$out" 2>/dev/null || { echo "gpu_session.sh: $out cannot be made a directory (a file, or under one)" >&2; exit 2; }
site=/tmp/cosmo-emulator-gpu-site
if [ -n "${2:-}" ]; then
  if ! "$py" -m pip install --quiet --no-index --no-deps --target "$site" "$2"/*.whl; then
    echo "the wheels in $2 do not install here: build them for $("$py" -V) with bench/offline_wheels.sh DIR X.Y" >&2
    exit 2
  fi
fi
# DALI's wheel from its parts (bench/offline_wheels.sh with WITH_DALI=1), joined and checked against SHA256.
parts="${DALI_PARTS:-${2:-wheels}-dali}"
if [ -f "$parts/SHA256" ]; then
  wheel=$(awk '{print $2}' "$parts/SHA256")
  cat "$parts/$wheel".part* > "/tmp/$wheel"
  if ! (cd /tmp && sha256sum --quiet -c -) < "$parts/SHA256" \
      || ! "$py" -m pip install --quiet --no-index --no-deps --target "$site" "/tmp/$wheel"; then
    found=$(compgen -G "$parts/*.part*" | wc -l)
    echo "DALI's parts in $parts are incomplete or do not install ($found here): DALI skipped"
  fi
fi
# The wheels' programs (ninja, which DeepSpeed's JIT build of FusedAdam runs) are in $site/bin.
[ -d "$site" ] && export PYTHONPATH="$site${PYTHONPATH:+:$PYTHONPATH}" PATH="$site/bin:$PATH"
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
# Every module the sweep and the checks need, named at once, before anything is built or measured.
"$py" -m bench.preflight --gpu || exit 2
"$py" -m bench.preflight --dali > /dev/null 2>&1 || echo "DALI or one of its requirements is missing: torch backend only"
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv > "$out/gpu.txt" 2>&1
speed_s=${SPEED_S:-300}
# DeepSpeed JIT-builds FusedAdam on first use (about a minute, counted in SPEED_S); where it cannot, every case
# takes torch's fused Adam instead (merged into each case's DeepSpeed settings; the records say which).
optimizer=()
if ! timeout 240 "$py" - > "$out/fused_adam.log" 2>&1 <<'PY'
import torch
from deepspeed.ops.adam import FusedAdam

weight = torch.zeros(8, device="cuda", requires_grad=True)
weight.grad = torch.ones_like(weight)
FusedAdam([weight]).step()
PY
then
  echo "DeepSpeed's FusedAdam did not build (the end of $out/fused_adam.log says why): torch's fused Adam instead"
  tail -3 "$out/fused_adam.log"
  optimizer=(--deepspeed_overrides '{"optimizer": {"params": {"torch_adam": true, "fused": true}}}')
fi
speed_s=$((speed_s - SECONDS > 60 ? speed_s - SECONDS : 60))
# timeout signals the sweep's whole process group: the running case goes too, its finished records stay.
timeout --kill-after 10 "$speed_s" "$py" -m bench.sweep --preset gpu-speed --no_report --out "$out/train.jsonl" \
  "${optimizer[@]}" 2>&1 | tee "$out/speed.log"
speed=${PIPESTATUS[0]}
case $speed in 124 | 137) echo "speed sweep stopped after $speed_s s: its finished cases are in $out/train.jsonl";; esac
PIPELINE_DATA=data/bench/gpu_train.h5 PYTHON="$py" timeout --kill-after 10 "${CHECK_S:-150}" \
  bash bench/gpu_check.sh "$out/pipeline.jsonl" 2>&1 | tee "$out/check.log"
check=${PIPESTATUS[0]}
tune_s=${TUNE_S:-90}
tune=0
if [ "$tune_s" -gt 0 ]; then
  # on the speed sweep's synthetic boxes; the budget holds the runs, the tuner's start and writing come on top
  "$py" -m bench.tune --config bs64_opt --budget_s "$tune_s" --stages micro_batch precision --steps 5 --repeats 1 \
    --out "$out/bs64_opt_tuned.yaml" --overwrite --train_path data/bench/gpu_train.h5 --val_path data/bench/gpu_val.h5 \
    --synthetic '{train_box_size: 256, val_box_size: 128, seed: 0}' --storage device --Nsamples_val 256 "${optimizer[@]}" \
    2>&1 | tee "$out/tune.log"
  tune=${PIPESTATUS[0]}
fi
exit $((speed || check || tune))
