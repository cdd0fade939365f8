#!/usr/bin/env bash
# Set up the environment in which benchmarks/vs_trl.py runs Hugging Face TRL, the peer posttrain is
# measured against. TRL is installed only here, never in the main .venv: posttrain does not import it.
#
#   bash benchmarks/setup_trl_env.sh            # creates .bench-venv-trl/ at the repository root
#   TRL_VERSION=1.12.0 bash benchmarks/setup_trl_env.sh
#
# transformers, datasets and accelerate are pinned to the versions the main .venv has, so that both
# sides run the same modelling code; only the trainer on top differs.
set -euo pipefail
cd "$(dirname "$0")/.."
TRL_VERSION="${TRL_VERSION:-1.16.0}"
VENV="${BENCH_TRL_VENV:-.bench-venv-trl}"
export PIP_DISABLE_PIP_VERSION_CHECK=1 PIP_PROGRESS_BAR=off

version_in_main() {  # the version of package $1 in the main .venv, so both sides run the same code
    .venv/bin/python -c "import importlib.metadata as m; print(m.version('$1'))"
}
TRANSFORMERS="$(version_in_main transformers)"
DATASETS="$(version_in_main datasets)"
ACCELERATE="$(version_in_main accelerate)"

python3 -m venv "$VENV"
# torch first: the pinned version resolves to the CPU build; a bare `torch` requirement could pull CUDA wheels
"$VENV/bin/pip" install -q torch==2.13.0
# pillow: the vision-language workload (vlm_sft) hands both sides PIL images, and TRL's VLM path needs it
PILLOW="$(version_in_main pillow)"
"$VENV/bin/pip" install -q "trl==$TRL_VERSION" "transformers==$TRANSFORMERS" "datasets==$DATASETS" \
    "accelerate==$ACCELERATE" "pillow==$PILLOW"
"$VENV/bin/python" -c "import trl, transformers, torch; print('trl', trl.__version__, '| transformers', \
transformers.__version__, '| torch', torch.__version__)"
