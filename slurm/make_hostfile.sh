#!/bin/bash
# Print a DeepSpeed hostfile for the current Slurm allocation: one line "<host> slots=<ranks>" per node.
#   GPUS_PER_NODE=4 bash slurm/make_hostfile.sh > hostfile      (default: SLURM_GPUS_ON_NODE, else tasks per node)
set -euo pipefail
: "${SLURM_JOB_NODELIST:?not inside a Slurm allocation (SLURM_JOB_NODELIST is not set)}"
slots=${GPUS_PER_NODE:-${SLURM_GPUS_ON_NODE:-${SLURM_NTASKS_PER_NODE:-}}}
if [ -z "$slots" ]; then
  slots=$(( ${SLURM_NTASKS:?cannot tell the ranks per node: set GPUS_PER_NODE} / ${SLURM_JOB_NUM_NODES:-1} ))
fi
[[ $slots =~ ^[1-9][0-9]*$ ]] || { echo "ranks per node must be a positive integer, got '$slots'" >&2; exit 2; }
scontrol show hostnames "$SLURM_JOB_NODELIST" | while read -r host; do echo "$host slots=$slots"; done
