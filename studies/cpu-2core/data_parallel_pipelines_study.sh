#!/usr/bin/env bash
# Data-parallel PyTorch pipelines and HSDP on this 2-core machine, for `recommend.py mode=validate`:
#   bash studies/cpu-2core/data_parallel_pipelines_study.sh [ROOT]
#   python recommend.py mode=validate probe=false paths.root=ROOT "experiments=[dp-pipelines]"
# Two workloads (AlexNet at 224 px; ResNet18 at 128 px, with BatchNorm), each with the one-core
# and two-core baselines, DDP and fsdp over 2 processes, one 1F1B pipeline of 2 processes, and
# the two setups of 4 processes that this machine oversubscribes: 2 pipelines of 2 stages
# (hybrid, 1F1B) and HSDP in 2 groups of 2. Runs go to ROOT/mlflow.db (default: the project's).
set -euo pipefail
cd "$(dirname "$0")/../.."
root=${1:-$PWD}
common=(data=firesmall data.num_workers=2 trainer.max_epochs=3 measure.warmup_epochs=1 checkpoint.save=none
        optim.lr=0.001 trainer.enable_progress_bar=false logger.experiment_name=dp-pipelines "paths.root=$root")
workloads=("model=alexnet data.image_size=224 data.num_images=400"
           "model=resnet18 data.image_size=128 data.num_images=400")
for workload in "${workloads[@]}"; do
  read -ra w <<< "$workload"
  python train.py "${common[@]}" "${w[@]}" strategy=sequential strategy.threads=1
  python train.py "${common[@]}" "${w[@]}" strategy=sequential strategy.threads=2
  python train.py "${common[@]}" "${w[@]}" strategy=ddp_gloo strategy.processes=2
  python train.py "${common[@]}" "${w[@]}" strategy=fsdp strategy.processes=2
  python train.py "${common[@]}" "${w[@]}" strategy=pipe strategy.engine=torch strategy.schedule=1f1b strategy.chunks=4
  python train.py "${common[@]}" "${w[@]}" strategy=hybrid strategy.processes=2 strategy.local=pipe strategy.engine=torch \
    strategy.schedule=1f1b strategy.chunks=4
  python train.py "${common[@]}" "${w[@]}" strategy=fsdp strategy.processes=4 strategy.sharding=hybrid strategy.shard_size=2
done
