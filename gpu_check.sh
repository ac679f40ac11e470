#!/usr/bin/env bash
# The GPU check, one command on a machine with a CUDA GPU (no network needed):
#
#     bash gpu_check.sh
#
# Prints the machine, builds the CUDA extension (timed), runs the CUDA tests (the kernel
# against the torch reference, and the engine with either backend), the decode-attention
# benchmark, then compute-sanitizer's memcheck, initcheck and racecheck. Each step has a time
# limit, and all of them together a budget (GPU_CHECK_BUDGET, 480 s: a lent GPU machine runs one
# command for at most 600 s, and its 15 minutes in all should leave room for a second run
# after a fix), so the verdict line always gets printed; a step that finds
# the budget spent is reported as skipped. The script goes on after a failed step (but for
# the build: nothing after it can run without the kernels) and exits non-zero if any failed.
# With $OUT set, the output also goes to $OUT/gpu_check.log.
#
# To rerun part of it after a fix (the build always runs: it is cached when nothing changed):
#
#     GPU_CHECK_STEPS="tests benchmark" bash gpu_check.sh     # of: tests benchmark sanitizer
set -u -o pipefail

TEST_FILE=test_nanopaged.py
TEST_FILTER="cuda"       # the GPU tests (kernel and engine)
PYTHON=${PYTHON:-python3}
BUDGET=${GPU_CHECK_BUDGET:-480}
export PYTHONUNBUFFERED=1   # a step killed by its time limit still leaves all it printed
STEPS=" ${GPU_CHECK_STEPS:-tests benchmark sanitizer} "
for name in $STEPS; do
    case $name in tests|benchmark|sanitizer) ;;
        *) echo "gpu_check: unknown step '$name' in GPU_CHECK_STEPS (steps: tests benchmark sanitizer)"; exit 2 ;;
    esac
done

# PYTHON as an absolute path, before the cd below (and torch runs ninja, found on PATH next
# to this python, from its build directory)
found=$(command -v "$PYTHON") || { echo "gpu_check: no python at PYTHON=$PYTHON"; exit 2; }
PYTHON="$(cd "$(dirname "$found")" && pwd)/$(basename "$found")"
PATH="$(dirname "$PYTHON"):$PATH"
cd "$(dirname "$0")"
# The nvcc on PATH may be a wrapper script; torch finds the toolkit through CUDA_HOME,
# which build_ext looks for as the build will ($CUDA_HOME, $CUDA_PATH, /usr/local/cuda, PATH)
CUDA_HOME=$("$PYTHON" -c 'import build_ext; print(build_ext.find_cuda_home() or "/usr/local/cuda")') ||
    CUDA_HOME=/usr/local/cuda
export CUDA_HOME
# where the build caches the extension: build_ext's own answer (under set -u, $HOME unset
# would end the script here, before its log exists; Python falls back to the passwd entry)
KERNEL_CACHE=$("$PYTHON" -c 'import build_ext; print(build_ext.build_dir())') ||
    KERNEL_CACHE="${NANOPAGED_CACHE:-${HOME:-/root}/.cache/nanopaged}/kernels"

failed=()
step() {  # step NAME TIME_LIMIT_S COMMAND...
    local name=$1 limit=$2
    shift 2
    local left=$((BUDGET - SECONDS))
    echo
    echo "===== $name ====="
    if [ "$left" -lt 20 ]; then
        echo "----- $name: skipped, ${left} s of the ${BUDGET} s budget left"
        failed+=("$name (skipped)")
        return
    fi
    [ "$limit" -gt "$left" ] && limit=$left
    local start=$SECONDS
    timeout -k 10 "$limit" "$@"
    local rc=$?
    [ $rc -eq 124 ] && echo "(timed out after $limit s)"
    echo "----- $name: exit $rc, $((SECONDS - start)) s"
    [ $rc -eq 0 ] || failed+=("$name")
}

# What the CPU emulator cannot see: out-of-bounds accesses on the real memory system, reads
# of memory nothing wrote (the split-K merge reading a partition no CTA filled: torch's
# workspace is uninitialised, where the emulator's is usually zeros), and shared-memory
# races. compute-sanitizer watches the kernels while they run a split-K prefill batch, a
# decode batch, a KV write and a block copy. Without torch's caching allocator every tensor
# is its own cudaMalloc, so memcheck sees a read past its end. (It watches torch's few
# kernels here too: a report names the kernel.)
SANITIZED='
import torch, build_ext, test_nanopaged as t
ops = build_ext.load_kernels()
for name in ("varlen-fp16-d128-bs8-g8-split64", "decode-bf16-d128-bs16-g4", "window-varlen-fp16-d64-bs8-g3-w37-split64"):
    case = t.CASES[name]
    q, k_cache, v_cache, tables, seq_lens, qsl = t.make_batch(case, "cuda")
    ops.paged_attention(q, k_cache, v_cache, tables.cuda(), seq_lens.cuda(), qsl.cuda(), case.head_dim ** -0.5,
                        max(n for n, _ in case.pairs), max(n for _, n in case.pairs), window=case.window,
                        partition_size=case.partition_size)
t.check_write_kv(ops, torch.bfloat16, "cuda")
t.check_copy_blocks(ops, torch.bfloat16, "cuda")
torch.cuda.synchronize()
print("kernels ran under the sanitizer")'

check() {
    step "machine" 60 nvidia-smi
    "$CUDA_HOME/bin/nvcc" --version | tail -n 2
    "$PYTHON" -c 'import sys, torch; print("python", sys.version.split()[0], "| torch", torch.__version__,
                                         "| CUDA", torch.version.cuda, "| ninja:", __import__("shutil").which("ninja"))'
    rm -f "$KERNEL_CACHE/lock"   # (see below)
    step "build" 300 "$PYTHON" build_ext.py --build
    if [[ " ${failed[*]} " == *" build "* ]] && [ -f "$KERNEL_CACHE/build.log" ]; then
        # the compiler's first errors, then the end of its output: this machine is gone after
        grep -m 5 -i "error" "$KERNEL_CACHE/build.log"
        tail -n 60 "$KERNEL_CACHE/build.log"
    fi
    # A build killed by its time limit leaves torch's lock file behind, and every later
    # build would wait on it for good.
    rm -f "$KERNEL_CACHE/lock"
    if [[ " ${failed[*]} " == *" build "* ]]; then
        # The tests, the benchmark and each sanitizer run load the kernels themselves: each
        # would build them again and fail the same way, spending minutes of the machine that
        # a rerun after the fix needs. Stop here.
        echo
        echo "gpu_check: FAILED: ${failed[*]} ($SECONDS s); tests, benchmark and sanitizer not run without the build"
        return 1
    fi
    [[ $STEPS == *" tests "* ]] &&
        # every failure, not the first; launches made synchronous, so that a kernel's fault
        # is reported by the test that launched it (it spoils the CUDA context for the rest)
        step "tests" 240 env CUDA_LAUNCH_BLOCKING=1 "$PYTHON" -m pytest -q -rs --tb=short "$TEST_FILE" -k "$TEST_FILTER"
    [[ $STEPS == *" benchmark "* ]] && step "benchmark" 120 "$PYTHON" bench.py kernel
    [[ $STEPS == *" sanitizer "* ]] && sanitize

    echo
    if [ ${#failed[@]} -eq 0 ]; then
        echo "gpu_check: all steps passed ($SECONDS s)"
    else
        echo "gpu_check: FAILED: ${failed[*]} ($SECONDS s)"
        return 1
    fi
}

sanitize() {
    local sanitizer probe left=$((BUDGET - SECONDS))
    # Errors the kernels make on the GPU fail a run; a host API call that returns an error
    # does not: libraries probe the driver with such calls (cuGetProcAddress for a symbol
    # this driver lacks, say), and the sanitizer counts each as an error by default, which
    # would fail even the trivial probe below and skip every check.
    local checks=(--error-exitcode 1 --report-api-errors no)
    sanitizer=$(command -v compute-sanitizer || echo "$CUDA_HOME/bin/compute-sanitizer")
    echo
    # Some sandboxes (gVisor) refuse the sanitizer any GPU. That is no finding about the
    # kernels, but the checks did not run: the verdict says so.
    if [ ! -x "$sanitizer" ]; then
        echo "compute-sanitizer not found: memcheck, initcheck and racecheck skipped"
        failed+=("sanitizer (not found)")
    elif [ "$left" -lt 80 ]; then   # (the probe within the budget too, and the checks after it)
        echo "compute-sanitizer: skipped, ${left} s of the ${BUDGET} s budget left"
        failed+=("sanitizer (skipped)")
    elif ! probe=$(timeout -k 10 $((left / 2 < 120 ? left / 2 : 120)) "$sanitizer" "${checks[@]}" "$PYTHON" -c \
            'import torch; torch.zeros(1, device="cuda"); torch.cuda.synchronize()' 2>&1); then
        echo "compute-sanitizer cannot run a trivial CUDA program here: memcheck, initcheck and racecheck skipped"
        echo "$probe" | tail -n 5
        failed+=("sanitizer (cannot run here)")
    else
        for tool in memcheck initcheck racecheck; do   # (the likeliest findings first)
            step "$tool" 100 env PYTORCH_NO_CUDA_MEMORY_CACHING=1 \
                "$sanitizer" --tool "$tool" "${checks[@]}" "$PYTHON" -c "$SANITIZED"
        done
    fi
}

if [ -n "${OUT:-}" ]; then
    mkdir -p "$OUT"
    check 2>&1 | tee "$OUT/gpu_check.log"   # the pipe waits for tee: the log gets every line
    exit "${PIPESTATUS[0]}"
fi
check
