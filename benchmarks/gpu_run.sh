#!/usr/bin/env bash
# The whole device session in one call (docs/gpu.md): the card's state, the CUDA-only tests, the kernel
# checks and the engine end to end (gpu_check.py), the decode GEMV's tile sweep (gpu_gemv.py), hardware
# counters of the slow kernels (ncu), and where a decode step goes, eager and graphed (gpu_profile.py). Each part has
# its own time limit, so one that hangs or fails leaves the others' output; all of it lands in $OUT.
#   bash benchmarks/gpu_run.sh                      # every part, sized for one <= 8-minute call on an H200
#   PARTS=test,check BUDGET=60 bash benchmarks/gpu_run.sh   # some parts
set -u -o pipefail
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD MOESAIC_CACHE=/tmp/moesaic-cache
export MOESAIC_CPU_KERNELS=0  # the CPU references run plain torch: no C++ build on the device's time
OUT=${OUT:-/tmp/gpu_out}
PARTS=${PARTS:-test,check,gemv,ncu,profile}
mkdir -p "$OUT"
has() { [[ ",$PARTS," == *",$1,"* ]]; }
{
  date -u
  nvidia-smi --query-gpu=name,memory.total,memory.used,clocks.sm,clocks.max.sm,clocks.mem,driver_version --format=csv
  python3 -c "import torch, triton; print('torch', torch.__version__, 'cuda', torch.version.cuda, 'triton', triton.__version__)"
} 2>&1 | tee "$OUT/env.txt"

if has test; then
  timeout "${TEST_TIMEOUT:-120}" python3 -m pytest -q -p no:cacheprovider -k "on_cuda" \
    tests/test_triton_models.py tests/test_no_host_sync.py tests/test_decode_graphs.py > "$OUT/pytest.log" 2>&1
  echo "pytest exit $?" >> "$OUT/pytest.log"
fi

# the end-to-end models: the CPU roofline benchmark's random-weight checkpoints (benchmarks/serving.py)
models=""
if has check || has profile; then
  E2E=${E2E:-mistral4,glm5_next}
  for name in ${E2E//,/ }; do
    timeout 120 python3 -c "
import sys, torch; sys.path.insert(0, 'benchmarks')
from serving import MODELS
from pathlib import Path; from moesaic.demo import write_random
n = write_random(Path('/tmp/e2e/$name'), dict(MODELS['$name']), dtype=torch.bfloat16)
print('$name', round(n / 1e6), 'M parameters')" 2>&1 | tee -a "$OUT/env.txt" && models="$models${models:+,}/tmp/e2e/$name"
  done
fi

if has check; then
  MOESAIC_E2E_MODELS=$models timeout "${CHECK_TIMEOUT:-260}" python3 benchmarks/gpu_check.py \
    --budget "${BUDGET:-120}" ${ONLY:+--only "$ONLY"} ${DEMOS:+--demos "$DEMOS"} > "$OUT/gpu_check.log" 2>&1
  echo "gpu_check exit $?" >> "$OUT/gpu_check.log"
fi

if has gemv; then
  timeout "${GEMV_TIMEOUT:-90}" python3 benchmarks/gpu_gemv.py > "$OUT/gpu_gemv.log" 2>&1
  echo "gpu_gemv exit $?" >> "$OUT/gpu_gemv.log"
fi

if has ncu; then
  NCU=$(command -v ncu || ls /opt/nvidia/nsight-compute/*/ncu 2>/dev/null | head -1)
  sections="--section SpeedOfLight --section Occupancy --section LaunchStats --section WarpStateStats"
  {
    timeout 60 "$NCU" --clock-control none $sections -k regex:_gemm_kernel python3 benchmarks/gpu_gemv.py --ncu --rows 1
    timeout 60 "$NCU" --clock-control none $sections -k regex:_split_kernel -c 2 \
      python3 benchmarks/gpu_check.py --only mla/dsa --no-e2e --budget 30
  } > "$OUT/ncu.log" 2>&1
  echo "ncu exit $?" >> "$OUT/ncu.log"
fi

if has profile; then  # eager, then with CUDA graphs (the families that allow them)
  for extra in "" --graphs; do
    timeout "${PROFILE_TIMEOUT:-60}" python3 benchmarks/gpu_profile.py ${models//,/ } $extra ${PROFILE_ARGS:-} \
      >> "$OUT/gpu_profile.log" 2>&1
    echo "gpu_profile $extra exit $?" >> "$OUT/gpu_profile.log"
  done
  grep "^==\|^   [0-9]* kernel\|host time" "$OUT/gpu_profile.log"
fi

for f in pytest gpu_gemv ncu; do [ -f "$OUT/$f.log" ] && tail -3 "$OUT/$f.log"; done
[ -f "$OUT/gpu_gemv.log" ] && grep -v "^\s*$" "$OUT/gpu_gemv.log" | head -80
[ -f "$OUT/gpu_check.log" ] && grep -v "^\s*$" "$OUT/gpu_check.log" | grep -v "^  File\|^    " | tail -70
exit 0
