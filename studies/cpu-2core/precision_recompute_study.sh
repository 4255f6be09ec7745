#!/usr/bin/env bash
# Mixed precision and activation checkpointing on this 2-core machine, for `recommend.py mode=validate`:
#   bash studies/cpu-2core/precision_recompute_study.sh [ROOT]
#   python recommend.py mode=validate probe=false paths.root=ROOT "experiments=[precision-recompute]"
# Two workloads (AlexNet at 224 px; ResNet18 at 128 px, with BatchNorm), each with the one-core
# baseline and DDP over 2 processes in fp32 and bf16-mixed, and DDP, fsdp (full) and the torch
# pipeline (1F1B, 4 micro-batches) recomputing their blocks. Runs go to ROOT/mlflow.db (default:
# the project's).
set -euo pipefail
cd "$(dirname "$0")/../.."
root=${1:-$PWD}
common=(data=firesmall data.num_workers=2 trainer.max_epochs=3 measure.warmup_epochs=1 checkpoint.save=none
        optim.lr=0.001 trainer.enable_progress_bar=false logger.experiment_name=precision-recompute "paths.root=$root")
workloads=("model=alexnet data.image_size=224 data.num_images=400"
           "model=resnet18 data.image_size=128 data.num_images=400")
for workload in "${workloads[@]}"; do
  read -ra w <<< "$workload"
  for precision in 32-true bf16-mixed; do
    python train.py "${common[@]}" "${w[@]}" trainer.precision=$precision strategy=sequential strategy.threads=1
    python train.py "${common[@]}" "${w[@]}" trainer.precision=$precision strategy=ddp_gloo strategy.processes=2
  done
  python train.py "${common[@]}" "${w[@]}" strategy=ddp_gloo strategy.processes=2 strategy.checkpoint=always
  python train.py "${common[@]}" "${w[@]}" strategy=fsdp strategy.processes=2 strategy.checkpoint=always
  python train.py "${common[@]}" "${w[@]}" strategy=pipe strategy.engine=torch strategy.schedule=1f1b strategy.chunks=4 \
    strategy.checkpoint=always
done
