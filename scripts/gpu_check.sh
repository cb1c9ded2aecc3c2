#!/usr/bin/env bash
# GPU check (issue 43 item 7), for a machine with an NVIDIA GPU; every part runs what the machine can run without
# downloads, on the tiny model (built locally), and every part can fail:
#   1. the embedded engine and the torch trainer on CUDA (scripts/gpu_check_cuda.py: tokens and logprobs against the
#      CPU engine, a training step that moves the weights);
#   2. bench/engine.py (GRPO case, batch 64) and bench/train_step.py on the GPU (each exits non-zero on a failure);
#   3. the default run end to end on CUDA (engine.device=cuda trainer.device=cuda, two steps): it must exit 0 and
#      leave its metrics file with train/weight_version 2;
#   4. where `sglang` is installed, every SGLang check (scripts/gpu_check_sglang.sh: a real server launched by the
#      engine, token-exact dump, weight updates by disk, tensor and distributed, sessions with
#      --enable-session-radix-cache, the cache after a paused update); without it, said and counted as not run.
#
#   scripts/gpu_check.sh [OUT_DIR] [MODEL_FOLDER_FOR_SGLANG]
#
# Needs the project installed with a CUDA build of torch (pip install -e '.[test]'). No network is used.
# Prints each part's output and "GPU CHECK PASSED" or "GPU CHECK FAILED"; the exit status says the same
# (2: not run, no GPU).
set -uo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python}
OUT=${1:-$(mktemp -d -t gpu-check-XXXX)}
mkdir -p "$OUT"
command -v nvidia-smi >/dev/null || { echo "GPU CHECK NOT RUN: no nvidia-smi (this check needs an NVIDIA GPU)"; exit 2; }
nvidia-smi -L
$PY -c "import torch; assert torch.cuda.is_available(), 'torch has no CUDA'; print('torch', torch.__version__, torch.cuda.get_device_name(0))" \
  || { echo "GPU CHECK NOT RUN: install a CUDA build of torch"; exit 2; }
failed=0
part() { echo "== $1"; shift; "$@" || { echo "-- FAILED: $*"; failed=1; }; }
part "embedded engine and torch trainer on cuda (tiny)" $PY scripts/gpu_check_cuda.py "$OUT/models"
part "engine bench (tiny, cuda)" $PY bench/engine.py --model tiny --device cuda --case grpo --batch 64
part "train step bench (tiny, cuda)" $PY bench/train_step.py --device cuda --reps 5
default_run() {
  $PY -m relax_pipeline engine.device=cuda trainer.device=cuda rollout.num_steps=2 "output_dir=$OUT/default_run" \
    && $PY - "$OUT/default_run" <<'PYEOF'
import sys
from pathlib import Path
from relax_pipeline.tracking.metrics_file import METRICS_FILE, read_metrics_file
lines = read_metrics_file(Path(sys.argv[1]) / METRICS_FILE)
version = max((m.get("train/weight_version", 0) for _, m in lines), default=0)
print(f"default run: {len(lines)} metric lines, train/weight_version {version}")
sys.exit(0 if version == 2 else 1)
PYEOF
}
part "default run on cuda" default_run
if $PY -c "import sglang" 2>/dev/null; then
  part "sglang checks" scripts/gpu_check_sglang.sh "$OUT/sglang" ${2:+"$2"}
else
  echo "== sglang checks: NOT RUN (sglang is not installed: pip install -e '.[sglang]')"
fi
if [[ $failed == 0 ]]; then echo "GPU CHECK PASSED (outputs in $OUT)"; else echo "GPU CHECK FAILED (outputs in $OUT)"; exit 1; fi
