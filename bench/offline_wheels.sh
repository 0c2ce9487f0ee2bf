#!/usr/bin/env bash
# Wheels for a GPU machine that has PyTorch (CUDA) and NumPy but no internet (many compute nodes): DeepSpeed, built
# here since PyPI has only its source (its CUDA ops, FusedAdam among them, are JIT-built there on first use), and
# every other package the project, DeepSpeed and the tests need (bench/offline_packages.txt), at the versions
# constraints.txt pins. NVIDIA DALI only with WITH_DALI=1 (without it, train with --backend torch): its small
# dependencies go to DIR, and its 405 MB wheel to DIR-dali with a SHA256 file naming it; PART_MIB=N splits it into
# parts of N MiB, for copying through tools that limit a file's size. bench/gpu_session.sh joins, checks and installs.
#
#   bash bench/offline_wheels.sh DIR [PYTHON_VERSION]   # PYTHON_VERSION: the GPU machine's, e.g. 3.12
#   # there:
#   python3 -m pip install --no-index --no-deps --target SITE DIR/*.whl && export PYTHONPATH=SITE:$PWD
set -euo pipefail
cd "$(dirname "$0")/.."
dir="${1:?usage: bench/offline_wheels.sh DIR [PYTHON_VERSION]}"
pyver="${2:-$(python3 -c 'import sys; print(f"{sys.version_info[0]}.{sys.version_info[1]}")')}"
pip="${PIP:-python3 -m pip}"
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
done < bench/offline_packages.txt
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
  fetch "$parts/whole" "$(pin nvidia-dali-cuda120)"
  wheel=$(cd "$parts/whole" && ls -1 ./*.whl | head -1) && wheel=${wheel#./}
  (cd "$parts/whole" && sha256sum "$wheel") > "$parts/SHA256"
  if [ -n "${PART_MIB:-}" ]; then
    split --bytes="${PART_MIB}M" --numeric-suffixes=0 --suffix-length=2 "$parts/whole/$wheel" "$parts/$wheel.part"
  else
    mv "$parts/whole/$wheel" "$parts/$wheel.part00"  # one part: the whole wheel
  fi
  rm -r "$parts/whole"
  echo "DALI in $(compgen -G "$parts/*.part*" | wc -l) parts with $parts/SHA256: copy them with $dir to the GPU machine;"
  echo "bench/gpu_session.sh joins and checks them there (DALI_PARTS=$parts):"
  ls -1 "$parts"
fi
