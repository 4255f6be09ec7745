#!/usr/bin/env bash
# The torch pipelining and FSDP setups on this 2-core machine, for `recommend.py mode=validate`:
#   bash studies/cpu-2core/pipe_torch_study.sh [ROOT] [all|pipe|fsdp]
#   python recommend.py mode=validate probe=false paths.root=ROOT "experiments=[pipe-torch]"
# Two workloads (AlexNet at 224 px, the paper's split point; VGG11 at 128 px, balanced by
# profiled time), each with the one-core and two-thread baselines, GPipe / 1F1B at 4 and 8
# micro-batches (one stage per core) and fsdp full / grad_op over 2 processes. Runs go to
# ROOT/mlflow.db (default: the project's).
set -euo pipefail
cd "$(dirname "$0")/../.."
root=${1:-$PWD}
part=${2:-all}
common=(data=firesmall data.num_workers=2 trainer.max_epochs=3 measure.warmup_epochs=1 checkpoint.save=none
        optim.lr=0.001 trainer.enable_progress_bar=false logger.experiment_name=pipe-torch "paths.root=$root")
workloads=("model=alexnet data.image_size=224 data.num_images=400"
           "model=vgg11 data.image_size=128 data.num_images=160 strategy.balance=auto")
for workload in "${workloads[@]}"; do
  read -ra w <<< "$workload"
  base=("${w[@]}")
  base=("${base[@]/strategy.balance=auto}")
  if [[ $part != fsdp ]]; then
    for threads in 1 2; do
      python train.py "${common[@]}" ${base[@]} strategy=sequential strategy.threads=$threads
    done
    for schedule in gpipe 1f1b; do
      for chunks in 4 8; do
        python train.py "${common[@]}" "${w[@]}" strategy=pipe strategy.engine=torch strategy.schedule=$schedule strategy.chunks=$chunks
      done
    done
  fi
  if [[ $part != pipe ]]; then
    for sharding in full grad_op; do
      python train.py "${common[@]}" ${base[@]} strategy=fsdp strategy.processes=2 strategy.sharding=$sharding
    done
  fi
done
