#!/usr/bin/env bash
# One GPU node: measure it (bf16 GEMMs, HBM, nccl collectives over its GPUs) into a hardware
# preset, then run the fidelity layout set on it (estimated against measured step time,
# peak memory -- torch.cuda.max_memory_allocated -- and bubble). Needs >= 2 GPUs and a CUDA
# build of torch. Not yet run on a GPU by the project (no device was lent so far).
#   bash benchmarks/gpu_node.sh [name]
set -euo pipefail
cd "$(dirname "$0")/.."
name="${1:-gpu_node}"
gpus="$(python -c 'import torch; print(torch.cuda.device_count())')"
python -m xpar calibrate hardware=local --device cuda --workers "$gpus" --name "$name"
python benchmarks/fidelity.py --hardware "calibrated_$name" --models tiny small --steps 10
