#!/usr/bin/env bash
# The GPU checks of a short GPU lease as one script: each step under its own time limit, its
# log and JSON written as it goes, so a step that runs out of time costs only itself.
#
#   tools/gpu_check.sh OUT_DIR STEP...     # run from the checkout's root, on the GPU machine
#
# Steps: info, kernels (the kernel tests, compiled for this GPU), cuda (the tests marked
# `cuda`), gemm (bench/gpu.py ceilings gemm thor; TUNE=1 adds --tune), profile, demo, slices,
# batch (8 requests against one at the 27B's width).
# A step's limit in seconds is T_<STEP> (upper case) where set. WHEELS names a folder of
# wheels to install first (the planning dependencies the machine's Python lacks:
# docs/development.md). The machine's own python3 runs everything, with this tree on
# PYTHONPATH (no install).
set -uo pipefail
out=${1:?usage: tools/gpu_check.sh OUT_DIR STEP...}
shift
mkdir -p "$out"
py=${PYTHON:-python3}
export PYTHONUNBUFFERED=1
if [[ -n "${WHEELS:-}" ]]; then
    "$py" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
        --target /tmp/gpu_check_site "$WHEELS"/*.whl || exit 1
    export PYTHONPATH=/tmp/gpu_check_site:$PWD
else
    export PYTHONPATH=$PWD
fi
# Triton's bundled ptxas may not know sm_110a (the kernels report compiles for Thor); CUDA's
# own does. Triton 3.5+ builds sm_90 and newer with ptxas-blackwell, which reads
# TRITON_PTXAS_BLACKWELL_PATH; older ones read TRITON_PTXAS_PATH (kernels/toolchain.py).
for ptxas in "$(command -v ptxas)" /usr/local/cuda/bin/ptxas; do
    if [[ -x "$ptxas" ]]; then
        export TRITON_PTXAS_BLACKWELL_PATH=${TRITON_PTXAS_BLACKWELL_PATH:-$ptxas}
        export TRITON_PTXAS_PATH=${TRITON_PTXAS_PATH:-$ptxas}
        break
    fi
done
workers=${WORKERS:-8}
# every failure's report lands in $out/failures.log as it happens (tools/pytest_live_failures.py)
export LIVE_FAILURES=$out/failures.log PYTHONPATH=$PYTHONPATH:$PWD/tools
pytest=("$py" -m pytest -q -rfE --tb=short -p no:cacheprovider -p pytest_live_failures
        -n "$workers" --dist loadfile)

step() {   # name, default limit, command...
    local name=$1 limit=$2
    shift 2
    local var="T_${name^^}"
    limit=${!var:-$limit}
    local t0=$SECONDS
    echo "=== $name (limit ${limit} s)"
    timeout --kill-after=10 "$limit" "$@" >"$out/$name.log" 2>&1
    local rc=$?
    echo "=== $name: rc $rc in $((SECONDS - t0)) s"
    tail -n 25 "$out/$name.log"
}

for name in "$@"; do
    case $name in
        info) step info 30 bash -c "nvidia-smi; $py -c 'import torch, triton, transformers; \
print(torch.__version__, triton.__version__, transformers.__version__, \
torch.cuda.get_device_name())'; echo ptxas: \${TRITON_PTXAS_BLACKWELL_PATH:-bundled}" ;;
        kernels) step kernels 150 "${pytest[@]}" test/kernels ;;
        # the files that hold `cuda` tests (make test-gpu collects all of test/, which needs
        # the test extras this machine lacks)
        cuda) step cuda 120 "${pytest[@]}" -m cuda test/engine/test_parity.py \
            test/engine/test_compiled.py test/engine/test_attention_backends.py \
            test/engine/test_batch.py ;;
        gemm) step gemm 150 "$py" bench/gpu.py --parts ceilings gemm thor \
            ${TUNE:+--tune} --json-out "$out/gemm.json" ;;
        profile) step profile 90 "$py" bench/gpu.py --parts profile \
            --json-out "$out/profile.json" ;;
        demo) step demo 150 "$py" bench/gpu.py --parts demo \
            --demo-methods ${DEMO_METHODS:-auto none} --demo-tasks "${DEMO_TASKS:-6}" \
            --json-out "$out/demo.json" ;;
        slices) step slices 200 "$py" bench/gpu.py --parts slices \
            --slices ${SLICES:-27B 35B-A3B} --json-out "$out/slices.json" ;;
        batch) step batch 200 "$py" bench/gpu.py --parts batch --json-out "$out/batch.json" ;;
        *) echo "gpu_check.sh: unknown step '$name' (info kernels cuda gemm profile demo " \
                "slices batch)" >&2; exit 2 ;;
    esac
done
