#!/usr/bin/env bash
# GPU check for kernels/: the kernel tests on cuda, then decode and prefill timings per backend
# against a device-to-device copy and a bf16 matrix product measured in the same run.
# Uses only the machine's own torch and triton (nothing is installed); about 2-4 minutes on an
# H100/H200. Run from anywhere: `bash bench/gpu_check.sh`; paste its output into bench/RESULTS.md.
set -euo pipefail
cd "$(dirname "$0")/.."
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
unset TRITON_INTERPRET  # the real compiler, not the CPU interpreter
PY=${PYTHON:-python3}
status=0  # NOTE: a failing step does not stop the rest: a GPU session is rare, get every number

echo "== gpu_check $(date -u +%Y-%m-%dT%H:%M:%SZ)"
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader || true
"$PY" -c "import torch, triton; print('torch', torch.__version__, '| triton', triton.__version__, \
'| cuda', torch.version.cuda, '|', torch.cuda.get_device_name())"

echo "== kernel tests on cuda: every backend against float64 (tests/kernels/kernel_cases.py)"
timeout 240 "$PY" tests/kernels/kernel_cases.py --device cuda --backends torch,triton,flash_attn \
  || status=$?

echo "== timings (goals: decode >= 80% of copy bandwidth at batch 64, ctx 4096;"
echo "   prefill >= 50% of the bf16 matmul rate at 8k tokens)"
timeout 240 "$PY" -m bench.attention --device cuda --backends torch,triton,flash_attn || status=$?
echo "== gpu_check done (status $status)"
exit "$status"
