#!/usr/bin/env bash
# The GPU check, one command on a machine with a CUDA GPU (no network needed):
#
#     bash gpu_check.sh
#
# Prints the machine, builds the CUDA extension (timed), runs the CUDA tests (the kernel
# against the torch reference, and the engine with either backend), then the
# decode-attention benchmark. Each step has a time limit; the script goes on after a failed
# step, and exits non-zero if any failed. With $OUT set, the output also goes to
# $OUT/gpu_check.log. About 3 minutes on an H200.
set -u -o pipefail

TEST_FILE=test_nanopaged.py
TEST_FILTER="cuda and not nvcc_check"       # the GPU tests (kernel and engine); --check is CI's job
PYTHON=${PYTHON:-python3}

cd "$(dirname "$0")"
if [ -n "${OUT:-}" ]; then
    mkdir -p "$OUT"
    exec > >(tee "$OUT/gpu_check.log") 2>&1
fi
# The nvcc on PATH may be a wrapper script; torch finds the toolkit through CUDA_HOME.
export CUDA_HOME=${CUDA_HOME:-/usr/local/cuda}

failed=()
step() {  # step NAME TIME_LIMIT_S COMMAND...
    local name=$1 limit=$2
    shift 2
    echo
    echo "===== $name ====="
    local start=$SECONDS
    timeout "$limit" "$@"
    local rc=$?
    [ $rc -eq 124 ] && echo "(timed out after $limit s)"
    echo "----- $name: exit $rc, $((SECONDS - start)) s"
    [ $rc -eq 0 ] || failed+=("$name")
}

step "machine" 60 nvidia-smi
"$CUDA_HOME/bin/nvcc" --version | tail -n 2
"$PYTHON" -c 'import sys, torch; print("python", sys.version.split()[0], "| torch", torch.__version__,
                                     "| CUDA", torch.version.cuda, "| ninja:", __import__("shutil").which("ninja"))'
step "build" 300 "$PYTHON" build_ext.py --build
step "tests" 240 "$PYTHON" -m pytest -x -q -rs "$TEST_FILE" -k "$TEST_FILTER"
step "benchmark" 150 "$PYTHON" bench.py kernel

echo
if [ ${#failed[@]} -eq 0 ]; then
    echo "gpu_check: all steps passed"
else
    echo "gpu_check: FAILED: ${failed[*]}"
    exit 1
fi
