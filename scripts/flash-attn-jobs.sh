#!/bin/sh
# The flash-attn build's parallelism, sized to this machine's memory: prints `MAX_JOBS=N NVCC_THREADS=T` for
# `sizes=$(sh scripts/flash-attn-jobs.sh) && env $sizes pip wheel ... flash-attn` (k8s/Dockerfile, cluster.yaml).
#
# flash-attn's own numbers (its setup.py, 2.8.3.post2): nvcc runs with `--threads $NVCC_THREADS` (default 4), and "each
# JOB peak memory cost is ~8-9GB when threads = 4"; it sizes MAX_JOBS as free GiB / 9, but only when MAX_JOBS is unset,
# and from psutil's free memory, which inside a container is the host's, not the container's limit (Docker Desktop's VM,
# `docker build --memory`, a Kubernetes pod). So: 9 GiB a job at 4 threads, 2.25 GiB a thread below that (a linear
# estimate: flash-attn states the one figure), the memory available being the smaller of MemAvailable and the cgroup's
# limit less its usage; jobs at most half the CPUs (flash-attn's own cap). One job at 4 threads needs 9 GiB; a machine
# with less gets fewer threads, and under 2.25 GiB this stops with one line rather than an hour into the build.
# M2D_MEMINFO, M2D_CGROUP and M2D_NPROC stand in for /proc/meminfo, /sys/fs/cgroup and nproc (tests/unit/test_cluster_build.py).
set -eu
meminfo=${M2D_MEMINFO:-/proc/meminfo}
cgroup=${M2D_CGROUP:-/sys/fs/cgroup}
cpus=${M2D_NPROC:-$(nproc)}
threads=${NVCC_THREADS:-4}
per_thread_mib=2304 # 9 GiB / 4 threads

avail_mib=$(awk '/^MemAvailable:/ {print int($2 / 1024)}' "$meminfo")
limit="" usage=""
if [ -r "$cgroup/memory.max" ]; then # cgroup v2
  limit=$(cat "$cgroup/memory.max") usage=$(cat "$cgroup/memory.current" 2>/dev/null || echo 0)
elif [ -r "$cgroup/memory/memory.limit_in_bytes" ]; then # cgroup v1 (an unlimited one reads as a huge number)
  limit=$(cat "$cgroup/memory/memory.limit_in_bytes") usage=$(cat "$cgroup/memory/memory.usage_in_bytes" 2>/dev/null || echo 0)
fi
if [ -n "$limit" ] && [ "$limit" != max ]; then
  cg_mib=$(awk -v l="$limit" -v u="$usage" 'BEGIN {printf "%.0f\n", (l - u) / 1048576}')
  [ "$cg_mib" -lt "$avail_mib" ] && avail_mib=$cg_mib
fi

jobs=$((avail_mib / (threads * per_thread_mib)))
if [ "$jobs" -lt 1 ]; then
  jobs=1 threads=$((avail_mib / per_thread_mib))
fi
if [ "$threads" -lt 1 ]; then
  echo "m2d: $avail_mib MiB of memory available; flash-attn's build needs at least $per_thread_mib MiB (9 GiB for one job at nvcc's 4 threads): give the machine (or Docker) more memory" >&2
  exit 1
fi
half=$((cpus / 2))
[ "$half" -lt 1 ] && half=1
[ "$jobs" -gt "$half" ] && jobs=$half
echo "MAX_JOBS=$jobs NVCC_THREADS=$threads"
