#!/usr/bin/env bash
# The GPU benchmark as one command (scripts/gpu_bench.py does the work; see its docstring).
#
#   bash scripts/gpu_bench.sh prepare      # here, with network to the package index: wheels, tokenizer
#                                          # and data into .gpu/ (git-ignored, about 25 MB)
#   bash scripts/gpu_bench.sh run [ARGS]   # on the GPU machine, with .gpu carried: installs the wheels
#                                          # into /tmp/site and writes $OUT/gpu_bench.json (< 8 minutes)
#   bash scripts/gpu_bench.sh cpu-smoke    # here: the same script on a tiny shape on the CPU (~1 minute)
#   bash scripts/gpu_bench.sh sharded [MODEL_ARGS]   # on the GPU machine: tokens/s per GPU of one copy per GPU
#                                          # against parallel.fsdp=2/4/8 (as many as there are GPUs), NCCL for the
#                                          # weights, gloo for the flags; $OUT/gpu_bench_sharded.json
#                                          # (default target: the tiny random one at hidden 1024; pass e.g.
#                                          # model=hf model.path=/models/Qwen3-8B for a real one)
#
# The GPU image has torch, transformers and tokenizers but not zarr, numcodecs, hydra-core, omegaconf
# or antlr4; transformers travels too, since the image's is older than pyproject.toml allows.
set -euo pipefail
cd "$(dirname "$0")/.."
GPU=.gpu
SHARED=${DSPARK_SHARED:-../shared}
PY=${PYTHON:-python3}

case "${1:-run}" in
prepare)
  rm -rf "$GPU/whl" && mkdir -p "$GPU/whl" "$GPU/data" "$GPU/tokenizer"
  plat="--platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64"
  $PY -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp $plat -d "$GPU/whl" \
    zarr==3.1.6 numcodecs==0.16.6 google-crc32c==1.9.0 donfig==0.8.1.post1 hydra-core==1.3.8 omegaconf==2.3.1 \
    transformers==5.24.0 accelerate==1.15.0
  # antlr4-python3-runtime 4.9.3 (what omegaconf pins) is published as a source archive only: build its pure wheel
  $PY -m pip wheel -q --no-deps -w "$GPU/whl" antlr4-python3-runtime==4.9.3
  cp "$SHARED/data/chat/mix.messages.jsonl" "$GPU/data/"
  cp "$SHARED/data/tokenizers/qwen3/"*.json "$SHARED/data/tokenizers/qwen3/merges.txt" "$GPU/tokenizer/"
  du -sh "$GPU"
  ;;
run)
  shift || true
  $PY -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site "$GPU"/whl/*.whl
  export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1
  nvidia-smi --query-gpu=name,memory.total,clocks.sm --format=csv || true
  # the CUDA-only paths first (pinned buffers, async copies): a failure is reported, the bench still runs
  $PY -m pytest -q -p no:cacheprovider -m gpu tests/write/store/test_transfer.py 2>&1 | tee "${OUT:-.}/gpu_tests.log" || true
  $PY scripts/gpu_bench.py --data "$GPU/data/mix.messages.jsonl" --tokenizer "$GPU/tokenizer" \
    --out "${OUT:-.}/gpu_bench.json" "$@" 2>&1 | tee "${OUT:-.}/gpu_bench.log"
  ;;
cpu-smoke)
  shift || true
  PYTHONPATH=$PWD $PY scripts/gpu_bench.py --shapes tiny --device cpu --dtype fp32 --rows 24 --padded-rows 8 \
    --check-samples 2 --data "$SHARED/data/chat/mix.messages.jsonl" --tokenizer "$SHARED/data/tokenizers/qwen3" \
    --out "${OUT:-/tmp}/gpu_bench_cpu.json" "$@"
  ;;
sharded)
  shift || true
  [ -d "$GPU/whl" ] && $PY -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target /tmp/site "$GPU"/whl/*.whl
  export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1
  gpus=$($PY -c "import torch; print(torch.cuda.device_count())")
  data=${DATA:-$GPU/data/mix.messages.jsonl}
  model=("$@")
  [ ${#model[@]} -eq 0 ] && model=(model.random.hidden_size=1024 model.random.intermediate_size=4096
    model.random.num_hidden_layers=8 model.random.num_attention_heads=16 model.random.num_key_value_heads=8
    model.random.head_dim=64)
  work=$(mktemp -d); results="${OUT:-.}/gpu_bench_sharded.json"; echo "[" > "$results"; sep=""
  for n in 1 2 4 8; do
    [ "$n" -gt "$gpus" ] && break
    layout=(); [ "$n" -gt 1 ] && layout=(parallel.fsdp=$n)
    $PY -m torch.distributed.run --nproc_per_node="$n" -m dspark_precompute "${model[@]}" "${layout[@]}" \
      data.path="$data" data.max_samples=${ROWS:-2000} seq_length=2048 model.dtype=bf16 progress=false \
      storage.path="$work/fsdp$n" 2>&1 | tail -3
    $PY - "$work/fsdp$n/manifest.json" "$n" >> "$results.part" <<'PY'
import json, sys
m = json.load(open(sys.argv[1])); n = int(sys.argv[2]); t = m["timing"]
print(json.dumps({"fsdp": n, "gpus": n, "tokens": m["counts"]["tokens"], "forward_write_s": t["forward_write_s"],
                  "tokens_per_s_per_gpu": m["counts"]["tokens"] / t["forward_write_s"] / n}))
PY
    echo "$sep$(tail -1 "$results.part")" >> "$results"; sep=","
  done
  echo "]" >> "$results"; rm -f "$results.part"; cat "$results"
  # every sharded cache must equal the one-copy cache byte for byte (manifests aside)
  for d in "$work"/fsdp[248]; do
    [ -d "$d" ] && (cd "$work/fsdp1" && find . -type f ! -name manifest.json ! -path './.hydra/*' | sort | \
      while read -r f; do cmp -s "$f" "$d/$f" || echo "DIFFERS: $d/$f"; done)
  done
  ;;
*)
  echo "usage: bash scripts/gpu_bench.sh prepare | run [gpu_bench.py args] | cpu-smoke | sharded [model args]" >&2
  exit 2
  ;;
esac
