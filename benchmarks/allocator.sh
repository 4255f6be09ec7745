#!/usr/bin/env bash
# glibc's allocator in CPU training: the default against one that keeps freed memory in the
# process (MALLOC_MMAP_MAX_=0: no block gets its own mapping; MALLOC_TRIM_THRESHOLD_: nothing is
# handed back). By default glibc maps every block above its mmap threshold (at most 32 MB) afresh
# and unmaps it on free, so every step page-faults its large activations in again: MobileNetV2 at
# 192 px (batch 16 per process) has several above 32 MB.
#
#   bash benchmarks/allocator.sh [ROUNDS] [OVERRIDES...]    # defaults: 2 rounds, model=mobilenet_v2 data.image_size=192
#
# Each round runs threads, cpu_mp and ddp_gloo with both allocators back to back (minutes apart:
# this machine drifts between sittings), into the experiments allocator-default and
# allocator-no-mmap, then prints benchmarks/allocator_table.py's comparison.
# ddlx's own runs, and the recommender's calibration, use the default allocator.
set -euo pipefail
cd "$(dirname "$0")/.."

rounds=${1:-2}
shift || true
workload=("$@")
if [ ${#workload[@]} -eq 0 ]; then workload=(model=mobilenet_v2 data.image_size=192); fi
common=(data=firesmall data.num_images=400 "data.synthetic_size=[128,192]" data.num_workers=0
        trainer.max_epochs=3 measure.warmup_epochs=1 trainer.enable_checkpointing=false
        trainer.enable_progress_bar=false)

for ((r = 1; r <= rounds; r++)); do
  echo "round $r/$rounds: ${workload[*]}" >&2
  python train.py -m strategy=threads,cpu_mp,ddp_gloo "${workload[@]}" "${common[@]}" logger.experiment_name=allocator-default
  MALLOC_MMAP_MAX_=0 MALLOC_TRIM_THRESHOLD_=68719476736 \
    python train.py -m strategy=threads,cpu_mp,ddp_gloo "${workload[@]}" "${common[@]}" logger.experiment_name=allocator-no-mmap
done

python benchmarks/allocator_table.py
