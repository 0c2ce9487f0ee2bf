#!/usr/bin/env bash
# Wheels for a GPU machine that has PyTorch (CUDA) and NumPy but no internet (many compute nodes): DeepSpeed, built
# here since PyPI has only its source (its CUDA ops, FusedAdam among them, are JIT-built there on first use), and
# every other package the project, DeepSpeed and the tests need (tools/offline_packages.txt), at the versions
# constraints.txt pins. NVIDIA DALI only with WITH_DALI=1 (without it, train with --backend torch), built for the GPU
# machine's CUDA major (torch.version.cuda there: 12 takes nvidia-dali-cuda120, 405 MB; 13 nvidia-dali-cuda130,
# 199 MB; the same DALI release as requirements.txt pins): its small dependencies go to DIR, the wheel to DIR-dali
# with a SHA256 file naming it. REPACK=1 keeps only the PYTHON_VERSION's compiled modules, as a tar.xz of the wheel's
# contents (132 MB for cuda130 and Python 3.12); PART_MIB=N splits what goes to DIR-dali into parts of N MiB, for
# copying through tools that limit a file's size. tools/install_dali_parts.sh (run by tools/gpu_session.sh) joins,
# checks and installs them.
#
#   bash tools/offline_wheels.sh DIR [PYTHON_VERSION] [CUDA_MAJOR]   # the GPU machine's, e.g. 3.12 and 13
#   # there:
#   python3 -m pip install --no-index --no-deps --target SITE DIR/*.whl && export PYTHONPATH=SITE:$PWD
set -euo pipefail
dir=$(realpath -m "${1:?usage: tools/offline_wheels.sh DIR [PYTHON_VERSION] [CUDA_MAJOR]}")  # as the caller gave it
cd "$(dirname "$0")/.."
pyver="${2:-$(python3 -c 'import sys; print(f"{sys.version_info[0]}.{sys.version_info[1]}")')}"
cuda="${3:-12}"
pip="${PIP:-python3 -m pip}"
case "$cuda" in
  12 | 13) ;;
  *) echo "offline_wheels.sh: CUDA_MAJOR is 12 or 13 (torch.version.cuda on the GPU machine), not '$cuda'" >&2; exit 2 ;;
esac
pin() {  # the version constraints.txt or requirements.txt pins for a package
  local found
  found=$(grep -ihE "^$1==" constraints.txt requirements.txt requirements-dev.txt | head -1)
  [ -n "$found" ] || { echo "no pinned version of $1 in constraints.txt or requirements*.txt" >&2; exit 2; }
  echo "$found"
}
mkdir -p "$dir" 2>/dev/null || { echo "offline_wheels.sh: $dir cannot be made a directory (a file, or under one)" >&2; exit 2; }
$pip wheel --quiet --no-deps --wheel-dir "$dir" "$(pin deepspeed)"
packages=()
section=base
while read -r name _; do  # "distribution module" lines; the [dali] section only with WITH_DALI=1
  case "$name" in
    "" | "#"*) ;;
    "[dali]") section=dali ;;
    deepspeed) ;;  # built above
    *) if [ "$section" = base ] || [ "${WITH_DALI:-0}" = 1 ]; then packages+=("$(pin "$name")"); fi ;;
  esac
done < tools/offline_packages.txt
platforms=()
for p in manylinux_2_28 manylinux_2_27 manylinux_2_24 manylinux_2_17 manylinux2014 manylinux1; do
  platforms+=(--platform "${p}_$(uname -m)")
done
fetch() {
  $pip download --quiet --no-deps --only-binary=:all: --implementation cp --python-version "$pyver" \
    "${platforms[@]}" --dest "$1" "${@:2}"
}
fetch "$dir" "${packages[@]}"
ls -1 "$dir"
if [ "${WITH_DALI:-0}" = 1 ]; then
  parts="$dir-dali"
  rm -rf "$parts" && mkdir -p "$parts/whole"
  dali=$(pin nvidia-dali-cuda120)
  fetch "$parts/whole" "nvidia-dali-cuda${cuda}0==${dali#*==}"
  name=$(cd "$parts/whole" && ls -1 ./*.whl | head -1) && name=${name#./}
  if [ "${REPACK:-0}" = 1 ]; then
    repacked="${name%.whl}.cp${pyver/./}.tar.xz"
    python3 -m tools.repack_wheel "$parts/whole/$name" "$pyver" "$parts/whole/$repacked"
    name=$repacked
  fi
  (cd "$parts/whole" && sha256sum "$name") > "$parts/SHA256"
  if [ -n "${PART_MIB:-}" ]; then
    split --bytes="${PART_MIB}M" --numeric-suffixes=0 --suffix-length=2 "$parts/whole/$name" "$parts/$name.part"
  else
    mv "$parts/whole/$name" "$parts/$name.part00"  # one part: the whole file
  fi
  rm -r "$parts/whole"
  echo "DALI in $(compgen -G "$parts/*.part*" | wc -l) part(s) with $parts/SHA256: copy them with $dir to the GPU machine;"
  echo "bash tools/install_dali_parts.sh $parts SITE joins, checks and installs them there (tools/gpu_session.sh does):"
  ls -1 "$parts"
fi
