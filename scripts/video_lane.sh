#!/usr/bin/env bash
# The video-row tests (pytest -m video) in their own venv: transformers' video processors need torchvision, whose
# wheel must match torch (the CPU-runnable pair here: torch==2.14.1 torchvision==0.29.1, a CUDA build that runs on
# the CPU), and decoding needs PyAV (the video extra). Builds .venv-video once (about 2 min, 5.5 GB), then runs
# the tests marked video. .ci/run runs it after the vLLM lane. Where torchvision cannot be installed (no
# registry, another platform) the lane skips, saying why; once it is there, a failing test fails the lane.
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=${VIDEO_VENV:-.venv-video}
if [ ! -x "$VENV/bin/python" ] || ! "$VENV/bin/python" -c "import torchvision, av, dspark_precompute" 2>/dev/null; then
  rm -rf "$VENV"
  if ! { python3 -m venv "$VENV" && "$VENV/bin/pip" install -q torch==2.14.1 torchvision==0.29.1; }; then
    rm -rf "$VENV"
    echo "video lane skipped: torch==2.14.1 torchvision==0.29.1 could not be installed into $VENV (see pip's message above)"
    exit 0
  fi
  if ! "$VENV/bin/python" -c "import torchvision.ops" 2>/dev/null; then
    rm -rf "$VENV"
    echo "video lane skipped: torchvision 0.29.1 does not import with torch 2.14.1 on this machine"
    exit 0
  fi
  "$VENV/bin/pip" install -q -e ".[test,video]"
fi
"$VENV/bin/python" -m pytest -q -m video "$@"
