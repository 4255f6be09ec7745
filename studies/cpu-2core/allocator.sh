#!/usr/bin/env bash
# glibc's allocator in CPU training, train.py's cpu_allocator (ddlx/allocator.py): "system"
# (glibc's default, which maps every block above its mmap threshold, at most 32 MB, afresh and
# unmaps it on free, so every step page-faults its large activations in again: MobileNetV2 at
# 192 px, batch 16 per process, has several above 32 MB) against "keep_freed" (no block gets its
# own mapping, nothing is handed back), and against each malloc replacement this machine has
# (those of ddlx/allocator.py: preloaded with LD_PRELOAD, recorded under their names).
#
#   bash studies/cpu-2core/allocator.sh [ROUNDS] [OVERRIDES...]    # defaults: 2 rounds, model=mobilenet_v2 data.image_size=192
#
# Each round runs threads, cpu_mp and ddp_gloo with every allocator back to back (minutes apart:
# this machine drifts between sittings), into the experiment "allocator", then prints
# studies/cpu-2core/allocator_table.py's comparison. Each allocator is a sweep of its own: glibc cannot
# go back to its default within a process.
set -euo pipefail
cd "$(dirname "$0")/../.."

rounds=${1:-2}
shift || true
workload=("$@")
if [ ${#workload[@]} -eq 0 ]; then workload=(model=mobilenet_v2 data.image_size=192); fi
common=(data=firesmall data.num_images=400 "data.synthetic_size=[128,192]" data.num_workers=0
        trainer.max_epochs=3 measure.warmup_epochs=1 checkpoint.save=none
        trainer.enable_progress_bar=false logger.experiment_name=allocator)

declare -A preload=([system]="" [keep_freed]="")
allocators=(system keep_freed)
# NAME:LIBRARY of each replacement ddlx/allocator.py knows, kept if this machine has the library.
mapfile -t replacements < <(python -c 'from ddlx.allocator import REPLACEMENTS
for name, (_, soname, _) in REPLACEMENTS.items(): print(f"{name}:{soname}")')
for replacement in "${replacements[@]}"; do
  if ldconfig -p | grep -q "${replacement#*:}"; then
    allocators+=("${replacement%%:*}")
    preload[${replacement%%:*}]=${replacement#*:}
  fi
done

for ((r = 1; r <= rounds; r++)); do
  echo "round $r/$rounds: ${workload[*]} (${allocators[*]})" >&2
  for allocator in "${allocators[@]}"; do
    LD_PRELOAD=${preload[$allocator]} python train.py -m strategy=threads,cpu_mp,ddp_gloo cpu_allocator=$allocator \
      "${workload[@]}" "${common[@]}"
  done
done

python studies/cpu-2core/allocator_table.py
