#!/usr/bin/env bash
# The one run on a GPU machine: `gspo-kernels gpu-check --quick`, then `gspo-kernels bench --gpu`.
#
#   bash benchmarks/gpu_run.sh            # from the repository root; results under $OUT (default results/gpu_run)
#
# Peers (trl, liger-kernel, cut-cross-entropy and what they import that the machine lacks) come as wheels in
# .whl/ when present (see .whl/README-install.txt); without them each peer is skipped with the reason.
# About 9 minutes at most: gpu-check is stopped at 270 s, bench --gpu at 230 s (its own budget is 215 s).
# What comes back from $OUT (at most 8 files, 2 folders deep): env.log, gpu_check.log, gpu_check.json,
# gpu_check.md, bench_gpu.log, bench_gpu.json, bench_gpu.md, and gpu_check_files.tar.gz (gpu-check's other files).
# GPU_CHECK_STEPS: the gpu-check --quick steps (default: all but `benchmarks`, which bench --gpu measures in full;
#   `versions,suite` runs the whole test suite instead, about 4 minutes on 16 cores: GPU_CHECK_TIMEOUT=300).
# BENCH_SECTIONS: bench --gpu's sections (default: all), e.g. `trl-step,torch-backend,hidden,logits`.

set -u -o pipefail
OUT=${OUT:-$PWD/results/gpu_run}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 HF_DATASETS_OFFLINE=1 TOKENIZERS_PARALLELISM=false
unset TRITON_INTERPRET

if ls .whl/*.whl >/dev/null 2>&1; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
        || echo "gpu_run.sh: installing the carried wheels failed; the peers will be skipped" >&2
    export PYTHONPATH=/tmp/site:$PWD
else
    export PYTHONPATH=$PWD
fi
gk() { python3 -m gspo_kernels "$@"; }  # the `gspo-kernels` command, from this checkout

{
    date -u
    nvidia-smi || true
    python3 - <<'EOF'
import importlib.metadata as md
import sys

import gspo_kernels
import torch

print("python", sys.version.split()[0], "| gspo_kernels from", gspo_kernels.__file__)
print("torch", torch.__version__, "cuda", torch.version.cuda, "| device",
      torch.cuda.get_device_name() if torch.cuda.is_available() else "none")
for dist in ("triton", "transformers", "accelerate", "datasets", "pyarrow", "huggingface-hub", "dill", "multiprocess",
             "trl", "liger-kernel", "cut-cross-entropy"):
    try:
        print(dist, md.version(dist))
    except md.PackageNotFoundError:
        print(dist, "not installed")
for mod in ("trl", "trl.kernels", "liger_kernel.chunked_loss", "cut_cross_entropy"):
    try:
        __import__(mod)
        print("import", mod, "ok")
    except Exception as exc:
        print("import", mod, "FAILED:", type(exc).__name__, exc)
EOF
} >"$OUT/env.log" 2>&1
cat "$OUT/env.log"

# 1. gpu-check --quick (its files in /tmp, the report copied to $OUT; the rest packed into one archive).
CHECK_DIR=/tmp/gpu_check
rm -rf "$CHECK_DIR"
if gk gpu-check --help 2>/dev/null | grep -q -- "--quick"; then
    CHECK_ARGS=(--quick --steps "${GPU_CHECK_STEPS:-versions,verify,gpu-tests,memcheck}")
else
    CHECK_ARGS=(--budget-s 250)  # a gpu-check without --quick: its full step list under this budget
fi
echo "== gspo-kernels gpu-check ${CHECK_ARGS[*]} --out $CHECK_DIR"
timeout -k 10 ${GPU_CHECK_TIMEOUT:-270} python3 -m gspo_kernels gpu-check "${CHECK_ARGS[@]}" --out "$CHECK_DIR" 2>&1 | tee "$OUT/gpu_check.log"
echo "gpu-check exit status ${PIPESTATUS[0]}" | tee -a "$OUT/gpu_check.log"
for f in gpu_check.json gpu_check.md; do
    [ -f "$CHECK_DIR/$f" ] && cp "$CHECK_DIR/$f" "$OUT/$f"
done
if [ -d "$CHECK_DIR" ]; then
    tar -czf "$OUT/gpu_check_files.tar.gz" -C /tmp gpu_check 2>/dev/null || true
fi

# 2. bench --gpu: every ratio against plain PyTorch and the peers in one run.
SECTIONS=()
[ -n "${BENCH_SECTIONS:-}" ] && SECTIONS=(--sections "$BENCH_SECTIONS")
echo "== gspo-kernels bench --gpu ${SECTIONS[*]} --out $OUT/bench_gpu"
timeout -k 10 ${BENCH_TIMEOUT:-230} python3 -m gspo_kernels bench --gpu "${SECTIONS[@]}" --out "$OUT/bench_gpu" 2>&1 \
    | tee "$OUT/bench_gpu.log"
echo "bench --gpu exit status ${PIPESTATUS[0]}" | tee -a "$OUT/bench_gpu.log"
ls -la "$OUT"
