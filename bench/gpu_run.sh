#!/usr/bin/env bash
# One device call (H200) running the GPU parts of the open issues; every result lands in
# $OUT/r.tgz (one file back, re-packed every 30 s so that a run cut off at the tool's limit
# still sends what it had).
#
#   bash bench/gpu_run.sh corpus,serve        # issue 17 corpus rows + issue 19 load test
#   bash bench/gpu_run.sh llm,precision       # issue 20 7B decode + issue 18 INT8/FP8
#   bash bench/gpu_run.sh attn,llm            # issue 20: decode attention kernel, then the 7B rows
#   bash bench/gpu_run.sh corpus,quick        # + kiln alone at b1 on QUICK_MODELS (after corpus)
#
# Inputs the call carries (both optional): .gpu/corpus/ (ONNX files + manifest.json, copied
# from ~/.cache/kiln/corpus) and .whl/ (wheels the serve part needs: fastapi, uvicorn,
# pydantic, tritonclient, protobuf...). Time caps per part: CORPUS_S, QUICK_S, SERVE_S, LLM_S, PREC_S,
# ATTN_S, CONF_S (conformance runs in the background beside the other parts: correctness only).
# PYCACHE=1 writes Python's bytecode caches to /tmp/pyc, for a machine whose site-packages
# have none and cannot be written (the 'diag' part shows whether), so that fresh processes after
# the first do not compile triton's and kiln's sources again (an installed package has them).
set -u
parts=${1:-corpus}
W=$(mktemp -d)
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD
[ -n "${PYCACHE:-}" ] && export PYTHONPYCACHEPREFIX=/tmp/pyc
nvidia-smi --query-gpu=name,driver_version,clocks.sm,memory.used --format=csv,noheader > "$W/env.txt"
python -c "import torch, triton, onnx, onnxruntime; print(torch.__version__, torch.version.cuda, \
triton.__version__, onnx.__version__, onnxruntime.__version__)" >> "$W/env.txt" 2>&1
pack() { tar czf "$OUT/r.tgz" -C "$W" . ; }
trap pack EXIT
( while sleep 30; do pack; done ) &
t_start=$(date +%s)
stamp() { echo "[$(( $(date +%s) - t_start )) s] $*" | tee -a "$W/timeline.txt"; }

if [[ $parts == *diag* ]]; then  # what a fresh process pays to import (bytecode caches?)
  stamp "diag"
  { python - <<'PY'
import importlib.util, os, pathlib
for m in ("triton", "torch", "kiln"):
    d = pathlib.Path(importlib.util.find_spec(m).origin).parent
    print(m, d, "pycache:", (d / "__pycache__").is_dir(), "writable:", os.access(d, os.W_OK))
PY
    for i in 1 2; do env -u PYTHONPYCACHEPREFIX python -X importtime -c "import triton" 2>&1 | tail -1; done
    for i in 1 2; do PYTHONPYCACHEPREFIX=/tmp/pyc python -X importtime -c "import triton" \
      2>&1 | tail -1; done
    for i in 1 2; do PYTHONPYCACHEPREFIX=/tmp/pyc python -X importtime -c \
      "import torch, kiln, kiln.kernels.triton" 2>&1 | sort -t'|' -k2 -n | tail -12; done
  } > "$W/diag.txt" 2>&1; cat "$W/diag.txt"
fi
if [[ $parts == *conformance* ]]; then  # in the background: correctness only, no timing
  stamp "conformance (background)"
  timeout ${CONF_S:-420} python -m bench.conformance --device cuda --workers ${CONF_WORKERS:-6} \
    --budget ${CONF_BUDGET:-380} --out "$W" > "$W/conformance_stdout.txt" 2>&1 &
  conf_pid=$!
fi
if [[ $parts == *corpus* ]]; then
  C=$(mktemp -d)
  [ -d .gpu/corpus ] && cp .gpu/corpus/* "$C"/
  if [ -n "${CORPUS_EXPORT:-}" ]; then  # torch-defined models exported here (torchvision/timm)
    stamp "export $CORPUS_EXPORT"
    timeout ${EXPORT_S:-150} python -m bench.corpus.export --out "$C" --only "$CORPUS_EXPORT" \
      > "$W/corpus_export.txt" 2>&1; echo "rc=$?" >> "$W/corpus_export.txt"
    tail -4 "$W/corpus_export.txt"
  fi
  if [ -n "${CORPUS_MODELS:-}" ]; then
  stamp "corpus $CORPUS_MODELS"
  timeout ${CORPUS_S:-360} python -m bench.corpus --device cuda --corpus "$C" \
    --models "$CORPUS_MODELS" --json "$W/corpus.json" --duration 0.3 --iterations 10 \
    --warmup 0.1 --timeout ${CORPUS_MODEL_S:-150} > "$W/corpus_stdout.txt" 2>&1
  echo "rc=$?" >> "$W/corpus_stdout.txt"; tail -40 "$W/corpus_stdout.txt"; pack
  fi
fi
if [[ $parts == *quick* ]]; then  # kiln alone at b1 over more models: builds, runs, matches?
  stamp "quick $QUICK_MODELS"
  timeout ${QUICK_S:-200} python -m bench.corpus --device cuda --corpus "$C" --kiln-only \
    --models "$QUICK_MODELS" --json "$W/quick.json" --duration 0.2 --iterations 10 \
    --warmup 0.1 --timeout ${QUICK_MODEL_S:-60} > "$W/quick_stdout.txt" 2>&1
  echo "rc=$?" >> "$W/quick_stdout.txt"; tail -30 "$W/quick_stdout.txt"; pack
fi
if [[ $parts == *serve* ]]; then
  stamp "serve"
  S=/tmp/site
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target $S .whl/*.whl > "$W/serve_pip.txt" 2>&1
  PYTHONPATH=$S:$PWD timeout ${SERVE_S:-220} python -m bench.serve_load --model resnet50 \
    --device cuda --fp16 --concurrency 1,8,32 --requests ${SERVE_REQUESTS:-4000} \
    --max-batch 32 --instances 2 --client-procs 4 --level-timeout 60 \
    --json "$W/serve.json" > "$W/serve_stdout.txt" 2>&1
  echo "rc=$?" >> "$W/serve_stdout.txt"; tail -25 "$W/serve_stdout.txt"; pack
fi
if [[ $parts == *llm* ]]; then
  stamp "llm"
  timeout ${LLM_S:-330} python -m bench.llm --device cuda --models 7b ${LLM_ARGS:-} \
    --json "$W/llm.json" > "$W/llm_stdout.txt" 2>&1
  echo "rc=$?" >> "$W/llm_stdout.txt"; tail -25 "$W/llm_stdout.txt"; pack
fi
if [[ $parts == *attn* ]]; then  # the decode attention kernel alone: FP16/FP8 KV, dot/tiled
  stamp "attn"
  timeout ${ATTN_S:-150} python -m bench.llm_attention ${ATTN_ARGS:-} --json "$W/attn.json" \
    > "$W/attn_stdout.txt" 2>&1
  echo "rc=$?" >> "$W/attn_stdout.txt"; tail -12 "$W/attn_stdout.txt"; pack
fi
if [[ $parts == *precision* ]]; then
  stamp "precision"
  timeout ${PREC_S:-240} python -m bench.precision --device cuda -n 30 \
    --cuda-models ${PREC_MODELS:-bert,resnet50} \
    > "$W/precision_stdout.txt" 2>&1
  echo "rc=$?" >> "$W/precision_stdout.txt"; tail -15 "$W/precision_stdout.txt"; pack
fi
if [ -n "${conf_pid:-}" ]; then stamp "waiting for conformance"; wait $conf_pid
  echo "rc=$?" >> "$W/conformance_stdout.txt"; head -c 1500 "$W/conformance_stdout.txt"; fi
stamp "done"
