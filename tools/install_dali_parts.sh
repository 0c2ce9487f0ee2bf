#!/usr/bin/env bash
# NVIDIA DALI into SITE from the parts that tools/offline_wheels.sh wrote: its wheel, or with REPACK=1 the wheel's
# contents for one Python version as a tar.xz, split into parts and named with their checksum in PARTS/SHA256.
# The parts are joined, checked and installed; where some are missing or the checksum differs, one line says so
# and the status is 1 (nothing is installed).
#
#   bash tools/install_dali_parts.sh PARTS SITE      # PYTHON=... the interpreter whose pip installs a wheel
set -uo pipefail
parts="${1:?usage: tools/install_dali_parts.sh PARTS SITE}"
site="${2:?usage: tools/install_dali_parts.sh PARTS SITE}"
py="${PYTHON:-python3}"
if [ ! -f "$parts/SHA256" ]; then
  echo "no DALI parts in $parts (no SHA256 file): DALI skipped"
  exit 1
fi
name=$(awk '{print $2}' "$parts/SHA256")
joined=$(mktemp -d)
trap 'rm -rf "$joined"' EXIT
cat "$parts/$name".part* > "$joined/$name" 2>/dev/null
if ! (cd "$joined" && sha256sum --quiet --status -c -) < "$parts/SHA256"; then
  echo "DALI's parts in $parts are incomplete or damaged ($(compgen -G "$parts/$name.part*" | wc -l) part(s) of $name): DALI skipped"
  exit 1
fi
mkdir -p "$site"
case "$name" in
  *.whl) "$py" -m pip install --quiet --no-index --no-deps --target "$site" "$joined/$name" ;;
  *.tar.xz) tar -xJf "$joined/$name" -C "$site" ;;
  *) echo "DALI's parts in $parts hold $name, neither a wheel nor a .tar.xz: DALI skipped"; exit 1 ;;
esac || { echo "DALI from $parts did not install into $site: DALI skipped"; exit 1; }
echo "DALI installed into $site from $name"
