#!/bin/bash
# Before/after in one run: install the tree in BASE (a checkout or `git archive` of the commit
# before a change) and this tree side by side on the GPU machine, and run the same benchmark
# from each, one after the other in the same session, each beside FlexAttention. Compare the
# maskc/Flex ratios of the two tables.
#   bash benchmarks/before_after.sh .base benchmarks/bench_attention.py --only 'causal|document'
# ORDER="after before" runs the sides the other way round (the second process runs on a warmer GPU).
set -e
base=$1
shift
rm -rf /tmp/maskc_before /tmp/maskc_after
python3 -m pip install -q --no-deps --no-build-isolation --target /tmp/maskc_before "$base" >/dev/null
python3 -m pip install -q --no-deps --no-build-isolation --target /tmp/maskc_after . >/dev/null
for side in ${ORDER:-before after}; do
  echo "## $side"
  # the benchmark script is this tree's, run against each side's installed maskc where the
  # side has its own copy of the script (a script may use runtime internals that changed)
  script="$1"
  [ "$side" = before ] && script="$base/$1"
  (cd /tmp && PYTHONPATH=/tmp/maskc_$side${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1 \
     MASKC_CACHE_DIR=/tmp/maskc_cache_$side python3 "$OLDPWD/$script" "${@:2}")
done
