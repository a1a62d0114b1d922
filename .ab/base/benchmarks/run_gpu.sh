#!/bin/bash
# Install maskc on the GPU machine (no network there: no deps, no build isolation) and run
# the benchmark given as arguments, e.g.  bash benchmarks/run_gpu.sh benchmarks/bench_attention.py --dim 64
# MASKC_INSTALLED=1 runs on the copy an earlier call installed: for processes in parallel, which
# would otherwise build into the same directories at once.
set -e
if [ "${MASKC_INSTALLED:-0}" != 1 ]; then
  rm -rf /tmp/maskc_site
  python3 -m pip install -q --no-deps --no-build-isolation --target /tmp/maskc_site . >/dev/null
fi
export PYTHONPATH=/tmp/maskc_site${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1 MASKC_CACHE_DIR=${MASKC_CACHE_DIR:-/tmp/maskc_cache}
cd /tmp && python3 "$OLDPWD/$1" "${@:2}"
