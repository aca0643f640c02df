#!/usr/bin/env bash
# Runs the GPU-marked tests in parallel pytest processes on one GPU machine: the suite is bound by Triton's
# kernel compiles (one core each), so shards finish it several times faster than one process.
#
#   bash tests/gpu_shards.sh [SHARDS] [PYTEST ARGS...]     e.g.  bash tests/gpu_shards.sh 6 -k prefill
#
# The arguments select tests as pytest's do (-k, files, node ids); without a file or folder, all of tests/.
# SHARDS defaults to 4; the collected test ids are dealt out round-robin, each shard gets an equal share of
# the CPU threads (OMP_NUM_THREADS) and writes its log to $GPU_SHARD_LOGS (default /tmp/gpu_shards).
# The shards share the GPU's memory: expandable segments (unless PYTORCH_CUDA_ALLOC_CONF is set) and the
# conftest's empty_cache after each GPU test keep one shard's freed blocks from starving another; 8 shards
# fit an 80 GB H100.
# Prints each shard's summary line and its failed tests; the exit status is nonzero if any shard failed or none collected.
set -u
shards=4
if [[ "${1:-}" =~ ^[0-9]+$ ]]; then
    shards=$1
    shift
fi
if [ "$shards" -lt 1 ]; then
    echo "SHARDS must be at least 1, got $shards" >&2
    exit 2
fi
logs=${GPU_SHARD_LOGS:-/tmp/gpu_shards}
mkdir -p "$logs"
rm -f "$logs"/shard_* "$logs"/ids
paths=(tests)  # unless the arguments name test files or folders
for arg in "$@"; do
    if [ -e "${arg%%::*}" ]; then paths=(); fi
done
python -m pytest --collect-only -q -m gpu -p no:cacheprovider "$@" "${paths[@]}" 2>/dev/null | grep "::" \
    > "$logs/ids"
total=$(wc -l < "$logs/ids")
if [ "$total" -eq 0 ]; then
    echo "no GPU tests collected (pytest -m gpu $*)" >&2
    exit 2
fi
[ "$shards" -le "$total" ] || shards=$total  # no empty shard (pytest without ids would run everything)
split -n "r/$shards" -d "$logs/ids" "$logs/shard_ids_"
threads=$(( $(nproc) / shards ))
[ "$threads" -ge 1 ] || threads=1
echo "$total GPU tests in $shards shards, $threads CPU threads each, logs in $logs"
status=0
pids=()
for ids in "$logs"/shard_ids_*; do
    n=${ids##*_}
    mapfile -t test_ids < "$ids"  # one argument per test id, unexpanded (ids hold [...])
    OMP_NUM_THREADS=$threads PYTORCH_CUDA_ALLOC_CONF=${PYTORCH_CUDA_ALLOC_CONF:-expandable_segments:True} \
        python -m pytest -q -m gpu -p no:cacheprovider --durations=3 \
        "${test_ids[@]}" > "$logs/shard_$n.log" 2>&1 &
    pids+=($!)
done
for pid in "${pids[@]}"; do
    wait "$pid" || status=1
done
for log in "$logs"/shard_*.log; do
    echo "$(basename "$log"): $(tail -n 1 "$log")"
    grep -E "^(FAILED|ERROR) " "$log" | sed 's/^/    /'
done
exit $status
