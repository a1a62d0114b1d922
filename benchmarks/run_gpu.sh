#!/bin/bash
# Install maskc on the GPU machine (no network there: no deps, no build isolation) and run
# the benchmark given as arguments, or with -m first a module from the repository root:
#     bash benchmarks/run_gpu.sh benchmarks/bench_attention.py --dim 64
#     bash benchmarks/run_gpu.sh -m pytest tests/gpu -q          # the GPU test lane
# Either way `import maskc` finds the installed copy in /tmp/maskc_site, not the source tree: a
# script runs from /tmp, a module from the repository root with PYTHONSAFEPATH=1 (Python does not
# put the working directory on sys.path; tests/gpu/conftest.py checks where maskc came from).
# MASKC_INSTALLED=1 runs on the copy an earlier call installed: for processes in parallel, which
# would otherwise build into the same directories at once.
set -e
script=$([ "$1" = -m ] || realpath "$1")  # before the cd below: relative to where the call was made
cd "$(dirname "$0")/.."
if [ "${MASKC_INSTALLED:-0}" != 1 ]; then
  rm -rf /tmp/maskc_site
  python3 -m pip install -q --no-deps --no-build-isolation --target /tmp/maskc_site . >/dev/null
fi
export PYTHONPATH=/tmp/maskc_site${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1 MASKC_CACHE_DIR=${MASKC_CACHE_DIR:-/tmp/maskc_cache}
if [ "$1" = -m ]; then
  PYTHONSAFEPATH=1 exec python3 -m "${@:2}"
fi
cd /tmp && exec python3 "$script" "${@:2}"
