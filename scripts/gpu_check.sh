#!/usr/bin/env bash
# GPU check of the embedded engine and the torch trainer (issue 33 item 5), for a machine with an NVIDIA GPU,
# all on the tiny model (built locally, no download):
#   1. bench/engine.py (GRPO case, batch 64) and bench/train_step.py on the GPU;
#   2. the default run end to end on CUDA (engine.device=cuda trainer.device=cuda, two steps).
#
#   scripts/gpu_check.sh [OUT_DIR]
#
# Needs the project installed with a CUDA build of torch (pip install -e '.[test]'). No network is used.
# Prints each part's output and "GPU CHECK PASSED" or "GPU CHECK FAILED"; the exit status says the same
# (2: not run, no GPU).
set -uo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python}
OUT=${1:-$(mktemp -d -t gpu-check-XXXX)}
command -v nvidia-smi >/dev/null || { echo "GPU CHECK NOT RUN: no nvidia-smi (this check needs an NVIDIA GPU)"; exit 2; }
nvidia-smi -L
$PY -c "import torch; assert torch.cuda.is_available(), 'torch has no CUDA'; print('torch', torch.__version__, torch.cuda.get_device_name(0))" \
  || { echo "GPU CHECK NOT RUN: install a CUDA build of torch"; exit 2; }
failed=0
part() { echo "== $1"; shift; "$@" || { echo "-- FAILED: $*"; failed=1; }; }
part "engine bench (tiny, cuda)" $PY bench/engine.py --model tiny --device cuda --case grpo --batch 64
part "train step bench (tiny, cuda)" $PY bench/train_step.py --device cuda --reps 5
part "default run on cuda" $PY -m relax_pipeline engine.device=cuda trainer.device=cuda rollout.num_steps=2 \
  "output_dir=$OUT/default_run"
if [[ $failed == 0 ]]; then echo "GPU CHECK PASSED (outputs in $OUT)"; else echo "GPU CHECK FAILED (outputs in $OUT)"; exit 1; fi
