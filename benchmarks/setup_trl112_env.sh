#!/usr/bin/env bash
# Set up the environment in which benchmarks/vs_trl.py runs TRL's PPO and BCO trainers, the `ppo` and `bco`
# workloads. TRL 1.16 no longer ships them; TRL 1.12.0 has them as trl.experimental.ppo.PPOTrainer and
# trl.experimental.bco.BCOTrainer. TRL is installed only here, never in the main .venv.
#
#   bash benchmarks/setup_trl112_env.sh          # creates .bench-venv-trl112/ at the repository root
#
# It is setup_trl_env.sh with TRL 1.12.0 (torch 2.13.0's CPU build first; transformers, datasets and
# accelerate pinned to the main .venv's versions, which satisfy TRL 1.12's transformers>=4.56.2), plus what
# TRL's `bco` extra adds: scikit-learn and joblib, for BCO's optional embedding classifier (UDM).
set -euo pipefail
cd "$(dirname "$0")/.."
VENV="${BENCH_TRL112_VENV:-.bench-venv-trl112}"
TRL_VERSION=1.12.0 BENCH_TRL_VENV="$VENV" bash benchmarks/setup_trl_env.sh
PIP_DISABLE_PIP_VERSION_CHECK=1 "$VENV/bin/pip" install -q scikit-learn joblib
"$VENV/bin/python" -c "from trl.experimental.ppo import PPOConfig, PPOTrainer; \
from trl.experimental.bco import BCOConfig, BCOTrainer; import sklearn; print('PPOTrainer and BCOTrainer import')"
