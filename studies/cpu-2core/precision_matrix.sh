#!/usr/bin/env bash
# Every strategy in every trainer.precision, on tiny data (2 steps, AlexNet at 32 px): which train
# and which are refused by name. One line per run: setup | precision | exit code | seconds | last error.
#   bash studies/cpu-2core/precision_matrix.sh [ROOT]
set -uo pipefail
cd "$(dirname "$0")/../.."
root=${1:-/tmp/ddlx-precision-matrix}
tiny=(model=alexnet data.image_size=32 "data.synthetic_size=[40,64]" data.num_images=48 data.batch_size=8 data.num_workers=0
      trainer.max_epochs=1 trainer.limit_train_batches=2 trainer.limit_val_batches=1 trainer.enable_progress_bar=false
      trainer.enable_model_summary=false checkpoint.save=none "paths.data_dir=$root/data")
setups=("strategy=sequential" "strategy=threads" "strategy=cpu_mp" "strategy=ddp_gloo" "strategy=fsdp" "strategy=pipe"
        "strategy=pipe strategy.engine=torch" "strategy=pipe strategy.engine=torch strategy.schedule=1f1b" "strategy=split"
        "strategy=hybrid" "strategy=hybrid strategy.local=pipe strategy.chunks=2")
for setup in "${setups[@]}"; do
  for precision in bf16-mixed 16-mixed 64-true bf16-true 16-true; do
    dir="$root/runs/$(echo "$setup $precision" | tr ' =.' '___')"
    mkdir -p "$dir"
    start=$(date +%s)
    # shellcheck disable=SC2086
    timeout 240 python train.py "paths.root=$dir" "hydra.run.dir=$dir/run" $setup trainer.precision=$precision "${tiny[@]}" > "$dir/out.txt" 2>&1
    rc=$?
    echo "$setup | $precision | rc=$rc | $(( $(date +%s) - start ))s | $(grep -E 'Error|error' "$dir/out.txt" | tail -1 | cut -c1-160)"
  done
done
