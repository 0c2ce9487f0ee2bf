#!/usr/bin/env bash
# The GPU session in one run, for a short allocation on a GPU node, in three parts, each in its own time box:
#   1. correctness, at most CORRECT_S seconds (240): DeepSpeed's FusedAdam built (or why not, and torch's fused Adam
#      for everything after), short fp16 and bf16 runs of bs64_opt that must lower the validation loss and change
#      the weights without a "not learning" warning, the GPU tests, and a micro-batch too large for the GPU, which
#      must end in one line and status 2;
#   2. speed, at most SPEED_S (300): the headline case, the pipeline's device storage alone, one profiled run, the
#      single levers (bench.sweep --preset gpu-speed);
#   3. the rest: the pipeline's throughput (tools/gpu_check.sh, its tests ran in part 1) for at most CHECK_S (150), then
#      bench.tune on bs64_opt's micro-batch and precision for TUNE_S (90; 0 skips it).
# Results go to OUT as they are measured. After each part, OUT is packed into PACK_TO/session.tar.gz beside
# PACK_TO/summary.txt (one PASS, FAIL or SKIP line per check; PACK_TO is OUT unless set), so that an allocation
# copying back only a few files loses nothing. Render the table of docs/benchmarks.md afterwards with
# `python -m bench.report --results OUT/train.jsonl`. A copy of the project without its repository names its commit
# in the records where `python -m trainer.provenance` wrote COMMIT before copying.
#
#   bash tools/gpu_session.sh OUT [WHEELS]   # WHEELS: from tools/offline_wheels.sh, where DeepSpeed is missing;
#                                            # DALI from the parts in WHEELS-dali (or DALI_PARTS) where they are
set -uo pipefail
# Paths as the caller gave them, before the script moves to the repository root.
out=$(realpath -m "${1:?usage: tools/gpu_session.sh OUT [WHEELS]}")
wheels=$([ -n "${2:-}" ] && realpath -m "$2")
parts=$(realpath -m "${DALI_PARTS:-${wheels:-wheels}-dali}")
pack_to=$(realpath -m "${PACK_TO:-$out}")
cd "$(dirname "$0")/.." || exit 2
py="${PYTHON:-python3}"
mkdir -p "$out" 2>/dev/null || { echo "gpu_session.sh: $out cannot be made a directory (a file, or under one)" >&2; exit 2; }
mkdir -p "$pack_to" 2>/dev/null || { echo "gpu_session.sh: PACK_TO $pack_to cannot be made a directory" >&2; exit 2; }
summary="$pack_to/summary.txt"
failed=0

note() {  # one line of the summary: STATUS CHECK: detail
  echo "$1 $2${3:+: $3}" | tee -a "$summary"
  [ "$1" = FAIL ] && failed=1
  return 0
}

pack() {  # everything under OUT so far, in one archive beside the summary (written aside, then moved in)
  local partial
  partial=$(mktemp "${TMPDIR:-/tmp}/session.XXXXXX") || return 1
  # checkpoints left out: bs64_opt's are 1.6 GB each, and the runs' records say what they held
  tar -czf "$partial" --exclude=./session.tar.gz --exclude='*/checkpoints' -C "$out" .
  [ $? -le 1 ] && mv "$partial" "$pack_to/session.tar.gz"  # 1: a file changed while read (a log still written)
  rm -f "$partial"
}

left() {  # seconds left until $1 (a value of SECONDS), at least 1 (timeout 0 would mean no limit)
  echo $(($1 - SECONDS > 1 ? $1 - SECONDS : 1))
}

: > "$summary"
site=/tmp/cosmo-emulator-gpu-site
rm -rf "$site"  # pip --target does not replace what an earlier session installed there
if [ -n "$wheels" ]; then
  if ! "$py" -m pip install --quiet --no-index --no-deps --target "$site" "$wheels"/*.whl; then
    echo "the wheels in $wheels do not install here: build them for $("$py" -V) with tools/offline_wheels.sh DIR X.Y" >&2
    exit 2
  fi
fi
[ -d "$parts" ] && PYTHON="$py" bash tools/install_dali_parts.sh "$parts" "$site"
# The wheels' programs (ninja, which DeepSpeed's JIT build of FusedAdam runs) are in $site/bin.
[ -d "$site" ] && export PYTHONPATH="$site${PYTHONPATH:+:$PYTHONPATH}" PATH="$site/bin:$PATH"
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
# Every module the session needs, named at once, before anything is built or measured.
"$py" -m tools.preflight --gpu || exit 2
dali_cases=(dali-device)
if ! "$py" -m tools.preflight --dali > /dev/null 2>&1; then
  echo "DALI or one of its requirements is missing: torch backend only"
  dali_cases=(--no_dali)
fi
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv > "$out/gpu.txt" 2>&1
note INFO commit "$("$py" -c 'from trainer.provenance import git_commit; print(git_commit())')"
note INFO gpu "$(tail -1 "$out/gpu.txt")"

# 1. Correctness.
correct_end=$((SECONDS + ${CORRECT_S:-240}))
optimizer=()
# DeepSpeed JIT-builds FusedAdam on first use (about a minute), with TORCH_CUDA_ARCH_LIST fitted for its parser as
# training fits it; where it cannot, every later run takes torch's fused Adam (the records' optimizer says which).
if timeout "$(left $correct_end)" "$py" - > "$out/fused_adam.log" 2>&1 <<'PY'; then
import logging
import sys

import torch

logging.basicConfig(level=logging.INFO, format="%(message)s")
from trainer.fused_adam import fused_adam_problem  # noqa: E402

if problem := fused_adam_problem():
    sys.exit(f"DeepSpeed's FusedAdam cannot be built here: {problem}")
from deepspeed.ops.adam import FusedAdam  # noqa: E402

weight = torch.zeros(8, device="cuda", requires_grad=True)
weight.grad = torch.ones_like(weight)
FusedAdam([weight]).step()
print("FusedAdam built, and stepped once")
PY
  note PASS fused_adam "$(tail -1 "$out/fused_adam.log")"
else
  note FAIL fused_adam "$(tail -1 "$out/fused_adam.log") (torch's fused Adam from here on; $out/fused_adam.log)"
  optimizer=(--deepspeed_overrides '{"optimizer": {"params": {"torch_adam": true, "fused": true}}}')
fi
boxes=(--synthetic "{train_box_size: 256, val_box_size: 128, seed: 0}" --train_path data/bench/gpu_train.h5
  --val_path data/bench/gpu_val.h5 --storage device)
headline=(--channels_last true --cudnn_benchmark true)  # bench.sweep's HEADLINE
for precision in fp16 bf16; do
  run="$out/learn-$precision"
  seconds=$(left $correct_end)
  if [ "$seconds" -lt 30 ]; then note SKIP "learns_$precision" "out of time"; continue; fi
  # --kill-after: SIGTERM asks the trainer for a checkpoint at the next step first
  timeout --kill-after 20 "$seconds" "$py" ds_train.py --config bs64_opt "${boxes[@]}" \
    --deepspeed_config "ds_configs/ds_$precision.json" \
    --Nsamples 2048 --Nsamples_val 256 --num_epochs 2 --log_every_steps 8 --run_dir "$run" --overwrite \
    "${optimizer[@]}" > "$out/learn-$precision.log" 2>&1
  status=$?
  verdict=$("$py" - "$run" "$out/learn-$precision.log" "$status" <<'PY'
import json
import sys
from pathlib import Path

run, log, status = Path(sys.argv[1]), Path(sys.argv[2]).read_text(), int(sys.argv[3])
try:
    s = json.loads((run / "summary.json").read_text())
except (OSError, ValueError):
    print(f"FAIL status {status}, no summary.json: {(log.strip().splitlines() or [''])[-1]}")
    sys.exit()
learned = s["final_val_loss"] < s["initial_val_loss"] and s["weights_changed"] and "not learning" not in log
print(
    f"{'PASS' if learned and status == 0 else 'FAIL'} validation loss {s['initial_val_loss']:.5f} -> "
    f"{s['final_val_loss']:.5f}, weights changed {s['weights_changed']}, loss scale {s['last_loss_scale']}, "
    f"{s['skipped_steps']} of {s['steps']} steps skipped, {s['samples_per_s'] or 0:.0f} samples/s, status {status}"
)
PY
  )
  verdict=${verdict:-FAIL the verdict on $run could not be made}
  note "${verdict%% *}" "learns_$precision" "${verdict#* }"
  rm -rf "$run/checkpoints"
done
seconds=$(left $correct_end)
if [ "$seconds" -ge 20 ]; then
  # DeepSpeed's GPU fp16 path and the watch on real engines (these tests run on a GPU where there is one), then the
  # device paths against the CPU reference and the fast paths' GPU tests.
  timeout --kill-after 10 "$seconds" "$py" -m pytest -q -rs -p no:cacheprovider tests/test_fp16.py \
    tests/test_numerics.py > "$out/tests.log" 2>&1
  status=$?
  timeout --kill-after 10 "$(left $correct_end)" "$py" -m pytest -q -rs -p no:cacheprovider \
    tests/test_device_paths.py tests/test_fast_paths.py -k "device or gpu or synchron" >> "$out/tests.log" 2>&1
  status=$((status || $?))
  note "$([ $status = 0 ] && echo PASS || echo FAIL)" gpu_tests \
    "$(grep -E '(passed|failed|error)' "$out/tests.log" | grep -v '^FAILED' | tr '\n' ' ') (tests.log)"
else
  note SKIP gpu_tests "out of time"
fi
seconds=$(left $correct_end)
if [ "$seconds" -ge 20 ]; then
  # 2,048 crops of 64^3 per micro-batch need several times the GPU's memory: one line, status 2, nothing lost.
  timeout --kill-after 20 "$seconds" "$py" ds_train.py --config bs64_opt "${boxes[@]}" --global_batch_size 2048 \
    --base_batch_size 2048 --Nsamples 2048 --Nsamples_val 256 --num_epochs 1 --run_dir "$out/too-large" --overwrite \
    "${optimizer[@]}" > "$out/too-large.log" 2>&1
  status=$?
  line=$(grep -m1 "does not fit in the memory of" "$out/too-large.log")
  if [ $status = 2 ] && [ -n "$line" ] && ! grep -q Traceback "$out/too-large.log"; then
    note PASS out_of_memory "$line"
  else
    note FAIL out_of_memory "status $status: $(tail -1 "$out/too-large.log")"
  fi
else
  note SKIP out_of_memory "out of time"
fi
pack

# 2. Speed, in SPEED_S seconds (0 skips it), most wanted first: the headline case (fp16, FusedAdam, channels-last
# with cudnn.benchmark; synthetic, full and the plain torch loop), DALI's and torch's device storage alone (the
# pipeline at 64^3, batch 64, against the limit of plain copies), one profiled run (the ten most expensive kernels
# and each block's share: learn-profile/profile/summary_rank0.txt), then the single levers of the gpu-speed sweep.
speed_s=${SPEED_S:-300}
if [ "$speed_s" -gt 0 ]; then
  speed_end=$((SECONDS + speed_s))
  run_id=$(date +%Y%m%dT%H%M%S)  # one run for bench.report: the headline and the levers together
  sweep() {  # bench.sweep's gpu-speed cases of one sweep; timeout signals its process group, finished records stay
    timeout --kill-after 10 "$(left $speed_end)" "$py" -m bench.sweep --preset gpu-speed --only "$1" --no_report \
      --run_id "$run_id" --out "$out/train.jsonl" "${optimizer[@]}" >> "$out/speed.log" 2>&1
  }
  sweep headline
  status=$?
  records=$(cat "$out/train.jsonl" 2>/dev/null | wc -l)
  case $status in
    0) note PASS speed_headline "$records record(s) in train.jsonl" ;;
    124 | 137) note INFO speed_headline "stopped at SPEED_S with $records record(s) in train.jsonl" ;;
    *) note FAIL speed_headline "status $status, $records record(s) (speed.log)" ;;
  esac
  if [ "$(left $speed_end)" -le 30 ]; then
    note SKIP pipeline_device "out of time"
  else
    timeout --kill-after 10 "$(left $speed_end)" "$py" -m bench.pipeline --data data/bench/gpu_train.h5 --crops 64 \
      --batch 64 --batches 20 --repeats 2 --cases limit torch-device "${dali_cases[@]}" --out "$out/pipeline.jsonl" \
      > "$out/pipeline-device.log" 2>&1
    status=$?
    note "$([ $status = 0 ] && echo PASS || echo FAIL)" pipeline_device "$(grep -E '^\| 64' "$out/pipeline-device.log" | tr -s ' ' | tr '\n' ' ')"
  fi
  if [ "$(left $speed_end)" -le 60 ]; then
    note SKIP profile "out of time"
  else
    timeout --kill-after 20 "$(left $speed_end)" "$py" ds_train.py --config bs64_opt "${boxes[@]}" \
      "${headline[@]}" --Nsamples 640 --Nsamples_val 64 --num_epochs 1 --profile --run_dir "$out/learn-profile" \
      --overwrite "${optimizer[@]}" > "$out/profile.log" 2>&1
    table="$out/learn-profile/profile/summary_rank0.txt"
    if [ -f "$table" ]; then note INFO profile "$(head -1 "$table") ($table)"; else note FAIL profile "no table (profile.log)"; fi
    rm -rf "$out/learn-profile/checkpoints"
  fi
  if [ "$(left $speed_end)" -le 60 ]; then
    note SKIP speed_levers "out of time"
  else
    sweep speed
    status=$?
    case $status in
      0) note PASS speed_levers "$(cat "$out/train.jsonl" | wc -l) record(s) in train.jsonl" ;;
      124 | 137) note INFO speed_levers "stopped at SPEED_S: the finished cases are in train.jsonl" ;;
      *) note FAIL speed_levers "status $status (speed.log)" ;;
    esac
  fi
  pack
fi

# 3. The rest (CHECK_S=0, TUNE_S=0 skip their parts).
check_s=${CHECK_S:-150}
if [ "$check_s" -gt 0 ]; then
  TESTS=0 PIPELINE_DATA=data/bench/gpu_train.h5 PYTHON="$py" timeout --kill-after 10 "$check_s" \
    bash tools/gpu_check.sh "$out/pipeline.jsonl" > "$out/check.log" 2>&1
  status=$?
  note "$([ $status = 0 ] && echo PASS || echo FAIL)" gpu_check "status $status (check.log)"
  pack
fi
tune_s=${TUNE_S:-90}
if [ "$tune_s" -gt 0 ]; then
  # on the speed sweep's synthetic boxes; the budget holds the runs, the tuner's start and writing come on top
  timeout --kill-after 10 $((tune_s + 120)) "$py" -m bench.tune --config bs64_opt --budget_s "$tune_s" \
    --stages micro_batch precision --steps 5 --repeats 1 --out "$out/bs64_opt_tuned.yaml" --overwrite "${boxes[@]}" \
    --Nsamples_val 256 "${optimizer[@]}" > "$out/tune.log" 2>&1
  status=$?
  note "$([ $status = 0 ] && echo PASS || echo FAIL)" tune "status $status (tune.log)"
  pack
fi
exit $failed
