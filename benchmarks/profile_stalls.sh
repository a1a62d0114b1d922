#!/bin/bash
# Nsight Compute stall profiles of the Gluon kernels (see profile_stalls.py), one report each:
#   bash benchmarks/profile_stalls.sh                  # the default cases below
#   CASES="bwd128:no mask" bash benchmarks/profile_stalls.sh
# A case is KIND:WORKLOAD with KIND fwd64, fwd128, bwd64 or bwd128 (the Gluon kernels), or tfw64,
# tfw128 for the Triton-language forward (run with MASKC_GLUON=0). The CSVs land in $OUT
# (or /tmp/stalls) and profile_stalls.py report prints the tables from them.
set -e
out=${OUT:-/tmp/stalls}
reports=/tmp/stalls_reports  # the reports stay on the machine: only the CSVs come back
mkdir -p "$out" "$reports"
rm -rf /tmp/maskc_site
python3 -m pip install -q --no-deps --no-build-isolation --target /tmp/maskc_site . >/dev/null
export PYTHONPATH=/tmp/maskc_site PYTHONUNBUFFERED=1 MASKC_CACHE_DIR=/tmp/maskc_cache
ncu=$(command -v ncu || ls /opt/nvidia/nsight-compute/*/ncu | head -1)
here=$PWD
IFS=';' read -ra cases <<< "${CASES:-bwd128:no mask;bwd128:causal;fwd64:no mask;fwd128:no mask}"
for case in "${cases[@]}"; do
  kind=${case%%:*}; workload=${case#*:}
  dim=${kind:3}
  label="${kind}_${workload// /_}"
  label=${label//[^A-Za-z0-9_.-]/}  # only these characters come back from the GPU machine
  gluon=1
  case "${kind:0:3}" in
    bwd) kernel=attention_bwd_dkdv_hopper; extra=--backward ;;
    tfw) kernel='^attention_fwd$'; extra=; gluon=0 ;;
    *) kernel=attention_fwd_hopper; extra= ;;
  esac
  export MASKC_GLUON=$gluon
  # compile outside the profiler first, so that ncu times no compilation and replays one launch
  (cd /tmp && python3 "$here/benchmarks/profile_stalls.py" run --dim "$dim" --workload "$workload" $extra --steps 1)
  rm -f "$reports/$label.ncu-rep"  # not an earlier run's report, below
  (cd /tmp && "$ncu" --clock-control none -k "regex:$kernel" --launch-skip 1 --launch-count 1 \
      --section SpeedOfLight --section ComputeWorkloadAnalysis --section WarpStateStats --section SchedulerStats \
      --section InstructionStats --section SourceCounters --section LaunchStats --section Occupancy \
      --metrics sm__inst_executed_pipe_xu.avg.pct_of_peak_sustained_active,sm__inst_executed_pipe_fma.avg.pct_of_peak_sustained_active,sm__inst_executed_pipe_alu.avg.pct_of_peak_sustained_active \
      -f -o "$reports/$label" python3 "$here/benchmarks/profile_stalls.py" run --dim "$dim" --workload "$workload" $extra) \
      > "$reports/$label.log" 2>&1 || { tail -20 "$reports/$label.log"; continue; }
  if [ ! -f "$reports/$label.ncu-rep" ]; then
    # no launch of $kernel: maskc chose the Triton-language kernel for this case
    echo "## $label: no $kernel launch to profile (see $reports/$label.log)"
    continue
  fi
  "$ncu" -i "$reports/$label.ncu-rep" --page raw --csv > "$out/$label.raw.csv"
  "$ncu" -i "$reports/$label.ncu-rep" --page source --csv --print-source sass > "$out/$label.source.csv" \
      2>> "$reports/$label.log"
done
python3 "$here/benchmarks/profile_stalls.py" report "$out"
