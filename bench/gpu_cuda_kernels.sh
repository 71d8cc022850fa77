#!/usr/bin/env bash
# Issue 17's H200 checks of session 11's CUDA kernels, in one device call; everything lands in
# $OUT/r.tgz (one file back, re-packed every 20 s so a call cut off still sends what it had).
#
#   bash bench/gpu_cuda_kernels.sh                 # tests,export,profile,cold (~6 min)
#   PARTS=profile PROFILES=tv_resnet50_op17:256 bash bench/gpu_cuda_kernels.sh
#
# tests: the GPU cases of the CUDA kernels added on 2026-12-04 (SqueezeExcite, MaxPool, the
# attention-mask pointwise program, bool-mask / merged-QKV attention, FusedMatMulLayerNorm: its
# 'Triton tile + residual' case hung there once, so every part runs under timeout --kill-after).
# profile: bench.cuda_profile per MODEL:BATCH in PROFILES (kiln FP16 and torch eager FP16).
# cold: bench.cold_parts on COLD_MODELS (fresh-process load + first run at b1).
set -u
PARTS=${PARTS:-tests,export,profile,cold}
PROFILES=${PROFILES:-hf_bert_base_sdpa_op17:64 tv_resnet50_op17:256 timm_tf_mobilenetv3_op13:1}
COLD_MODELS=${COLD_MODELS:-hf_bert_sdpa_op17,timm_tf_mobilenetv3_op13,tv_resnet50_op17}
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD
W=$(mktemp -d); C=${CORPUS:-/tmp/corpus}; mkdir -p "$C"
pack() { tar czf "$OUT/r.tgz" -C "$W" . ; }
trap pack EXIT
( while sleep 20; do pack; done ) &
t0=$(date +%s)
part() {  # part NAME SECONDS COMMAND...
  local name=$1 secs=$2; shift 2
  [[ ",$PARTS," == *",${name%%-*},"* ]] || return 0
  echo "[$(( $(date +%s) - t0 )) s] $name" | tee -a "$W/timeline.txt"
  timeout --kill-after=5 "$secs" "$@" > "$W/$name.txt" 2>&1
  echo "[$(( $(date +%s) - t0 )) s] $name rc=$?" | tee -a "$W/timeline.txt"
  grep -v -i warn "$W/$name.txt" | tail -25
}
part tests 120 python -m pytest -q -p no:cacheprovider -rfE \
  tests/kernels/test_triton_squeeze_excite.py tests/kernels/test_triton_pool.py \
  tests/kernels/test_triton_pointwise.py tests/kernels/test_triton_attention.py \
  "tests/kernels/test_triton_gemm.py::test_triton_fused_matmul_layernorm" \
  || true
part export 90 python -m bench.corpus.export --out "$C" \
  --only "hf_bert_base_sdpa_op17,tv_resnet50_op17,${COLD_MODELS}"
for spec in $PROFILES; do
  m=${spec%:*}; b=${spec#*:}
  part "profile-$m-b$b" 100 python -m bench.cuda_profile --corpus "$C" --model "$m" --batch "$b" \
    --peer --top 14 --json "$W/profile-$m-b$b.json"
done
part cold 150 python -m bench.cold_parts --corpus "$C" --models "$COLD_MODELS" \
  --plan-margins 0.25 --warm none,cublas --json "$W/cold.json"
echo "[$(( $(date +%s) - t0 )) s] done" | tee -a "$W/timeline.txt"
