#!/usr/bin/env bash
# cpu_mp on one shared copy of the weights against the one-core and two-thread baselines, on
# this 2-core machine (the figures in docs/strategies.md, "cpu_mp measured"):
#   bash studies/cpu-2core/cpu_mp_study.sh [epochs|steps|ram|all]
# epochs: train.py epochs with the dataset's default loader (2 workers, data.cache=auto), AlexNet
#         (400 images) and VGG11 (120) at 224 px, ResNet18 and MobileNetV2 at 128 px, 2-3 interleaved rounds
#         (for recommend.py mode=validate "experiments=[benchmark-strategies]");
# steps:  where a step's time goes (compute, exchange, reduce, step, waiting) for the design before
#         and after, and 2 ranks that exchange nothing (the machine's ceiling), on in-memory batches;
# ram:    peak RAM of AlexNet sequential and cpu_mp, each process's share by kind of mapping.
# Runs go to the project's mlflow.db (experiment benchmark-strategies); run nothing else meanwhile.
set -euo pipefail
cd "$(dirname "$0")/../.."
part=${1:-all}
setups=("sequential threads=1" "sequential threads=2" "cpu_mp processes=2" "cpu_mp processes=2 split_linear=never")
if [[ $part == epochs || $part == all ]]; then
  python benchmarks/strategies_cpu.py --only "${setups[@]}" --epochs 3 --rounds 3
  python benchmarks/strategies_cpu.py --model vgg11 --num-images 120 --only "${setups[@]}" --epochs 3 --rounds 2 \
    --set optim.lr=0.001  # at 0.01 VGG11 can reach denormal gradients that slow it (cpu_study.sh)
  for model in resnet18 mobilenet_v2; do  # their split layer is the small head: split_linear=never left out
    python benchmarks/strategies_cpu.py --model $model --image-size 128 --only "${setups[@]:0:3}" --epochs 3 --rounds 2
  done
fi
if [[ $part == steps || $part == all ]]; then
  python benchmarks/cpu_mp_step.py --models alexnet resnet18 mobilenet_v2 --steps 8 --rounds 2
  python benchmarks/cpu_mp_step.py --models vgg11 --steps 6 --rounds 2
fi
if [[ $part == ram || $part == all ]]; then
  for strategy in sequential cpu_mp; do
    python studies/cpu-2core/ram_by_mapping.py python train.py model=alexnet data.num_images=400 \
      trainer.max_epochs=1 trainer.limit_val_batches=0 checkpoint.save=none strategy=$strategy
  done
fi
