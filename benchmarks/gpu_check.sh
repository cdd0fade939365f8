#!/usr/bin/env bash
# posttrain's GPU check, for a machine with one NVIDIA GPU and no network (under 8 minutes on an H100):
#   1. the suite's device-independent trainer tests (`-m device_independent`) on CUDA in bf16;
#   2. the generic sampler against `model.generate`, token for token (benchmarks/gpu_check.py sampler);
#   3. SFT, DPO and GRPO throughput and peak GPU memory against TRL 1.16, each run in its own process, on a model
#      of Qwen2.5-0.5B's shape with random weights (benchmarks/gpu_check.py bench; table in $OUT/table.md).
#
#   bash benchmarks/gpu_check.sh                       # on the GPU machine
#   TRL_PYTHON=/path/to/trl-env/bin/python bash benchmarks/gpu_check.sh   # TRL's environment (default .bench-venv-trl)
#   bash benchmarks/gpu_check.sh --small               # any machine: tiny model, 2 steps, on the CPU (proves the code)
#
# Needs, beyond torch (a CUDA build) and transformers: `python benchmarks/gpu_check.py wheels` lists them.
set -uo pipefail
cd "$(dirname "$0")/.."
PYTHON="${PYTHON:-python}"
OUT="${OUT:-gpu_check_out}"
SMALL=""
DEVICE="cuda"
BF16="--bf16"
# --small: on the CPU in float32 (GRPO in bf16 autocast fails on the CPU: the lean decoder takes float32 only)
if [[ "${1:-}" == "--small" ]]; then SMALL="--small"; DEVICE="cpu"; BF16=""; fi
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 HF_DATASETS_OFFLINE=1 PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
mkdir -p "$OUT"
status=0
start=$SECONDS

echo "== wheels needed beyond torch and transformers"
"$PYTHON" benchmarks/gpu_check.py wheels

echo "== 1. device-independent trainer tests on $DEVICE ${BF16:+in bf16}"
TESTS=(tests/trainers)
[[ -n "$SMALL" ]] && TESTS=(tests/trainers/test_sft.py tests/trainers/test_grpo.py)  # a sample of them, for speed
"$PYTHON" -m pytest -q -p no:cacheprovider -m device_independent --device "$DEVICE" $BF16 "${TESTS[@]}" \
    2>&1 | tee "$OUT/tests.log" | tail -n 15
[[ ${PIPESTATUS[0]} -eq 0 ]] || status=1

echo "== 2. generic sampler against model.generate"
"$PYTHON" benchmarks/gpu_check.py sampler $SMALL --device "$DEVICE" 2>&1 | tee "$OUT/sampler.log"
[[ ${PIPESTATUS[0]} -eq 0 ]] || status=1

echo "== 3. SFT, DPO, GRPO against TRL 1.16"
"$PYTHON" benchmarks/gpu_check.py bench $SMALL --device "$DEVICE" --out "$OUT" 2>&1 | tee "$OUT/bench.log"
[[ ${PIPESTATUS[0]} -eq 0 ]] || status=1

echo "== done in $((SECONDS - start)) s, status $status; figures in $OUT/table.md"
exit $status
