#!/usr/bin/env bash
# Installs what the fuzz targets (fuzz/, scripts/run-fuzz.sh) need beyond the normal build:
# Debian 12's clang 14 and its compiler runtimes (libFuzzer, ASan, UBSan). Only missing packages
# are installed; everything comes from Debian's archive.
set -euo pipefail
cd "$(dirname "$0")/.."
./scripts/install-deps.sh
pkgs=(clang-14 libclang-rt-14-dev)
missing=()
for p in "${pkgs[@]}"; do
  dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
done
if [ ${#missing[@]} -eq 0 ]; then
  echo "install-fuzz-deps: all packages present"
  exit 0
fi
echo "install-fuzz-deps: installing ${missing[*]}"
sudo_cmd=""
[ "$(id -u)" -ne 0 ] && sudo_cmd="sudo"
export DEBIAN_FRONTEND=noninteractive
$sudo_cmd apt-get update -qq
$sudo_cmd apt-get install -y -qq --no-install-recommends "${missing[@]}"
