#!/usr/bin/env bash
# Installs the Debian packages tandem builds against, only those that are missing, plus any
# packages named as arguments (what a script needs beyond the build, e.g. run-fuzz.sh's clang).
# Everything comes from Debian 12's archive; nothing is downloaded at build or run time.
#
#   scripts/install-deps.sh [PACKAGE...]
set -euo pipefail
pkgs=(build-essential cmake ninja-build pkg-config
      nlohmann-json3-dev libpcre2-dev libcli11-dev librandom123-dev libgtest-dev libxxhash-dev
      libcpp-httplib-dev "$@")
missing=()
for p in "${pkgs[@]}"; do
  dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
done
if [ ${#missing[@]} -eq 0 ]; then
  echo "install-deps: all packages present"
  exit 0
fi
echo "install-deps: installing ${missing[*]}"
sudo_cmd=""
[ "$(id -u)" -ne 0 ] && sudo_cmd="sudo"
export DEBIAN_FRONTEND=noninteractive
$sudo_cmd apt-get update -qq
$sudo_cmd apt-get install -y -qq --no-install-recommends "${missing[@]}"
