#!/usr/bin/env bash
# What this project runs on the lent H200, in as few device calls as possible (device README).
#   part 1: GPU kernel tests (every tile config bit-exact against the reference) + codec speed
#   part 2: replay bound benchmark
#   part 4: GPU data path tests (pinned pool, CUDA transfers, daemon + worker over CUDA IPC) + transfer benchmarks
#   part 5: the hit path and the in-place put (tests on the GPU, then benchmarks/hit_path.py)
#   part 6: the hit-path GPU tests, then time to first token (benchmarks/ttft.py)
#   part 9: latent-stream FP4, promotion and restart benchmarks
#   part 7: every gpu-marked test (kernels, data path, hit path, in-place put, faults), then the hit path benchmark
#   part 10: HF checkpoint replay in bf16 (gpu tests), then the replay-cost benchmark twice: calibrate, then check
#   part 11: the vLLM connector's and the paged kernel's gpu tests, then paged_write (torch vs kernel), vllm_save
#   part 12: the paged-write kernel's gpu tests, benchmarks/paged_write.py, vllm_save at 32K without and with it
#   part 8: stream layouts: the stream kernel and stream hit/put GPU tests, then the MLA latent's FP4 against a copy
# Usage there: OUT=... bash benchmarks/gpu_session.sh 1|2     (carry .whl: wheels the image lacks)
set -uo pipefail
OUT=${OUT:-/tmp/engram-gpu-out}
mkdir -p "$OUT"
if [ -d .whl ]; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
    && export PYTHONPATH=/tmp/site
fi
# kernels/ and cli/ are engram.kernels / engram.cli through setuptools package-dir; without an install, links do it.
[ -e engram/kernels ] || ln -s ../kernels engram/kernels
[ -e engram/cli ] || ln -s ../cli engram/cli
# The carried wheels first: the repo root's kernels/ would shadow Hugging Face's `kernels`, which transformers
# imports (and run pytest as `python3 -P -m pytest`, so that the working directory is not put first either).
export PYTHONUNBUFFERED=1 PYTHONPATH="${PYTHONPATH:+$PYTHONPATH:}$PWD"
nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.sm,clocks.mem --format=csv
python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__, torch.cuda.get_device_name())"
case "${1:-1}" in
  3)  # both benchmarks, no tests
    timeout 250 python3 benchmarks/codec_speed.py --out "$OUT/codec_speed.json" 2>&1 | tee "$OUT/codec_speed.log" | tail -45
    timeout 300 python3 benchmarks/replay_bound.py --out "$OUT/replay_bound.json" 2>&1 | tee "$OUT/replay_bound.log" | tail -25
    ;;
  1)
    timeout 300 python3 -m pytest -q -m gpu -p no:cacheprovider tests/test_fp4_kernels.py tests/test_fp4_reference.py 2>&1 \
      | tee "$OUT/gpu_tests.log" | tail -15
    timeout 280 python3 benchmarks/codec_speed.py --out "$OUT/codec_speed.json" 2>&1 | tee "$OUT/codec_speed.log" | tail -45
    ;;
  4)
    timeout 200 python3 -m pytest -q -p no:cacheprovider -rs tests/test_gpu_data_path.py 2>&1 | tee "$OUT/gpu_data_path.log" | tail -20
    timeout 200 python3 -m pytest -q -p no:cacheprovider tests/test_transfer.py tests/test_hbm_tier.py \
      tests/test_zero_copy.py tests/test_shared_pool.py tests/test_slots.py 2>&1 | tee "$OUT/gpu_cpu_logic.log" | tail -8
    timeout 150 python3 -m benchmarks.gpu_transfer --blocks 256 --rounds 10 2>&1 | tee "$OUT/gpu_transfer.log" | tail -30
    timeout 150 python3 -m benchmarks.zero_copy --blocks 64 --batch 16 --rounds 20 2>&1 | tee "$OUT/zero_copy.log" | tail -20
    ;;
  5)
    timeout 240 python3 -m pytest -q -p no:cacheprovider -rs -m gpu tests/test_hit_path.py tests/test_put_in_place.py \
      tests/test_fp4_kernels.py -k "batched or cuda or hbm" 2>&1 | tee "$OUT/hit_path_tests.log" | tail -15
    timeout 300 python3 -m benchmarks.hit_path --json "$OUT/hit_path.json" 2>&1 | tee "$OUT/hit_path.log" | tail -20
    ;;
  6)
    timeout 150 python3 -m pytest -q -p no:cacheprovider -rs -m gpu tests/test_hit_path.py tests/test_put_in_place.py \
      2>&1 | tee "$OUT/hit_path_tests.log" | tail -6
    timeout 400 python3 -m benchmarks.ttft --json "$OUT/ttft.json" 2>&1 | tee "$OUT/ttft.log" | tail -22
    ;;
  11)
    timeout 200 python3 -m pytest -q -p no:cacheprovider -rs -m gpu tests/test_integration_vllm.py 2>&1 \
      | tee "$OUT/vllm_gpu_tests.log" | tail -8
    timeout 330 python3 -m benchmarks.vllm_save --json "$OUT/vllm_save.json" 2>&1 | tee "$OUT/vllm_save.log" | tail -12
    ;;
  12)  # the paged-write kernel: its gpu tests, torch vs kernel alone, then a vLLM load at 32K without and with it
    timeout 200 python3 -m pytest -q -p no:cacheprovider -rs -m gpu tests/test_paged_kernel.py \
      tests/test_integration_vllm.py 2>&1 | tee "$OUT/paged_gpu_tests.log" | tail -8
    timeout 120 python3 -m benchmarks.paged_write --json "$OUT/paged_write.json" 2>&1 | tee "$OUT/paged_write.log" | tail -8
    for k in 0 1; do
      ENGRAM_PAGED_KERNEL=$k timeout 200 python3 -m benchmarks.vllm_save --tokens 32768 \
        --json "$OUT/vllm_save_kernel$k.json" 2>&1 | tee "$OUT/vllm_save_kernel$k.log" | tail -6
    done
    ;;
  7)
    timeout 330 python3 -m pytest -q -p no:cacheprovider -rs -m gpu tests/test_fp4_kernels.py tests/test_gpu_data_path.py \
      tests/test_hit_path.py tests/test_put_in_place.py tests/test_faults.py tests/test_integration_vllm.py \
      tests/test_stream_daemon.py 2>&1 | tee "$OUT/gpu_tests.log" | tail -15
    timeout 240 python3 -m benchmarks.hit_path --json "$OUT/hit_path.json" 2>&1 | tee "$OUT/hit_path.log" | tail -20
    ;;
  8)
    timeout 240 python3 -m pytest -q -p no:cacheprovider -rs -m gpu tests/test_fp4_kernels.py tests/test_stream_daemon.py \
      -k "streams" 2>&1 | tee "$OUT/stream_gpu_tests.log" | tail -8
    timeout 330 python3 -m benchmarks.latent_fp4 --json "$OUT/latent_fp4.json" 2>&1 | tee "$OUT/latent_fp4.log" | tail -45
    ;;
  9)  # the benchmarks beside part 7: the latent stream's FP4, promotion, restart with 100k blocks (a quiet host)
    timeout 200 python3 -m benchmarks.latent_fp4 --json "$OUT/latent_fp4.json" 2>&1 | tee "$OUT/latent_fp4.log" | tail -30
    timeout 120 python3 -m benchmarks.gpu_transfer --blocks 256 --rounds 10 2>&1 | tee "$OUT/gpu_transfer.log" | tail -14
    timeout 240 python3 -m benchmarks.restart --blocks 100000 --json "$OUT/restart.json" 2>&1 | tee "$OUT/restart.log" | tail -14
    ;;
  2)
    timeout 560 python3 benchmarks/replay_bound.py --out "$OUT/replay_bound.json" 2>&1 | tee "$OUT/replay_bound.log" | tail -25
    ;;
  10)  # issue 20: HF checkpoints replayed by the daemon in bf16; the replay-cost benchmark, calibrated on one run
       # (4K, 16K, 64K) and checked against a second (8K, 32K): prediction error and the policy's choices
    timeout 120 python3 -P -m pytest -q -p no:cacheprovider -rs -s -m gpu tests/test_replay_checkpoints.py 2>&1 \
      | grep -v Warn | tee "$OUT/replay_checkpoints.log" | tail -12
    mkdir -p "$OUT/run1" "$OUT/run2" /tmp/engram-cal
    timeout 260 python3 -P benchmarks/replay_cost.py --model gpt-oss-20b --contexts 4K,16K,64K --nvme-dir /tmp \
      --calibrate /tmp/engram-cal --out "$OUT/run1" 2>&1 | tail -60
    timeout 200 python3 -P benchmarks/replay_cost.py --model gpt-oss-20b --contexts 8K,32K --nvme-dir /tmp \
      --check "$OUT/run1/replay_cost.json" --out "$OUT/run2" 2>&1 | tail -40
    ;;
esac
