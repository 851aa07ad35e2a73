#!/usr/bin/env bash
# Issue #19's GPU measurement, as one command on a machine with CUDA devices and a
# python3 that holds torch and transformers (docs/speed.md, "On a GPU"):
#
#     bash bench/gpu_check.sh [gpu_throughput.py flags]
#
# Installs the wheels carried in .whl/ (the packages meshtrain's bench needs beyond
# such an image: datasets, dill, multiprocess) into /tmp/site, runs meshtrain from src/
# without installing it, and tees the bench's output to $OUT/gpu_throughput.txt.
set -euo pipefail
cd "$(dirname "$0")/.."
if compgen -G ".whl/*.whl" >/dev/null; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
        --target /tmp/site .whl/*.whl
    export PYTHONPATH=/tmp/site
fi
export PYTHONPATH="$PWD/src${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
export HF_HUB_OFFLINE=1 HF_DATASETS_OFFLINE=1 TOKENIZERS_PARALLELISM=false
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv || true
python3 -c "import torch, transformers; print('torch', torch.__version__, \
'transformers', transformers.__version__, 'cuda', torch.cuda.is_available())"
python3 bench/gpu_throughput.py "$@" 2>&1 | tee "${OUT:-/tmp}/gpu_throughput.txt"
