#!/usr/bin/env bash
# The main job: set up, build, and train the example CNN on Fashion-MNIST with
# DistributedDataParallel over 2 ranks under lockstep-run. It evaluates on the
# whole test set, split over the ranks, and leaves metrics.jsonl, model.pt,
# model.safetensors, checkpoint.ckpt and curves.png in runs/<run id>/.
# Arguments go to lockstep-train (--help lists them), e.g. --epochs 5 or
# --out DIR.
# LOCKSTEP_TORCH picks the PyTorch it is built against (scripts/config.sh).
set -euo pipefail
cd "$(dirname "$0")/.."
source scripts/config.sh
bash scripts/setup.sh
bash scripts/build.sh
for arg in "$@"; do
  if [ "$arg" = --help ] || [ "$arg" = -h ]; then
    exec "$build_dir/lockstep-train" --help # once, not once per rank
  fi
done
exec "$build_dir/lockstep-run" --nproc-per-node 2 "$build_dir/lockstep-train" --epochs 3 --eval-every 200 "$@"
