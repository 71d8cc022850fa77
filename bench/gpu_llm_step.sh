#!/usr/bin/env bash
# Issue 20's GPU checks in one device call (H200, repo root, ~8 min at most): the LLM tests that
# need CUDA, the 7B FP8-KV bench.llm rows (decode b1, TTFT 512, 256 concurrent 512/256) with the
# decode lookahead on (llm) and off (llm0, KILN_LLM_LOOKAHEAD=0), the step breakdown
# (bench.llm_step, with the batch-1 decode's kernels) and the decode attention kernels
# (bench.llm_attention).
#
#   PARTS=tests,llm,llm0,step,attn bash bench/gpu_llm_step.sh     # the default: all five
#   PARTS=step STEP_ARGS="--weights fp8" bash bench/gpu_llm_step.sh
#
# Every part writes under $OUT (at most 8 files come back): summary.txt (versions, per part its
# exit code and seconds), tests.txt, llm.json + llm.txt (llm0's rows and output appended to
# them at the end), step.json + step.txt, attn.json + attn.txt. Each part runs under `timeout`
# (TESTS_S, LLM_S, LLM0_S, STEP_S, ATTN_S seconds: 130 + 110 + 90 + 90 + 60 = 480 s; on
# 2026-12-04 the parts took 78 + 42 + 22 + 18 s, before the load-time warm-up) so that one
# hang does not eat the others; rc 124 in summary.txt = cut off.
set -u
OUT=${OUT:-$(mktemp -d)}
PARTS=${PARTS:-tests,llm,llm0,step,attn}
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
S="$OUT/summary.txt"
t0=$(date +%s)
{
  echo "parts: $PARTS  start: $(date -u +%FT%TZ)  commit: $(git rev-parse --short HEAD 2>/dev/null)"
  nvidia-smi --query-gpu=name,driver_version,clocks.sm,memory.used --format=csv,noheader 2>&1
  python -c "import sys, torch, triton; print(sys.version.split()[0], torch.__version__, \
torch.version.cuda, triton.__version__)" 2>&1
} > "$S"

part() {  # part NAME SECONDS COMMAND...: run it under timeout, log rc and seconds
  local name=$1 secs=$2; shift 2
  [[ ",$PARTS," == *",$name,"* ]] || return 0
  local t=$(date +%s)
  echo "[$(( t - t0 )) s] $name: $*" | tee -a "$S"
  timeout --kill-after=10 "$secs" "$@" > "$OUT/$name.txt" 2>&1
  local rc=$?
  echo "[$(( $(date +%s) - t0 )) s] $name rc=$rc ($(( $(date +%s) - t )) s)" | tee -a "$S"
  tail -c 1200 "$OUT/$name.txt"; echo
}

# the LLM tests that need CUDA (or run their Triton kernels on it); stops after 10 failures
part tests "${TESTS_S:-130}" python -m pytest -q --maxfail=10 -rfE -p no:cacheprovider ${TESTS:-\
tests/llm/test_cuda_runner.py tests/llm/test_cuda_mixed.py tests/llm/test_cuda_runner_fill.py \
tests/llm/test_triton_attention.py tests/llm/test_triton_fused.py tests/llm/test_triton_gemv.py \
tests/llm/test_kv_fp8.py tests/llm/test_fp8.py tests/llm/test_bench_llm.py \
tests/llm/test_lookahead.py tests/llm/test_profile.py}
# the README's H200 row: 7B shape, FP16 weights, FP8 KV; decode b1, TTFT 512, 256 x (512 / 256)
part llm "${LLM_S:-110}" python -m bench.llm --device cuda --models 7b --peers 0 \
  --cuda-weights dtype --kv-cache-dtype fp8 --agree 0 ${LLM_ARGS:-} --json "$OUT/llm.json"
# the same rows with the decode lookahead off (kiln.llm.cuda_runner._greedy_decode): the A/B
KILN_LLM_LOOKAHEAD=0 part llm0 "${LLM0_S:-90}" python -m bench.llm --device cuda --models 7b \
  --peers 0 --cuda-weights dtype --kv-cache-dtype fp8 --agree 0 ${LLM_ARGS:-} \
  --json "$OUT/llm0.json"
part step "${STEP_S:-90}" python -m bench.llm_step --kv-cache-dtype fp8 ${STEP_ARGS:-} \
  --json "$OUT/step.json"
# the decode kernels at b256 x 640: tl.dot at 64/128 tokens, its K . q^T variant (kq), each
# at num_stages 2 and 4 too, and the tiled MHA kernel, plain and with the next tile prefetched
# (pf) (8 warps never won on 2026-12-04)
part attn "${ATTN_S:-60}" python -m bench.llm_attention ${ATTN_ARGS:---warps 4 --dot-tiles \
64,128 --kq-tiles 64,128 --stages 2,4 --pf-tiles 64,128} --json "$OUT/attn.json"
# llm0 into llm's files (8 files at most come back): its rows tagged lookahead_off
if [[ -f "$OUT/llm0.txt" ]]; then
  { echo "=== llm0: KILN_LLM_LOOKAHEAD=0 ==="; cat "$OUT/llm0.txt"; } >> "$OUT/llm.txt"
  python - "$OUT/llm.json" "$OUT/llm0.json" <<'PY' 2>&1 | tee -a "$S"
import json, os, sys
a, b = sys.argv[1], sys.argv[2]
rows = json.load(open(a)) if os.path.exists(a) else []
off = json.load(open(b)) if os.path.exists(b) else []
json.dump(rows + [dict(r, lookahead_off=True) for r in off], open(a, "w"), indent=1)
print(f"llm.json: {len(rows)} rows + {len(off)} lookahead-off rows")
PY
  rm -f "$OUT/llm0.txt" "$OUT/llm0.json"
fi
echo "[$(( $(date +%s) - t0 )) s] done" | tee -a "$S"
