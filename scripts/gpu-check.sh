#!/usr/bin/env bash
# The GPU check: every CUDA path of extrapolab compiled, compared and timed on this machine in one command
# (scripts/gpu_check.py says what it runs). Needs torch >= 2.11 with CUDA; no setup, no network.
# usage: scripts/gpu-check.sh [OUT_DIR]      (default reports/gpu-check; PYTHON=python3.12 to pick an interpreter)
set -euo pipefail
cd "$(dirname "$0")/.."
exec "${PYTHON:-python3}" scripts/gpu_check.py "$@"
