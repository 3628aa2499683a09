#!/usr/bin/env bash
# Fault injection on a tiny run: SIGTERM, SIGKILL mid-save, a corrupt checkpoint
# and a full disk, each followed by a resume; prints fault / recovered / steps lost.
set -euo pipefail
cd "$(dirname "$0")/.."
exec python3 -m lab.chaos "$@"
