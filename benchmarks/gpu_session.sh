#!/usr/bin/env bash
# One session on a GPU machine with no network: install the carried CUTLASS wheel and
# sparsecc, build the kernels (the carried cache .kcache/ is reused when the compiler
# matches), run the GPU tests (pytest -m gpu: the tests marked gpu, tests/**/*_gpu.py; GPU_TESTS
# names other paths) and the kernel benchmark. Logs and results go to $OUT.
# KERNELS=small-batch prebuilds only what the small-batch tests need, KERNELS=dense what
# kernels_gemm.py --dense-only sweeps, KERNELS=tune-24 what tuning 2:4 weights times
# (unseen_shapes.py), KERNELS=fp8-24 the FP8 2:4 GEMM's, KERNELS=unstructured the bitmap kernel's and
# the tiled CSR kernels' (kernels_csr.py --tiled-only), KERNELS=csr-split what the split CSR tests and
# kernels_csr.py --residual-modes need (kernel_set.py), KERNELS=none nothing.
#   usage: OUT=/some/dir [E2E_ARGS="--models ..."] [BENCH_ARGS="..."] bash benchmarks/gpu_session.sh [pytest args...]
# (e2e.py, decode.py, kernels_gemm.py, cost_model.py, unseen_shapes.py, kernels_csr.py, kernels_fp8.py and generate.py
# run only when E2E_ARGS / DECODE_ARGS / BENCH_ARGS / COST_ARGS / UNSEEN_ARGS / CSR_ARGS / FP8_ARGS / GENERATE_ARGS
# are set, possibly empty; HOST=0 skips
# host_overhead.py; TESTS=0 the tests)
set -u -o pipefail
OUT=${OUT:-/tmp/sparsecc-out}; mkdir -p "$OUT"
touch /tmp/session-start      # results written after this are copied to $OUT at the end
# ... also when a time limit stops the session (timeout's SIGTERM): what finished comes back
copy_results() {
  find benchmarks/results -maxdepth 1 -newer /tmp/session-start \( -name '*.json' -o -name '*.png' \) -exec cp {} "$OUT/" \;
}
trap copy_results EXIT
export PYTHONUNBUFFERED=1 SPARSECC_CACHE_DIR=${SPARSECC_CACHE_DIR:-$PWD/.kcache} SPARSECC_BUILD_JOBS=${SPARSECC_BUILD_JOBS:-16}
# what the session carries (benchmarks/README.md): the CUTLASS headers, as the nvidia-cutlass wheel
# in .whl/ or as .carry/cutlass.tgz, and .carry/kcache.txz, a kernel cache built before (optional;
# used when SPARSECC_CACHE_DIR is not set, else that cache is used, e.g. one an earlier call left in /tmp)
if ls .whl/nvidia_cutlass-*.whl > /dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --target /tmp/site .whl/nvidia_cutlass-*.whl || exit 1
  export SPARSECC_CUTLASS_DIR=/tmp/site/cutlass_library/source/include
else
  mkdir -p /tmp/cutlass && tar xzf .carry/cutlass.tgz -C /tmp/cutlass || exit 1
  export SPARSECC_CUTLASS_DIR=/tmp/cutlass/source/include
fi
# a cache keeps its kernels in kernels/<key>/: a tarball of another layout would be ignored, kernel by kernel
if [ -f .carry/kcache.txz ] && [ "$SPARSECC_CACHE_DIR" = "$PWD/.kcache" ]; then
  tar xJf .carry/kcache.txz
  if [ -d .kcache/kernels ]; then echo "carried kernel cache: $(ls .kcache/kernels | wc -l) kernels"
  else echo "WARNING: .carry/kcache.txz holds no .kcache/kernels/ (make it with tar cJf .carry/kcache.txz .kcache" \
            "after building with SPARSECC_CACHE_DIR=.kcache): every kernel will be compiled"; fi 2>&1 | tee -a "$OUT/session.log"
fi
mkdir -p "$SPARSECC_CACHE_DIR" && chmod -R go-w "$SPARSECC_CACHE_DIR" && chmod 700 "$SPARSECC_CACHE_DIR"
python3 -m pip install -q --no-index --no-deps --no-build-isolation -e . || exit 1
{ nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv; nvcc --version | tail -2;
  python3 -c "import torch; print('torch', torch.__version__, 'cuda', torch.version.cuda, torch.cuda.get_device_name())"; } \
  2>&1 | tee -a "$OUT/session.log"
[ "${KERNELS:-}" != none ] && python3 - <<'PY' 2>&1 | tee -a "$OUT/session.log"
import sys, time
sys.path.insert(0, "benchmarks")
import os
import kernel_set
from sparsecc.runtime import build
specs = kernel_set.named_session_specs(os.environ.get("KERNELS"))
start = time.time()
build.build(specs, progress=False)
print(f"kernels: {len(specs)}, built {build.LAST_BUILD.built}, from cache {build.LAST_BUILD.cached}, {time.time()-start:.1f} s")
PY
# a fresh process loading every kernel from the warm cache (lookup, hash check, dlopen)
[ "${KERNELS:-}" != none ] && python3 - <<'PY' 2>&1 | tee -a "$OUT/session.log"
import sys, time
sys.path.insert(0, "benchmarks")
start = time.time()
import torch, sparsecc
import os
import kernel_set
from sparsecc.runtime.kernel_op import ensure
imported = time.time()
kernels = ensure(kernel_set.named_session_specs(os.environ.get("KERNELS")), progress=False)
print(f"warm cache: loaded {len(kernels)} kernels in {time.time()-imported:.2f} s (imports {imported-start:.2f} s)")
PY
# with PROBE=1: one kernel compiled from scratch into an empty cache, timed (in the background)
touch /tmp/probe.txt
[ "${PROBE:-0}" = 1 ] && python3 - > /tmp/probe.txt 2>&1 <<'PY' &
import time
from sparsecc.runtime import build
from sparsecc.codegen.spec import Family, KernelSpec
for spec in (KernelSpec(Family.SM90_SPARSE24, "float16", tile=(256, 64, 128)), KernelSpec(Family.SM90_DENSE, "bfloat16", tile=(64, 256, 64), schedule="pingpong")):
    start = time.time(); build.build([spec], cache=build.KernelCache("/tmp/probe-cache"), progress=False)
    print(f"{spec.symbol} compiled from scratch in {time.time()-start:.1f} s")
PY
PROBE_PID=$!
[ "${TESTS:-1}" = 1 ] && timeout ${TEST_TIMEOUT:-300} python3 -m pytest -m gpu ${GPU_TESTS:-tests} -q -rs "$@" 2>&1 | tee "$OUT/gpu_tests.log" | tail -30
# the benchmarks below time the host too: none of them runs while the probe compiles
wait $PROBE_PID 2>/dev/null
[ "${HOST:-1}" = 1 ] && python3 benchmarks/host_overhead.py 2>&1 | tee -a "$OUT/session.log" | tail -7
[ -n "${COST_ARGS+x}" ] && timeout ${COST_TIMEOUT:-400} python3 benchmarks/cost_model.py $COST_ARGS 2>&1 | tee -a "$OUT/session.log" | tail -12
[ -n "${E2E_ARGS+x}" ] && timeout ${E2E_TIMEOUT:-400} python3 benchmarks/e2e.py $E2E_ARGS 2>&1 | tee -a "$OUT/session.log" | tail -30
[ -n "${DECODE_ARGS+x}" ] && timeout ${DECODE_TIMEOUT:-300} python3 benchmarks/decode.py $DECODE_ARGS 2>&1 | tee -a "$OUT/session.log" | tail -40
[ -n "${BENCH_ARGS+x}" ] && timeout ${BENCH_TIMEOUT:-300} python3 benchmarks/kernels_gemm.py $BENCH_ARGS 2>&1 | tee -a "$OUT/session.log" | tail -25
[ -n "${CSR_ARGS+x}" ] && timeout ${CSR_TIMEOUT:-300} python3 benchmarks/kernels_csr.py $CSR_ARGS 2>&1 | tee -a "$OUT/session.log" | tail -30
[ -n "${FP8_ARGS+x}" ] && timeout ${FP8_TIMEOUT:-300} python3 benchmarks/kernels_fp8.py $FP8_ARGS 2>&1 | tee -a "$OUT/session.log" | tail -20
[ -n "${GENERATE_ARGS+x}" ] && timeout ${GENERATE_TIMEOUT:-540} python3 benchmarks/generate.py $GENERATE_ARGS 2>&1 | tee -a "$OUT/session.log" | tail -20
# unseen_shapes.py once per set of arguments in UNSEEN_ARGS, the sets separated by '|'
if [ -n "${UNSEEN_ARGS:-}" ]; then
  IFS='|' read -ra UNSEEN_RUNS <<< "$UNSEEN_ARGS"
  for run in "${UNSEEN_RUNS[@]}"; do
    timeout ${UNSEEN_TIMEOUT:-400} python3 benchmarks/unseen_shapes.py $run 2>&1 | tee -a "$OUT/unseen.log" | tail -12
  done
fi
cat /tmp/probe.txt | tee -a "$OUT/session.log"
copy_results
ls "$OUT"
