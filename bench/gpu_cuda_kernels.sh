#!/usr/bin/env bash
# Issue 17's H200 checks of the CUDA kernels, in one device call (under 8 min); everything
# lands in $OUT/r.tgz (one file back, re-packed every 20 s so a call cut off still sends what it
# had).
#
#   bash bench/gpu_cuda_kernels.sh                    # export,profile,tests,probe
#   PARTS=export,profile EXPORT=tv_resnet50_op17 PROFILES=tv_resnet50_op17:256 \
#     bash bench/gpu_cuda_kernels.sh                  # ResNet-50 b256 alone (~2-3 min)
#   PARTS=export,profile EXPORT=hf_gpt2_op17 PROFILES=hf_gpt2_op17:8 \
#     bash bench/gpu_cuda_kernels.sh                  # GPT-2: the MLP's tanh GELU in cuBLASLt
#   PARTS=cold bash bench/gpu_cuda_kernels.sh         # fresh-process load + first run (b1)
#
# In this order (the figures first; the probe last, in case the old call hangs the device):
# profile: see below. tests, tests-more, then
# probe: bench.gpu_hang_probe, step by step, the call whose GPU test stopped answering on
#   2026-12-04 (a 16x16 Triton tile with a residual, then the norm in place), with
#   faulthandler stacks every 15 s: its log says which step stops (compile, launch, sync).
# tests: the GPU cases of the GEMM epilogues (cuBLASLt's fused bias+ReLU/tanh-GELU, the flat
#   Triton pass, FusedMatMulLayerNorm as it runs now); tests-more: the 1x1 conv tactics, the
#   3-channel stem's tactics (padded to 4 channels), the multi-row LayerNorm tile, attention's
#   fully masked rows and BERT-shape masks; pytest's
#   faulthandler dumping a stack for any test past 30 s.
# profile: bench.cuda_profile per MODEL:BATCH[:norm] in PROFILES (kiln FP16 and torch eager
#   FP16); ':norm' builds with KILN_CUDA_MATMUL_NORM=1 (CUDA FusedMatMul + LayerNorm fusion on).
# cold: bench.cold_parts on COLD_MODELS. Every part runs under timeout --kill-after.
# q8 (not in the default PARTS; issue 18's INT8/FP8 engines): bench.cuda_profile per
#   MODEL:BATCH:PRECISIONS in Q8_PROFILES ('none': no profile): kiln FP16 and its INT8/FP8
#   engines, each tuned, then '== MODEL bB kiln int8: ratio int8/fp16 ...x' lines with the
#   agreement with FP32 on held-out batches (also in q8-summary.txt); Q8_HANDOFF=0 adds
#   --no-handoff (the A/B of the fused form); Q8_TESTS=1 first runs the interpreter-tested
#   INT8/FP8 kernel and hand-off tests on the GPU. A BERT and a ResNet profile may not fit one
#   600 s call together: run them as separate calls.
#   PARTS=q8 bash bench/gpu_cuda_kernels.sh                  # BERT-base b64 fp16,int8,fp8
#   PARTS=q8 Q8_PROFILES=tv_resnet50_op17:256:fp16,int8 bash bench/gpu_cuda_kernels.sh
#   PARTS=q8 Q8_TESTS=1 Q8_PROFILES=none bash bench/gpu_cuda_kernels.sh   # the GPU tests
set -u
PARTS=${PARTS:-export,profile,tests,probe}
PROFILES=${PROFILES:-hf_bert_base_sdpa_op17:64 hf_bert_base_sdpa_op17:64:norm}
COLD_MODELS=${COLD_MODELS:-hf_bert_sdpa_op17,timm_tf_mobilenetv3_op13,tv_resnet50_op17}
Q8_PROFILES=${Q8_PROFILES:-hf_bert_base_sdpa_op17:64:fp16,int8,fp8}
Q8_TESTS=${Q8_TESTS:-0}
Q8_HANDOFF=${Q8_HANDOFF:-1}
EXPORT=${EXPORT:-hf_bert_base_sdpa_op17}  # what the default PROFILES read
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD
W=$(mktemp -d); C=${CORPUS:-/tmp/corpus}; mkdir -p "$C"
pack() { tar czf "$OUT/r.tgz" -C "$W" . ; }
( while sleep 20; do pack; done ) > /dev/null 2>&1 &
PACKER=$!
trap 'kill $PACKER 2>/dev/null; pack' EXIT  # the packer must not outlive the call
t0=$(date +%s)
part() {  # part NAME SECONDS COMMAND...
  local name=$1 secs=$2; shift 2
  [[ ",$PARTS," == *",${name%%-*},"* ]] || return 0
  echo "[$(( $(date +%s) - t0 )) s] $name" | tee -a "$W/timeline.txt"
  timeout --kill-after=5 "$secs" "$@" > "$W/$name.txt" 2>&1 < /dev/null
  echo "[$(( $(date +%s) - t0 )) s] $name rc=$?" | tee -a "$W/timeline.txt"
  grep -v -i warn "$W/$name.txt" | tail -25
}
[[ ",$PARTS," == *",cold,"* ]] && EXPORT="$EXPORT,$COLD_MODELS"
part export 75 python -m bench.corpus.export --out "$C" --only "$EXPORT"
for spec in $PROFILES; do
  IFS=: read -r m b opt <<< "$spec"
  envs=(); [[ "${opt:-}" == norm ]] && envs=(KILN_CUDA_MATMUL_NORM=1)
  tag="$m-b$b${opt:+-$opt}"
  part "profile-$tag" 100 env ${envs[@]+"${envs[@]}"} python -m bench.cuda_profile --corpus "$C" \
    --model "$m" --batch "$b" --peer --top 14 --json "$W/profile-$tag.json"
  # the picks of one block's layers (layer.0 of a BERT): what the tuner chose and against what
  [[ -f "$W/profile-$tag.json" ]] && python -c "
import json, sys
d = json.load(open(sys.argv[1]))['kiln fp16']
for ln in d['log']:
    if 'layer.0/' in ln or '/h.0/' in ln: print('  ' + ln[:90] + ' ... ' + ln[-260:])" "$W/profile-$tag.json"
done
if [[ ",$PARTS," == *",q8,"* ]]; then
  [[ "$Q8_TESTS" == 1 ]] && part q8-tests 420 python -m pytest -q -p no:cacheprovider -rfE \
    -o faulthandler_timeout=120 tests/kernels/test_triton_int8.py \
    tests/kernels/test_triton_int8_conv.py tests/passes/test_quant_handoff.py
  [[ "$Q8_PROFILES" == none ]] && Q8_PROFILES=""
  q8m=$(for spec in $Q8_PROFILES; do echo -n "${spec%%:*},"; done)
  [[ -n "$q8m" ]] && part q8-export 90 python -m bench.corpus.export --out "$C" --only "${q8m%,}"
  for spec in $Q8_PROFILES; do
    IFS=: read -r m b precs <<< "$spec"
    extra=""; [[ "$Q8_HANDOFF" == 0 ]] && extra="--no-handoff"
    part "q8-$m-b$b" 480 python -m bench.cuda_profile --corpus "$C" --model "$m" --batch "$b" \
      --precision "$precs" $extra --top 14 --json "$W/q8-$m-b$b.json"
    grep "^== .* ratio \|^  ratio \|^== .*kiln .*: no result\|build failed" "$W/q8-$m-b$b.txt" \
      | tee -a "$W/q8-summary.txt"
  done
fi
part cold 150 python -m bench.cold_parts --corpus "$C" --models "$COLD_MODELS" \
  --plan-margins 0.25 --warm none,cublas --json "$W/cold.json"
part tests 90 python -m pytest -q -p no:cacheprovider -rfE -o faulthandler_timeout=30 \
  tests/kernels/test_triton_gemm.py -k "layernorm or cublaslt or library or flat or fused_gemm" \
  || true
part tests-more 90 python -m pytest -q -p no:cacheprovider -rfE -o faulthandler_timeout=30 \
  tests/kernels/test_triton_conv.py tests/kernels/test_triton_norm.py \
  tests/kernels/test_triton_attention.py \
  -k "1x1 or stem or pad_channels or norm or fully or bert_shape" || true
# last: if the old call hangs the device again, the figures above are in already
part probe 40 python -X faulthandler -m bench.gpu_hang_probe --dump-s 15
echo "[$(( $(date +%s) - t0 )) s] done" | tee -a "$W/timeline.txt"
