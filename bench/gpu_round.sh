#!/usr/bin/env bash
# One device-tool call's worth of GPU checks, each under its own time limit, results under $OUT:
#   bash bench/gpu_round.sh tests,load,bench
# tests:  the GPU tests (CUDA runtime, embedded binaries, every Triton kernel compiled on CUDA)
# load:   ResNet-50 FP16 b1 build, rebuild through the timing cache, load + first inference in
#         fresh processes (bench/cuda_diag.py --parts load)
# bench:  rows of the CUDA bench (BENCH_MODELS, BENCH_BATCHES, BENCH_SYSTEMS)
set -u
parts=${1:-tests,load,bench}
export PYTHONPATH=.
mkdir -p "$OUT/diag"
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader > "$OUT/env.txt"
python -c "import torch, triton; print(torch.__version__, torch.version.cuda, triton.__version__, torch.backends.cudnn.version())" >> "$OUT/env.txt"
if [[ $parts == *tests* ]]; then
  # kiln's C kernels (kiln/native), as pip install -e . builds them; the CPU tests expect them
  python setup.py -q build_ext --inplace > "$OUT/native_build.txt" 2>&1 || echo "rc=$?" >> "$OUT/native_build.txt"
  timeout ${TESTS_S:-200} python -m pytest -q -rfE -p no:cacheprovider ${TESTS:-tests/runtime/test_cuda.py tests/engine/test_binaries.py tests/kernels} \
    > "$OUT/tests.txt" 2>&1
  echo "rc=$?" >> "$OUT/tests.txt"
fi
if [[ $parts == *load* ]]; then
  timeout ${LOAD_S:-220} python bench/cuda_diag.py --out "$OUT/diag" --parts load --batches 1 \
    > "$OUT/diag/stdout.txt" 2>&1 || echo "rc=$?" >> "$OUT/diag/stdout.txt"
fi
if [[ $parts == *bench* ]]; then  # BENCH_MODELS (default minilm), BENCH_BATCHES (default: all)
  for b in ${BENCH_BATCHES:-all}; do  # one run (and file) per batch: a time-out loses one
    [[ $b == all ]] && bargs="" || bargs="--batches $b"
    timeout ${BENCH_S:-200} python -m bench.run --device cuda --models ${BENCH_MODELS:-minilm} \
      $bargs --systems "${BENCH_SYSTEMS:-kiln fp16,torch eager fp16,torch.compile reduce-overhead fp16}" \
      --compile-timeout 40 --duration 0.3 --iterations 10 --warmup 0.2 --markdown \
      > "$OUT/bench_$b.md" 2>&1
    echo "rc=$?" >> "$OUT/bench_$b.md"
  done
fi
true
