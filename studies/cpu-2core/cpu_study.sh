#!/usr/bin/env bash
# The CPU study behind `python recommend.py mode=validate`: every CPU setup that can win on a
# 2-core node, on several workloads, as Hydra sweeps into the `ddlx` experiment.
#
#   bash studies/cpu-2core/cpu_study.sh [ROUNDS] [WORKLOAD-SET] [CPU-ALLOCATOR]   # defaults: 1 round, "new", auto
#
# Sets: "fixture" (the 9 workloads of tests/fixtures/cpu2core_runs.json), "first" (the first study's 5 workloads), "new" (6 more), "check" (4 predicted first),
# "ties" (the 6 whose two fastest setups were within 7% of each other, 2 more repeats each),
# "check2" (2 more predicted first, with the recommender as of 2026-11-22; 4 repeats, as ties),
# "ties2" (the 4 workloads whose fastest setup was 0.7-1.5% ahead of the next in 4 repeats: 4 more),
# "check3" (3 more predicted first, with prefer_sequential_within as of 2026-11-22; 4 repeats),
# "check4" (2 more predicted first, as check3; 3 repeats),
# "check5" (3 more predicted first, with the probe's loading apart and the shared compute factor; 3 repeats),
# "check6" (3 more predicted first, as check5, at sizes above those measured before; 3 repeats),
# "check7" (5 more predicted first: 4 where prefer_sequential_within decides, MobileNetV2 at 192 px; 3 repeats),
# "check8" (5 more predicted first, with each network's own factor; 3 repeats),
# "misses" (six of the workloads the recommender ranked wrong under glibc's default allocator, in
# the sizes where its mmap ceiling is crossed: measured again with cpu_allocator=keep_freed),
# "around_misses" (the same two networks at the sizes around those, two of them misses too),
# "other_networks" (AlexNet, ResNet50, VGG11 and MobileNetV2 where ddp_gloo led: with the above,
# a keep_freed population like the system one),
# "rest" (the 21 workloads of the system study not in the three sets above, so that keep_freed covers
# all of it; the closest calls first, so that a cut-short second round repeats them).
#
# CPU-ALLOCATOR is train.py's cpu_allocator for every run (see ddlx/allocator.py; auto, train.py's
# default, is keep_freed on glibc): the runs of each allocator are a population of their own for the
# report and recommend.py. The sets up to check8 were measured with system, the rest with keep_freed.
#
# Each round runs, for each workload in turn, all its setups back to back (one-core and
# two-thread sequential, threads, cpu_mp, ddp_gloo), so the setups a recommendation must rank
# are measured minutes apart: this machine's speed drifts by up to 25% between sittings, more
# than the gaps between the best setups. Pipe on [cpu, cpu] is left out: it measured 2-3x
# slower than the others on every workload of the first study.
set -euo pipefail
cd "$(dirname "$0")/../.."

rounds=${1:-1}
set_name=${2:-new}
allocator=${3:-auto}
# optim.lr=0.001 (Lerat et al.'s; the sets above were measured with it): at train.py's then-default 0.01
# VGG11 at 64 px went to NaN in one sequential epoch and to a zero loss in the data-parallel ones,
# whose denormal gradients then made epochs 3x slower: the timings measured the dynamics, not the setup.
common=(data=firesmall data.num_images=400 "data.synthetic_size=[128,192]" data.num_workers=0
        trainer.max_epochs=3 measure.warmup_epochs=1 checkpoint.save=none optim.lr=0.001
        trainer.enable_progress_bar=false "cpu_allocator=$allocator")

case $set_name in
  new) workloads=(
      "model=mobilenet_v2 data.image_size=64"
      "model=resnet50 data.image_size=64"
      "model=alexnet data.image_size=96"
      "model=resnet18 data.image_size=96"
      "model=alexnet data.image_size=64 data.batch_size=64"
      "model=resnet18 data.image_size=64 data.batch_size=16") ;;
  fixture) workloads=(  # the 9 of tests/fixtures/cpu2core_runs.json, measured again with cpu_mp's shared weights
      "model=resnet18 data.image_size=64"
      "model=resnet18 data.image_size=96"
      "model=resnet18 data.image_size=128"
      "model=resnet50 data.image_size=96"
      "model=alexnet data.image_size=64"
      "model=alexnet data.image_size=128"
      "model=vgg11 data.image_size=64"
      "model=mobilenet_v2 data.image_size=64"
      "model=mobilenet_v2 data.image_size=128") ;;
  first) workloads=(
      "model=alexnet data.image_size=64"
      "model=alexnet data.image_size=128"
      "model=resnet18 data.image_size=64"
      "model=resnet18 data.image_size=128"
      "model=vgg11 data.image_size=64") ;;
  check) workloads=(  # predicted by recommend.py before they were measured
      "model=vgg16 data.image_size=64"
      "model=mobilenet_v2 data.image_size=96"
      "model=resnet50 data.image_size=96"
      "model=alexnet data.image_size=160") ;;
  check2) workloads=(  # predicted by recommend.py before they were measured: threads, cpu_mp a close call
      "model=mobilenet_v2 data.image_size=128"
      "model=resnet18 data.image_size=160") ;;
  ties) workloads=(  # more repeats where the two fastest setups were within 7% (2-4 runs each)
      "model=mobilenet_v2 data.image_size=64"
      "model=mobilenet_v2 data.image_size=96"
      "model=resnet18 data.image_size=96"
      "model=resnet18 data.image_size=128"
      "model=resnet50 data.image_size=64"
      "model=resnet50 data.image_size=96") ;;
  ties2) workloads=(  # the fastest 0.7-1.5% ahead after 4 repeats, ranges overlapping
      "model=mobilenet_v2 data.image_size=64"
      "model=mobilenet_v2 data.image_size=128"
      "model=resnet18 data.image_size=96"
      "model=resnet50 data.image_size=96") ;;
  check3) workloads=(  # predicted by recommend.py (commit 7e5b368+) before they were measured:
      "model=resnet18 data.image_size=112"      # sequential threads=2 (threads predicted 2.3% faster: preferred)
      "model=resnet50 data.image_size=80"       # sequential threads=2 (threads +0.3%)
      "model=mobilenet_v2 data.image_size=160") # threads (cpu_mp +3.6%, ddp_gloo +4.9%)
      ;;
  check4) workloads=(  # predicted by recommend.py (commit ff22ecd) before they were measured:
      "model=resnet18 data.image_size=80"       # sequential threads=2 (threads +5.0%)
      "model=mobilenet_v2 data.image_size=112") # threads (cpu_mp +4.1%, ddp_gloo +5.2%)
      ;;
  check5) workloads=(  # predicted by recommend.py (commit f3b3ded) before they were measured:
      "model=mobilenet_v2 data.image_size=80"   # cpu_mp (ddp_gloo +2.3%, threads +6.5%, seq2 +11.6%)
      "model=mobilenet_v2 data.image_size=144"  # cpu_mp (ddp_gloo +0.7%, threads +1.9%, seq2 +9.0%)
      "model=resnet18 data.image_size=144")     # sequential threads=2 (cpu_mp predicted 3.2-3.5% faster: preferred;
      ;;                                        #   threads +2.8%; on two probes, one at the band's edge)
  check6) workloads=(  # predicted by recommend.py (commit 4dcd436) before they were measured:
      "model=resnet50 data.image_size=112"      # sequential threads=2 (threads predicted 2.8-3.2% faster: preferred;
                                                #   cpu_mp +1%, ddp_gloo +5%)
      "model=mobilenet_v2 data.image_size=176"  # cpu_mp (ddp_gloo +0.5%, threads +1.5%, seq2 +10%)
      "model=resnet18 data.image_size=176")     # cpu_mp (threads +0.4%, ddp_gloo +2.3%, seq2 +6.2%)
      ;;
  check7) workloads=(  # predicted by recommend.py (commit 51469e6) before they were measured: four near the
      # crossover between sequential threads=2 and the batch-splitting setups, where prefer_sequential_within
      # decides (the recommendation with it, then without it), and MobileNetV2 above the sizes where ddp_gloo led
      "model=resnet18 data.image_size=120"      # seq2 (cpu_mp predicted 1.5% faster: preferred) / cpu_mp (threads +0.2%)
      "model=resnet18 data.image_size=136"      # seq2 (cpu_mp predicted 3.2% faster: preferred) / cpu_mp (threads +0.3%)
      "model=resnet50 data.image_size=104"      # seq2 (threads predicted 1.8% faster: preferred) / threads (cpu_mp +1.1%)
      "model=resnet50 data.image_size=120"      # seq2 (threads predicted 3.1% faster: preferred) / threads (cpu_mp +0.9%)
      "model=mobilenet_v2 data.image_size=192") # cpu_mp (ddp_gloo +0.4%, threads +1.4%, seq2 +9.3%)
      ;;
  check8) workloads=(  # predicted by recommend.py (commit 9871332: each network's own factor) before they were measured
      "model=resnet18 data.image_size=104"      # seq2 (threads within 0.1%, cpu_mp +3.5%, ddp_gloo +12%)
      "model=resnet18 data.image_size=152"      # threads (cpu_mp +3.8%, seq2 +4.1%, ddp_gloo +9.3%)
      "model=resnet50 data.image_size=128"      # threads (seq2 +2.3%, ddp_gloo +4.6%, cpu_mp +5.3%)
      "model=mobilenet_v2 data.image_size=120"  # ddp_gloo (cpu_mp +2.3%, threads +5.0%, seq2 +20%)
      "model=vgg11 data.image_size=96")         # seq2 (threads +21%; VGG11 measured at one size: pooled factors only)
      ;;
  misses) workloads=(  # ranked wrong by `recommend.py mode=validate` with cpu_allocator=system (2026-11-22)
      "model=mobilenet_v2 data.image_size=112"
      "model=mobilenet_v2 data.image_size=128"
      "model=mobilenet_v2 data.image_size=144"
      "model=resnet18 data.image_size=104"
      "model=resnet18 data.image_size=120"
      "model=resnet18 data.image_size=144") ;;
  around_misses) workloads=(
      "model=mobilenet_v2 data.image_size=80"
      "model=mobilenet_v2 data.image_size=96"
      "model=mobilenet_v2 data.image_size=160"
      "model=resnet18 data.image_size=96"
      "model=resnet18 data.image_size=112"
      "model=resnet18 data.image_size=128") ;;
  other_networks) workloads=(
      "model=alexnet data.image_size=128"
      "model=resnet50 data.image_size=64"
      "model=resnet50 data.image_size=112"
      "model=vgg11 data.image_size=64"
      "model=mobilenet_v2 data.image_size=192") ;;
  rest) workloads=(
      "model=resnet18 data.image_size=136"
      "model=resnet18 data.image_size=152"
      "model=resnet18 data.image_size=160"
      "model=resnet18 data.image_size=176"
      "model=resnet50 data.image_size=80"
      "model=resnet50 data.image_size=96"
      "model=resnet50 data.image_size=104"
      "model=resnet50 data.image_size=120"
      "model=resnet50 data.image_size=128"
      "model=mobilenet_v2 data.image_size=120"
      "model=mobilenet_v2 data.image_size=176"
      "model=mobilenet_v2 data.image_size=64"
      "model=resnet18 data.image_size=80"
      "model=resnet18 data.image_size=64"
      "model=resnet18 data.image_size=64 data.batch_size=16"
      "model=alexnet data.image_size=64"
      "model=alexnet data.image_size=64 data.batch_size=64"
      "model=alexnet data.image_size=96"
      "model=alexnet data.image_size=160"
      "model=vgg11 data.image_size=96"
      "model=vgg16 data.image_size=64") ;;
  *) echo "unknown workload set '$set_name': expected fixture, new, first, check, check2, ties, ties2, check3 to check8, misses, around_misses, other_networks, rest" >&2; exit 2 ;;
esac

for ((r = 1; r <= rounds; r++)); do
  for w in "${workloads[@]}"; do
    echo "round $r/$rounds: $w" >&2
    # shellcheck disable=SC2086  # $w holds several overrides
    python train.py -m strategy=sequential strategy.threads=1,2 $w "${common[@]}"
    python train.py -m strategy=threads,cpu_mp,ddp_gloo $w "${common[@]}"
  done
done
