#!/usr/bin/env bash
# The GPU benchmarks in one call of a GPU host, the peers beside ours (bench/README.md).
#
#   bench/gpu_suite.sh speed      # OLMo-core (last GPU) | train_step (GPU 0) | 2-GPU ablation (GPUs 1,2);
#                                 # on one GPU: OLMo-core, train_step, OLMo-core again
#   bench/gpu_suite.sh scaling    # weak + strong scaling over every GPU of the host
#   bench/gpu_suite.sh all        # both, one after the other
#   bench/gpu_suite.sh weak       # weak-1 and weak-2 only: eager in two passes, then compiled
#   bench/gpu_suite.sh trace      # timelines: weak-1 and weak-2 on every rank, one GPU's compiled step,
#                                 # each read by bench/trace_gaps.py (where the devices idle, and why),
#                                 # and weak-2's device time against weak-1's (trace_gaps.py --compare)
#   bench/gpu_suite.sh memory     # where the step's peak memory lies and what is allocated then
#                                 # (bench/memory_step.py; VARIANTS="..." for others than the default)
#   bench/gpu_suite.sh tests      # the one-GPU tests (gpu-marked: kernels, core, bench): ~3+ minutes on an H200
#   bench/gpu_suite.sh ws         # the warp-specialized Gluon kernel (Hopper): its GPU tests, then
#                                 # bench/kernels.py --ws; each under a timeout, so that a hang costs only it
#   bench/gpu_suite.sh rehearse   # one rank of every paper layout (optimus rehearse): the five models at 384
#                                 # and 12288 tiles, then the registry's own layouts; RUNS="..." TILES="..." for others,
#                                 # CHECKPOINTING=full/3 to rehearse that instead of what the plan resolves
#   VARIANTS="7b8l-loop 7b8l-triton+compile" bench/gpu_suite.sh speed    # a subset of train_step
#   REPEAT=2 VARIANTS="..." bench/gpu_suite.sh speed                       # each variant twice, in turns
#   MICRO_BATCHES="2 4 8" bench/gpu_suite.sh speed    # the micro-batch axis: ours and OLMo-core at each
#   SEQ=4096 bench/gpu_suite.sh speed                  # another context (default 2048, the paper's)
#
# Needs: torch + triton (CUDA); for OLMo-core, the peers folder with its wheels in .peers/
# (../shared/peers/README.md says how to fill it). Results: bench/results/ (or $OUT if set), with
# one log per part. Parts that share a call run on disjoint GPUs of the same host at once, so the
# peer and ours are measured in the same call on identical GPUs.
set -u
cd "$(dirname "$0")/.."
part=${1:?usage: bench/gpu_suite.sh speed|scaling|all|trace|weak|memory|tests|ws|rehearse}
out=${OUT:-bench/results}
mkdir -p "$out"
export PYTHONUNBUFFERED=1
n=$(python3 -c 'import torch; print(torch.cuda.device_count())')
echo "host: $n GPU(s); torch $(python3 -c 'import torch, triton; print(torch.__version__, "triton", triton.__version__)')"

case $part in
ws)  # within one device call's 600 s (the bench gets what the tests left); a hang costs only its
     # group, and -v names the test it hung in
  : >"$out/ws-tests.log"
  for group in "programs and forward" "programs and dx" "SM and forward" "SM and dx" non_finite; do
    timeout 60 python3 -m pytest -v -p no:cacheprovider -m gpu tests/kernels/test_grouped_mm_ws.py -k "$group" \
      2>&1 | grep -vE "^(=+ test session|platform|cachedir|rootdir|configfile|plugins|collect)" | cut -c1-240 \
      | tee -a "$out/ws-tests.log"
    echo "group '$group': exit ${PIPESTATUS[0]}" | tee -a "$out/ws-tests.log"
  done
  timeout $((570 - SECONDS)) python3 bench/kernels.py --tokens "${TOKENS:-8192,16384,32768}" --only up,down --backends triton,torch_raw \
    --ws --out "$out" --store '' 2>&1 | tee "$out/ws-kernels.log"
  ;;
rehearse)
  slug=$(python3 -c 'import torch, re; print(re.sub(r"[^a-z0-9]+", "-", torch.cuda.get_device_name(0).lower()).strip("-"))')
  runs=${RUNS:-pretrain-mula-1b pretrain-mula-7b-a1b pretrain-mula-20b-a2b pretrain-mula-100b-a7b pretrain-mula-220b-a10b}
  asked=${CHECKPOINTING:+--checkpointing $CHECKPOINTING}
  records="$out/rehearsal-$slug${CHECKPOINTING:+-${CHECKPOINTING//\//-}}.jsonl"  # its own file per asked mode
  python3 -m workflow.cli rehearse --experiment $runs --tiles ${TILES:-384 12288} $asked --jsonl "$records" \
    2>&1 | tee -a "$out/rehearsal.log"
  [ -n "${TILES:-}" ] || python3 -m workflow.cli rehearse --experiment $runs $asked --jsonl "$records" \
    2>&1 | tee -a "$out/rehearsal.log"
  ;;
all)
  bash "$0" speed && bash "$0" scaling
  ;;
speed)
  pids=()
  batches=${MICRO_BATCHES:-2}
  seq=${SEQ:-2048}  # the paper's context, ours and OLMo-core's
  olmo_core() {  # OLMo-core's step on GPU $1 at each micro-batch, its JSON lines appended to olmo-core.jsonl
    python3 -m pip install -q --no-index --no-deps --target /tmp/peers-site .peers/.whl/*.whl || return
    for mb in $batches; do
      (cd .peers && CUDA_VISIBLE_DEVICES=$1 PYTHONPATH=/tmp/peers-site:${PYTHONPATH:-} \
         timeout 300 python3 olmo_core_step.py --layers 8 --micro-batch "$mb" --seq "$seq" \
           >>"$out/olmo-core.jsonl" 2>>"$out/olmo-core.log")
    done
  }
  rm -f "$out/olmo-core.jsonl"
  if [ -d .peers/.whl ] && [ "$n" -ge 2 ]; then
    olmo_core $((n - 1)) &
    pids+=($!)
  elif [ -d .peers/.whl ]; then
    # One GPU: OLMo-core before and after ours (PEER_AFTER=0: before only, when the call's time
    # is short). Its median step moves between calls; the summary takes its faster run, the
    # ratio least favourable to us.
    olmo_core 0
  fi
  if [ "$n" -ge 3 ]; then
    CUDA_VISIBLE_DEVICES=1,2 timeout 540 python3 bench/distributed.py --suites ablation --out "$out" --store '' \
      >"$out/ablation.log" 2>&1 &
    pids+=($!)
  fi
  # OLMo-core's line is needed for the ratio: ours first, then wait for it.
  CUDA_VISIBLE_DEVICES=0 timeout 480 python3 bench/train_step.py --store '' --out "$out" ${VARIANTS:+--variants $VARIANTS} \
    --repeat "${REPEAT:-1}" --batch $batches --seq "$seq" \
    >"$out/train-step.log" 2>&1
  for pid in "${pids[@]}"; do wait "$pid"; done
  if [ -d .peers/.whl ] && [ "$n" -eq 1 ] && [ "${PEER_AFTER:-1}" = 1 ]; then olmo_core 0; fi
  CUDA_VISIBLE_DEVICES=0 python3 bench/train_step.py --store '' --out "$out" --summarize-only \
    --olmo-core-jsonl "$out/olmo-core.jsonl" >>"$out/train-step.log" 2>&1
  tail -n 30 "$out/train-step.log" "$out/ablation.log" "$out/olmo-core.log" 2>/dev/null | cut -c1-300
  ;;
memory)
  # this call's variants only: the file of this device (not the named results kept beside it)
  rm -f "$out/memory-$(python3 -c 'from bench.common import device_slug; print(device_slug("cuda"))').jsonl"
  : >"$out/memory.log"
  for variant in ${VARIANTS:-7b8l-triton+compile}; do
    CUDA_VISIBLE_DEVICES=0 timeout 300 python3 bench/memory_step.py --variant "$variant" --out "$out" \
      >>"$out/memory.log" 2>&1
  done
  grep -vE "^\{" "$out/memory.log" | cut -c1-200
  ;;
tests)
  timeout 540 python3 -m pytest -q -m "gpu and not multi_gpu" --continue-on-collection-errors tests/kernels tests/optimus_core tests/bench \
    >"$out/gpu-tests.log" 2>&1
  grep -E "passed|failed|FAILED|ERROR" "$out/gpu-tests.log" | tail -n 20 | cut -c1-300
  ;;
scaling)
  timeout 560 python3 bench/distributed.py --suites weak strong --out "$out" --store '' >"$out/scaling.log" 2>&1
  tail -n 40 "$out/scaling.log" | cut -c1-300
  ;;
weak)
  # Eager in turns (the points move ~4 % between launches), then with compiled blocks, which the
  # one-GPU benchmark uses and the EP dispatch's host waits break into pieces.
  timeout 300 python3 bench/distributed.py --suites weak --only 'weak-[12]$' --repeat 2 --out "$out" --store '' \
    >"$out/weak.log" 2>&1
  timeout 280 python3 bench/distributed.py --suites weak --only 'weak-[12]$' --compile --out "$out" --store '' \
    >>"$out/weak.log" 2>&1
  grep -E "^ +weak-|weak_efficiency" "$out/weak.log" | cut -c1-200
  ;;
trace)
  timeout 300 python3 bench/distributed.py --suites weak --only 'weak-[12]$' --trace "$out/traces" --out "$out" \
    --store '' >"$out/trace.log" 2>&1
  CUDA_VISIBLE_DEVICES=0 timeout 200 python3 bench/profile_step.py --trace "$out/traces" --out "$out" >>"$out/trace.log" 2>&1
  grep -E "weak-|kernels per step" "$out/trace.log" | cut -c1-300
  for f in "$out"/traces/*.gz "$out"/traces/*/*.gz; do
    [ -f "$f" ] && python3 bench/trace_gaps.py "$f" --top 12 --skip 1 | cut -c1-200
  done
  # what the second GPU adds, per launching op and kernel (rank 0 of each)
  one=$(ls "$out"/traces/weak-1/*rank0*.gz 2>/dev/null | head -1)
  two=$(ls "$out"/traces/weak-2/*rank0*.gz 2>/dev/null | head -1)
  [ -n "$one" ] && [ -n "$two" ] && python3 bench/trace_gaps.py "$one" "$two" --compare --top 16 | cut -c1-200
  ;;
*) echo "unknown part $part" >&2; exit 2 ;;
esac
