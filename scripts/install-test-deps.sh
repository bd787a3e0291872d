#!/usr/bin/env bash
# Installs what the end-to-end server tests need beyond the build: Node.js (Debian's, when the
# machine has none) and the official OpenAI client, pinned by tests/server/package-lock.json.
set -euo pipefail
cd "$(dirname "$0")/.."
if ! command -v node >/dev/null || ! command -v npm >/dev/null; then
  echo "install-test-deps: installing nodejs npm"
  sudo_cmd=""
  [ "$(id -u)" -ne 0 ] && sudo_cmd="sudo"
  export DEBIAN_FRONTEND=noninteractive
  $sudo_cmd apt-get update -qq
  $sudo_cmd apt-get install -y -qq --no-install-recommends nodejs npm
fi
(cd tests/server && npm ci --no-audit --no-fund --loglevel=error)
