#!/usr/bin/env bash
# One device call on a lent GPU machine (whose python3 has torch but not this project's other
# dependencies): the wheels in $WHEELS (default ../gpu25-wheels: the dependencies the image lacks,
# for its Python 3.12) into /tmp/deps, the source roots on PYTHONPATH, then each part named in the
# arguments under its own time limit, its output under $OUT (default gpu-results/):
#   decode SECONDS    bench/gpu_disagg.py --decode-only --anchor --rounds 2  -> gpu_decode.json
#   sweep SECONDS     bench/gpu_disagg.py --decode-only --rounds 2 (no anchor) -> gpu_sweep.json
#   disagg SECONDS    bench/gpu_disagg.py --no-decode                        -> gpu_disagg.json
#   tests SECONDS [K] pytest tests/gpu [-k K]                                 -> gpu-tests.{log,xml}
# SRC=DIR: run the parts in the checkout DIR instead of this one (e.g. main, for a same-run baseline).
set -u
cd "${SRC:-$(dirname "$0")/..}"  # SRC: another checkout to measure (a same-run baseline)
OUT=${OUT:-gpu-results}
mkdir -p "$OUT" /tmp/deps
python3 -m pip install --quiet --no-deps --no-index --target /tmp/deps "${WHEELS:-../gpu25-wheels}"/*.whl 2>&1 | tail -2
roots=(cli operator frontend engine_image protocol devcluster sidecar client)
export PYTHONPATH="/tmp/deps:$(printf '%s:' "${roots[@]/#/$PWD/}")$PWD"
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader | tee "$OUT/gpu.txt"
echo "commit $(cat COMMIT 2>/dev/null || echo unknown)" | tee -a "$OUT/gpu.txt"
while [ $# -gt 0 ]; do
  part=$1 limit=$2; shift 2
  start=$(date +%s)
  case $part in
    decode) timeout "$limit" python3 bench/gpu_disagg.py --decode-only --anchor --rounds 2 \
              >"$OUT/gpu_decode.json" 2>"$OUT/gpu_decode.log" ;;
    sweep)  timeout "$limit" python3 bench/gpu_disagg.py --decode-only --rounds 2 >"$OUT/gpu_sweep.json" 2>"$OUT/gpu_sweep.log" ;;
    disagg) timeout "$limit" python3 bench/gpu_disagg.py --no-decode >"$OUT/gpu_disagg.json" 2>"$OUT/gpu_disagg.log" ;;
    tests)  k=(); if [ $# -gt 0 ] && [ "${1:0:1}" != "-" ] && ! [[ $1 =~ ^(decode|sweep|disagg|tests)$ ]]; then k=(-k "$1"); shift; fi
            timeout "$limit" python3 -m pytest tests/gpu --confcutdir=tests/gpu -p no:cacheprovider -rs -v --durations=10 \
              "${k[@]}" --junitxml="$OUT/gpu-tests.xml" >"$OUT/gpu-tests.log" 2>&1 ;;
  esac
  echo "$part rc=$? in $(( $(date +%s) - start )) s" | tee -a "$OUT/gpu.txt"
done
tail -c 2500 "$OUT"/gpu_sweep.json "$OUT"/gpu_decode.json "$OUT"/gpu_disagg.json 2>/dev/null
tail -n 5 "$OUT"/gpu_decode.log "$OUT"/gpu_disagg.log "$OUT"/gpu-tests.log 2>/dev/null
