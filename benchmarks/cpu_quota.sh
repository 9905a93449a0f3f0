#!/usr/bin/env bash
# Run a command on a slice of this machine's CPU time, on AVX2 code paths, in fp32.
#
#   benchmarks/cpu_quota.sh QUOTA_US COMMAND [ARGS...]
#
# The command (and its children) may use QUOTA_US microseconds of CPU time in every 10 ms,
# summed over all cores (cgroup v1 `cpu.cfs_quota_us`, or v2 `cpu.max`; needs root and a
# writable /sys/fs/cgroup). Why: no AVX2-only CPU was available to time the bounds on,
# and a quota that brings the fp32 matmul peak down to such a CPU's is the nearest stand-in.
# It reproduces inference-bound work (an index build) within ~15 %, but overstates a training
# step 2-3x, because OpenMP threads spin between small kernels and the spin is charged to the
# quota (docs/results.md, "The same recipe as DEMO_TRAIN=1 make demo runs it").
set -euo pipefail
usage="usage: $0 QUOTA_US COMMAND [ARGS...]   (CPU time allowed per 10 ms, all cores together)
Everything after QUOTA_US is the command and its own arguments, e.g. the fp32 matmul peak under it:
  $0 6500 .venv/bin/python -c 'import sys, torch; sys.path.insert(0, \"benchmarks\"); import embed_speed as e; print(e.matmul_peak(torch.float32))'"
if [ "${1:-}" = --help ] || [ "${1:-}" = -h ]; then echo "$usage"; exit 0; fi
if [ $# -lt 2 ]; then echo "$usage" >&2; exit 2; fi
quota=$1; shift
if [ -f /sys/fs/cgroup/cgroup.controllers ]; then       # cgroup v2
  group=/sys/fs/cgroup/twotower-quota
  mkdir -p "$group"
  echo "$quota 10000" > "$group/cpu.max"
else                                                     # cgroup v1
  group=/sys/fs/cgroup/cpu/twotower-quota
  mkdir -p "$group"
  echo 10000 > "$group/cpu.cfs_period_us"
  echo "$quota" > "$group/cpu.cfs_quota_us"
fi
echo $$ > "$group/cgroup.procs"
export MKL_ENABLE_INSTRUCTIONS=AVX2 ATEN_CPU_CAPABILITY=avx2 ONEDNN_MAX_CPU_ISA=AVX2 TWOTOWER_BF16=0
exec "$@"
