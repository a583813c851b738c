#!/usr/bin/env bash
# The GPU benchmarks of BENCHMARKS.md, one group at a time; JSON lines go to $OUT (default: bench-out/).
#
#   bash scripts/reproduce.sh learner-1m      # size1m vector, 16 x 64: ours vs torchrl's scan configuration
#   bash scripts/reproduce.sh learner-12m     # size12m image, 16 x 64: the same
#   bash scripts/reproduce.sh learner-50m     # size50m image, 32 x 256: the same
#   bash scripts/reproduce.sh learner-200m    # size200m image, 32 x 256: the same
#   bash scripts/reproduce.sh learner-cl      # ours with channels-last CNNs at both 32 x 256 sizes
#   bash scripts/reproduce.sh pipeline        # 64 emulated MineRL workers, size50m, one GPU: 50 ms with the
#                                             # server as a thread, then as a process; 0 ms (thread); replay cost
#   bash scripts/reproduce.sh pipeline-16     # 16 workers at 50 ms (one per core), server as a thread
#   bash scripts/reproduce.sh pipeline-host   # 64 workers at 50 ms, the trainer's host side: chunks added
#                                             # in the ingest thread, then inline; then 2 intra-op threads
#   bash scripts/reproduce.sh minecraft       # python -m dreamer.train +exp=emulated, 64 workers, a few minutes
#   bash scripts/reproduce.sh envs            # env throughput with 1, 16 and 64 workers
#
# Each group fits in one 10-minute command on an H200 (compile and capture warm-up included; torchrl's
# scan configuration alone warms up for about 4 minutes at 32 x 256). Each variant runs under its own
# time limit and reports one JSON line, or how long it ran without finishing.
set -euo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-bench-out}
mkdir -p "$OUT"
PY=${PYTHON:-python3}

case "${1:-}" in
  learner-1m | learner-12m | learner-50m | learner-200m)
    model=size${1#learner-}
    shape=(--batch 32 --length 256 --obs image)
    [ "$model" = size1m ] && shape=(--batch 16 --length 64 --obs vector)
    [ "$model" = size12m ] && shape=(--batch 16 --length 64 --obs image)
    # size1m: torchrl's scan configuration has not warmed up within 160 s there; give it 400 s.
    limit=280
    [ "$model" = size1m ] && limit=400
    $PY scripts/bench_learner.py --device cuda --model "$model" "${shape[@]}" --variant ours,torchrl_scan \
      --limit "$limit" --out "$OUT/learner-$model.jsonl"
    ;;
  learner-cl)
    for model in size50m size200m; do
      $PY scripts/bench_learner.py --device cuda --model $model --batch 32 --length 256 --obs image \
        --variant ours_cl --limit 250 --out "$OUT/learner-cl-$model.jsonl"
    done
    ;;
  pipeline)
    $PY scripts/bench_pipeline.py --device cuda --model size50m --batch 32 --length 256 --envs 64 \
      --latency 0.05 --seconds 25 --inference thread --out "$OUT/pipeline-50ms.jsonl"
    $PY scripts/bench_pipeline.py --device cuda --model size50m --batch 32 --length 256 --envs 64 \
      --latency 0.05 --seconds 25 --inference process --out "$OUT/pipeline-50ms-process.jsonl"
    $PY scripts/bench_pipeline.py --device cuda --model size50m --batch 32 --length 256 --envs 64 \
      --latency 0 --seconds 15 --inference thread --out "$OUT/pipeline-0ms.jsonl"
    $PY scripts/bench_replay.py --device cuda --out "$OUT/replay.jsonl" --profile "$OUT/replay-profile.txt"
    ;;
  pipeline-16)
    $PY scripts/bench_pipeline.py --device cuda --model size50m --batch 32 --length 256 --envs 16 \
      --latency 0.05 --seconds 25 --out "$OUT/pipeline-50ms-16.jsonl"
    ;;
  pipeline-host)
    for variant in "thread 0" "inline 0" "thread 2"; do
      set -- $variant
      $PY scripts/bench_pipeline.py --device cuda --model size50m --batch 32 --length 256 --envs 64 \
        --latency 0.05 --seconds 25 --inference thread --ingest "$1" --threads "$2" \
        --out "$OUT/pipeline-50ms-ingest-$1-threads$2.jsonl"
    done
    ;;
  minecraft)
    # Collection fills 65,536 steps first (run.train_start), then trains; Ctrl-C (SIGINT) after 400 s saves and stops.
    timeout --signal=INT 400 $PY -m dreamer.train +exp=emulated run.steps=200000 replay.size=300000 \
      hydra.run.dir="$OUT/minecraft-run" > "$OUT/minecraft.log" 2>&1 || true
    tail -n 30 "$OUT/minecraft.log"
    ;;
  envs)
    $PY scripts/bench_envs.py --suite emulated --workers 1,16,64 --seconds 6 | tee "$OUT/envs-emulated.txt"
    $PY scripts/bench_envs.py --suite crafter --workers 1,16,64 --seconds 6 | tee "$OUT/envs-crafter.txt"
    ;;
  *)
    sed -n '2,17p' "$0"
    exit 2
    ;;
esac
