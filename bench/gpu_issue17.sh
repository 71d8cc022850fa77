#!/usr/bin/env bash
# One device call for issue 17's GPU checks; everything lands in $OUT/r.tgz (one file back).
#   bash bench/gpu_issue17.sh conformance,placement,load,corpus
set -u
parts=${1:-conformance,placement,load}
W=$(mktemp -d)
export PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,driver_version,clocks.sm --format=csv,noheader > "$W/env.txt"
python -c "import torch, triton, onnx; print(torch.__version__, torch.version.cuda, triton.__version__, onnx.__version__)" >> "$W/env.txt"
pack() { tar czf "$OUT/r.tgz" -C "$W" . ; }
trap pack EXIT
( while sleep 30; do pack; done ) &  # a run cut off at the tool's limit still sends what it had
if [[ $parts == *conformance* ]]; then
  timeout ${CONF_S:-300} python -m bench.conformance --device cuda --workers ${CONF_WORKERS:-12} \
    --out "$W" --budget $(( ${CONF_S:-300} - 30 )) > "$W/conformance_stdout.txt" 2>&1
  echo "rc=$?" >> "$W/conformance_stdout.txt"; tail -5 "$W/conformance_stdout.txt"; pack
fi
if [[ $parts == *placement* ]]; then
  timeout ${PLACE_S:-120} python -m pytest -q -rfE -p no:cacheprovider ${TESTS:-tests/engine/test_placement.py} > "$W/tests.txt" 2>&1
  echo "rc=$?" >> "$W/tests.txt"; tail -3 "$W/tests.txt"; pack
fi
if [[ $parts == *load* ]]; then
  mkdir -p "$W/diag"
  timeout ${LOAD_S:-240} python bench/cuda_diag.py --out "$W/diag" --parts load --batches 1 \
    > "$W/diag/stdout.txt" 2>&1; echo "rc=$?" >> "$W/diag/stdout.txt"; pack
fi
if [[ $parts == *corpus* ]]; then  # CORPUS_MODELS exported here (shipped files: corpus-files/)
  C=$(mktemp -d)
  timeout ${EXPORT_S:-150} python -m bench.corpus.export --out "$C" --only "$CORPUS_MODELS" \
    --wheels corpus-files > "$W/corpus_export.txt" 2>&1; echo "rc=$?" >> "$W/corpus_export.txt"
  tail -8 "$W/corpus_export.txt"
  timeout ${CORPUS_S:-400} python -m bench.corpus --device cuda --corpus "$C" \
    --models "$CORPUS_MODELS" --json "$W/corpus.json" --duration 0.3 --iterations 10 \
    --warmup 0.1 --timeout ${CORPUS_MODEL_S:-300} > "$W/corpus_stdout.txt" 2>&1
  echo "rc=$?" >> "$W/corpus_stdout.txt"; tail -30 "$W/corpus_stdout.txt"; pack
fi
