#!/usr/bin/env bash
# The GPU benchmarks of BENCHMARKS.md, one group at a time; JSON lines go to $OUT (default: bench-out/).
#
#   bash scripts/reproduce.sh learner-1m      # size1m vector, 16 x 64: ours, then torchrl's two configurations
#                                             # side by side (their warm-up is minutes of CPU compile)
#   bash scripts/reproduce.sh learner-12m     # size12m image, 16 x 64: the same
#   bash scripts/reproduce.sh learner-50m     # size50m image, 32 x 256: the same
#   bash scripts/reproduce.sh learner-200m    # size200m image, 32 x 256: ours, then torchrl's scan configuration
#   bash scripts/reproduce.sh learner-cl      # size200m, 32 x 256: ours, then ours and channels-last CNNs with
#                                             # cuDNN's algorithm search
#   bash scripts/reproduce.sh learner-autotune  # size1m vector, 16 x 64: ours, ours with inductor's combo kernels,
#                                             # ours with its Triton matmul templates (fewer launches?)
#   bash scripts/reproduce.sh learner-copt    # size1m vector, 16 x 64 (COPT_MODELS): ours, then ours with
#                                             # LaProp's step compiled too
#   bash scripts/reproduce.sh preset-costs    # the learner step at the DMC, Crafter and Atari presets' shapes,
#                                             # then what each preset's learner costs per 100K frames
#   bash scripts/reproduce.sh learner-fuse    # size12m and size50m images (FUSE_MODELS): ours, then ours with
#                                             # run.fuse_kernels (inductor's combo kernels)
#   bash scripts/reproduce.sh pipeline        # 64 emulated MineRL workers, size50m, one GPU, 50 ms per step:
#                                             # the server as a process, then as a thread (two rounds each)
#   bash scripts/reproduce.sh pipeline-0ms    # the same at 0 ms (learner-bound), process then thread;
#                                             # replay cost
#   bash scripts/reproduce.sh pipeline-16     # 16 workers at 50 ms (one per core), server as run.inference=auto
#   bash scripts/reproduce.sh pipeline-host   # 64 workers at 50 ms, the trainer's intra-op threads: default, 2
#   bash scripts/reproduce.sh pipeline-wait   # size200m, 64 workers at 50 ms: inference wait 2 ms, then 0
#   bash scripts/reproduce.sh dmc-inline      # dmc_proprio size1m, 16 envs inline: the training command's
#                                             # updates/s and learner busy, then bench_learner.py alone
#   bash scripts/reproduce.sh dmc-sources     # the same training command with each experience source for 120 s:
#                                             # inline, workers with the server in its process, in a thread;
#                                             # then bench_learner.py alone
#   bash scripts/reproduce.sh minecraft       # python -m dreamer.train +exp=minecraft env=emulated, 64 workers,
#                                             # 6 minutes (MINECRAFT_SECONDS), then its figures
#                                             # (scripts/run_figures.py)
#   bash scripts/reproduce.sh minecraft-4gpu  # the same with topology=4gpu for 8.5 minutes (a 4-GPU machine)
#   bash scripts/reproduce.sh minecraft-1gpu  # the same with topology=1gpu for 8.5 minutes, for the side by side
#   bash scripts/reproduce.sh server-threads  # the inference server's host copies by intra-op threads, then the
#                                             # Minecraft preset collecting only with run.inference_threads=0, 1
#   bash scripts/reproduce.sh envs            # env throughput with 1, 16 and 64 workers
#   bash scripts/reproduce.sh startup         # the worker source's start-up and memory, spawned against forked
#                                             # from the fork server (scripts/bench_startup.py): dmc_proprio
#                                             # with 16 workers, emulated Minecraft with 64
#   bash scripts/reproduce.sh ray             # emulated Minecraft collecting only at 50 ms per step: 64 worker
#                                             # processes, then 64, 128 and 256 Ray actors (a local cluster;
#                                             # RAY_RUNS), RAY_SECONDS each; RAY_TRAIN=1 then the Minecraft
#                                             # preset with Ray workers (training / collecting);
#                                             # RAY_PUMP=pipelined: the pumps' other mode (run.ray_pump)
#   bash scripts/reproduce.sh learn-dmc       # the learning set: dmc_proprio_paper, 6 tasks x 3 seeds to 100K frames,
#                                             # six runs at once under CUDA's MPS, 9 minutes per command:
#                                             # rerun until it says all runs finished, then LEARNING.md
#                                             # (scripts/learning_report.py). Runs resume from checkpoints on
#                                             # this machine's disk: chain the commands on one machine.
#   bash scripts/reproduce.sh learn-smoke     # the same chain on the CPU in minutes: 1 task x 3 seeds, smoke size
#
# MPS=1 before any group runs it under CUDA's multi-process service (learn-dmc: on unless MPS=0), e.g.
#   MPS=1 bash scripts/reproduce.sh minecraft  # the trainer and its inference server at once on one GPU
#
# Each group fits in one 10-minute command on an H200 (compile and capture warm-up included; torchrl's
# scan configuration alone warms up for about 4 minutes at 32 x 256). Each variant runs under its own
# time limit and reports one JSON line, or how long it ran without finishing.
set -euo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-bench-out}
mkdir -p "$OUT"
PY=${PYTHON:-python3}

# MPS=1: the group's processes share the GPU through CUDA's multi-process service, so that the kernels of
# several processes (runs side by side; a trainer and its inference server) run at once instead of taking
# turns. learn-dmc's default (LEARN_MPS, its older name, is read too); MPS=0 turns it off.
start_mps() {
  command -v nvidia-cuda-mps-control >/dev/null ||
    { echo "error: nvidia-cuda-mps-control is not installed; rerun with MPS=0"; exit 1; }
  export CUDA_MPS_PIPE_DIRECTORY=/tmp/dreamer-mps/pipe CUDA_MPS_LOG_DIRECTORY=/tmp/dreamer-mps/log
  mkdir -p "$CUDA_MPS_PIPE_DIRECTORY" "$CUDA_MPS_LOG_DIRECTORY"
  nvidia-cuda-mps-control -d || { echo "error: CUDA's MPS daemon did not start; rerun with MPS=0"; exit 1; }
  trap 'echo quit | nvidia-cuda-mps-control' EXIT
  echo "CUDA MPS on (its daemon quits when this script ends)"
}
mps_default=0
[ "${1:-}" = learn-dmc ] && mps_default=1
[ "${MPS:-${LEARN_MPS:-$mps_default}}" = 1 ] && start_mps

case "${1:-}" in
  learner-1m | learner-12m | learner-50m | learner-200m)
    model=size${1#learner-}
    shape=(--batch 32 --length 256 --obs image)
    [ "$model" = size1m ] && shape=(--batch 16 --length 64 --obs vector)
    [ "$model" = size12m ] && shape=(--batch 16 --length 64 --obs image)
    # torchrl's configurations compile for minutes (size1m: 148 s and 294 s; size50m: 225 s for the scan
    # one, and its whole-step one had not finished in 330 s): both run side by side after ours, 440 s each.
    # size200m: the scan configuration alone (two of torchrl's steppers at once would need 130+ GiB).
    variants=(--variant ours,torchrl_step,torchrl_scan --parallel --limit 440)
    [ "$model" = size1m ] && variants=(--variant ours,torchrl_step,torchrl_scan --parallel --limit 470)
    [ "$model" = size200m ] && variants=(--variant ours,torchrl_scan --limit 280)
    $PY scripts/bench_learner.py --device cuda --model "$model" "${shape[@]}" "${variants[@]}" \
      --kernel-tables "$OUT" --out "$OUT/learner-$model.jsonl"
    ;;
  learner-cl)
    # size200m, where cuDNN's convolutions take 108 of 286 ms: ours as it is, then ours and ours with
    # channels-last CNNs, both with cuDNN's algorithm search on (torch.backends.cudnn.benchmark).
    $PY scripts/bench_learner.py --device cuda --model size200m --batch 32 --length 256 --obs image \
      --variant ours --limit 190 --out "$OUT/learner-cl-size200m.jsonl"
    $PY scripts/bench_learner.py --device cuda --model size200m --batch 32 --length 256 --obs image \
      --variant ours,ours_cl --cudnn-benchmark --limit 190 --out "$OUT/learner-cl-size200m.jsonl"
    ;;
  preset-costs)
    # The learner step at each preset's shapes (cuDNN's search on, as in training runs), then the table of
    # what each preset's learner costs per 100K frames (scripts/preset_costs.py). PRESET_SHAPES: the shapes,
    # MODEL:vector or MODEL:C,H,W (an image), at 16 x 64 (the default: the five that the DMC, Crafter and
    # Atari presets use; each about 100 s, warm-up included; minecraft's size200m at 32 x 256 is learner-200m).
    for shape in ${PRESET_SHAPES:-size1m:vector size12m:vector size12m:3,64,64 size200m:3,64,64 size200m:1,96,96}; do
      IFS=: read -r model obs <<< "$shape"
      input=(--obs vector)
      [ "$obs" != vector ] && input=(--obs image --image "$obs")
      $PY scripts/bench_learner.py --device cuda --model "$model" --batch 16 --length 64 "${input[@]}" \
        --variant ours --cudnn-benchmark --no-flops --profile 2 --limit "${PRESET_LIMIT:-110}" \
        --out "$OUT/preset-costs.jsonl" || true
    done
    $PY scripts/preset_costs.py --measured "$OUT/preset-costs.jsonl" | tee "$OUT/preset-costs.md"
    ;;
  learner-fuse)
    # run.fuse_kernels (inductor's combo kernels and aggressive fusion; size1m: 1.14 x) at the image sizes,
    # ours then ours_fuse per model. FUSE_MODELS: the models (default size12m at 16 x 64 and size50m at
    # 32 x 256, which fit one command; size200m at 32 x 256 in a second: FUSE_MODELS=size200m).
    for model in ${FUSE_MODELS:-size12m size50m}; do
      shape=(--batch 32 --length 256 --obs image)
      [ "$model" = size12m ] && shape=(--batch 16 --length 64 --obs image)
      [ "$model" = size1m ] && shape=(--batch 16 --length 64 --obs vector)
      $PY scripts/bench_learner.py --device cuda --model "$model" "${shape[@]}" --variant ours,ours_fuse \
        --limit "${FUSE_LIMIT:-140}" --kernel-tables "$OUT" --out "$OUT/learner-fuse-$model.jsonl"
    done
    ;;
  learner-copt)
    # LaProp's step compiled too (bench_learner's ours_copt): whether inductor fuses the optimizer's list
    # operations and adaptive clipping's per-tensor multiply into fewer kernels than the eager foreach ones.
    # COPT_MODELS: the models (default size1m at 16 x 64; size200m at 32 x 256 fits a command of its own).
    for model in ${COPT_MODELS:-size1m}; do
      shape=(--batch 32 --length 256 --obs image --cudnn-benchmark)
      [ "$model" = size1m ] && shape=(--batch 16 --length 64 --obs vector)
      $PY scripts/bench_learner.py --device cuda --model "$model" "${shape[@]}" --variant ours,ours_copt \
        --limit "${COPT_LIMIT:-200}" --kernel-tables "$OUT" --out "$OUT/learner-copt-$model.jsonl"
    done
    ;;
  learner-autotune)
    # size1m is launch-bound (3,869 kernels in 8.8 ms): inductor's combo kernels put independent kernels of a
    # graph into one launch; its Triton matmul templates, timed against cuBLAS at compile, can take a matmul's
    # bias, tap and casts into its own kernel. Each variant under AUTOTUNE_LIMIT seconds (three fit 600).
    $PY scripts/bench_learner.py --device cuda --model size1m --batch 16 --length 64 --obs vector \
      --variant ours,ours_fuse,ours_autotune --limit "${AUTOTUNE_LIMIT:-190}" --kernel-tables "$OUT" \
      --out "$OUT/learner-autotune-size1m.jsonl"
    ;;
  pipeline)
    # Two rounds of collect-then-train phases: (b)/(a) moved by several % from phase to phase.
    $PY scripts/bench_pipeline.py --device cuda --model size50m --batch 32 --length 256 --envs 64 \
      --latency 0.05 --seconds 15 --rounds 2 --inference process --out "$OUT/pipeline-50ms-process.jsonl"
    $PY scripts/bench_pipeline.py --device cuda --model size50m --batch 32 --length 256 --envs 64 \
      --latency 0.05 --seconds 15 --rounds 2 --inference thread --out "$OUT/pipeline-50ms.jsonl"
    ;;
  pipeline-0ms)
    $PY scripts/bench_pipeline.py --device cuda --model size50m --batch 32 --length 256 --envs 64 \
      --latency 0 --seconds 10 --inference process --out "$OUT/pipeline-0ms-process.jsonl"
    $PY scripts/bench_pipeline.py --device cuda --model size50m --batch 32 --length 256 --envs 64 \
      --latency 0 --seconds 10 --inference thread --out "$OUT/pipeline-0ms.jsonl"
    $PY scripts/bench_replay.py --device cuda --out "$OUT/replay.jsonl" --profile "$OUT/replay-profile.txt"
    ;;
  pipeline-16)
    $PY scripts/bench_pipeline.py --device cuda --model size50m --batch 32 --length 256 --envs 16 \
      --latency 0.05 --seconds 25 --out "$OUT/pipeline-50ms-16.jsonl"
    ;;
  pipeline-host)
    # 64 workers at 50 ms, the trainer process's torch intra-op threads: torch's default, then 2
    for threads in 0 2; do
      $PY scripts/bench_pipeline.py --device cuda --model size50m --batch 32 --length 256 --envs 64 \
        --latency 0.05 --seconds 25 --inference thread --threads "$threads" \
        --out "$OUT/pipeline-50ms-threads$threads.jsonl"
    done
    ;;
  pipeline-wait)
    # size200m, 64 workers at 50 ms, the server in its process: run.inference_wait_ms 2 then 0, with where
    # a worker's step goes (worker_step_ms); the learner uncompiled (its warm-up in seconds)
    for wait in 2 0; do
      $PY scripts/bench_pipeline.py --device cuda --model size200m --batch 32 --length 256 --envs 64 \
        --latency 0.05 --seconds 15 --overhead-updates 5 --no-compile --inference process \
        --inference-wait-ms "$wait" --out "$OUT/pipeline-size200m-wait$wait.jsonl"
    done
    ;;
  dmc-inline)
    # DeepMind Control proprio, size1m, 16 envs inline, action repeat 1 (the reference's), train_ratio 1024:
    # the training command for 200 s, its figures (scripts/run_figures.py), then the learner step alone at
    # the same shape (bench_learner.py). MUJOCO_GL=disabled: proprio needs no renderer.
    MUJOCO_GL=disabled timeout --foreground --signal=INT -k 30 200 $PY -m dreamer.train +exp=dmc_proprio \
      model=size1m env.task=walker_walk run.envs=16 env.repeat=1 run.log_every=2000 run.eval_every=0 \
      run.eval_episodes=0 hydra.run.dir="$OUT/dmc-inline-run" > "$OUT/dmc-inline.log" 2>&1 || true
    $PY scripts/run_figures.py "$OUT/dmc-inline-run" --out "$OUT/dmc-inline.jsonl"
    $PY scripts/bench_learner.py --device cuda --model size1m --batch 16 --length 64 --obs vector \
      --variant ours --limit 180 --out "$OUT/dmc-inline-learner.jsonl"
    ;;
  dmc-sources)
    # DMC_SOURCES and DMC_SECONDS override the sources and each one's seconds (compile warm-up included).
    for source in ${DMC_SOURCES:-inline workers-process workers-thread}; do
      args=(run.collect=inline)
      [ "$source" != inline ] && args=(run.collect=workers "run.inference=${source#workers-}")
      MUJOCO_GL=disabled timeout --foreground --signal=INT -k 30 "${DMC_SECONDS:-120}" $PY -m dreamer.train +exp=dmc_proprio \
        model=size1m env.task=walker_walk "${args[@]}" run.log_every=2000 run.eval_every=0 run.eval_episodes=0 \
        hydra.run.dir="$OUT/dmc-$source-run" > "$OUT/dmc-$source.log" 2>&1 || true
      rm -rf "$OUT/dmc-$source-run/checkpoints"
      $PY scripts/run_figures.py "$OUT/dmc-$source-run" --out "$OUT/dmc-sources.jsonl"
    done
    $PY scripts/bench_learner.py --device cuda --model size1m --batch 16 --length 64 --obs vector \
      --variant ours --limit 100 --out "$OUT/dmc-sources-learner.jsonl"
    ;;
  minecraft | minecraft-4gpu | minecraft-1gpu)
    # Collection fills 65,536 steps first (run.train_start), then trains; SIGINT at the end saves and stops.
    # --foreground: the signal goes to the trainer alone, which stops its workers itself.
    seconds=${MINECRAFT_SECONDS:-360} topology=()
    [ "$1" != minecraft ] && seconds=${MINECRAFT_SECONDS:-510} topology=("topology=${1#minecraft-}")
    export NCCL_NVLS_ENABLE=0  # NVLink multicast stays off
    timeout --foreground --signal=INT -k 30 "$seconds" $PY -m dreamer.train +exp=minecraft env=emulated \
      "${topology[@]}" run.log_every=8192 hydra.run.dir="$OUT/$1-run" > "$OUT/$1.log" 2>&1 || true
    tail -n 30 "$OUT/$1.log"
    $PY scripts/run_figures.py "$OUT/$1-run" --out "$OUT/$1.jsonl"
    ;;
  server-threads)
    # The inference server's host copies by its process's intra-op threads (scripts/bench_server_copies.py,
    # beside SERVER_BUSY busy processes), then the Minecraft preset collecting only (no update:
    # run.train_start past the run; a replay of 200K records holds what 110 s collect) with the server on
    # torch's default threads and on one, SERVER_SECONDS each; then their figures. SERVER_THREADS="1" runs
    # the preset on one thread only; SERVER_COPIES=0 skips the copies' benchmark (collection alone, e.g. two
    # commits side by side: run this group in each commit's tree).
    if [ "${SERVER_COPIES:-1}" != 0 ]; then
      $PY scripts/bench_server_copies.py --threads 0,1 --busy "${SERVER_BUSY:-8}" --passes 1000 \
        | tee "$OUT/server-copies.jsonl"
    fi
    for threads in ${SERVER_THREADS:-0 1}; do
      timeout --foreground --signal=INT -k 30 "${SERVER_SECONDS:-110}" $PY -m dreamer.train +exp=minecraft env=emulated \
        run.compile=false run.train_start=100000000 replay.size=200000 run.log_every=8192 run.inference_threads=$threads \
        hydra.run.dir="$OUT/server-threads$threads-run" > "$OUT/server-threads$threads.log" 2>&1 || true
      rm -rf "$OUT/server-threads$threads-run/checkpoints"
      $PY scripts/run_figures.py "$OUT/server-threads$threads-run" --collecting --out "$OUT/server-threads.jsonl" ||
        echo "run.inference_threads=$threads: no figures (its log: $OUT/server-threads$threads.log)"
    done
    ;;
  ray)
    # Collecting only (no update: run.train_start past the run), the server on one intra-op thread, each run
    # SIGINTed after RAY_SECONDS; scripts/run_figures.py --collecting gives its env steps/s. Replay: 200K records
    # (at 256 envs still 781 per stream). A Ray run needs the longer time: on the H100 machine 90 s left a run of
    # 64 actors 7 s of collecting after its start-up (the placement line says how long Ray's start took).
    collect_run() {  # collect_run SOURCE ENVS [ENVS_PER_PUMP]
      local name="$1-$2${3:+-$3}"
      timeout --foreground --signal=INT -k 60 "${RAY_SECONDS:-200}" $PY -m dreamer.train +exp=minecraft env=emulated \
        run.compile=false run.train_start=100000000 replay.size=200000 run.log_every=8192 run.inference_threads=1 \
        run.collect="$1" run.envs="$2" ${3:+run.ray_envs_per_pump=$3} ${RAY_PUMP:+run.ray_pump=$RAY_PUMP} \
        hydra.run.dir="$OUT/ray-$name-run" \
        > "$OUT/ray-$name.log" 2>&1 || true
      rm -rf "$OUT/ray-$name-run/checkpoints"
      grep -h "Ray env workers on\|stepping" "$OUT/ray-$name.log" || true
      $PY scripts/run_figures.py "$OUT/ray-$name-run" --collecting --out "$OUT/ray.jsonl" ||
        echo "$name: no figures (its log: $OUT/ray-$name.log)"
    }
    # RAY_RUNS: SOURCE:ENVS or ray:ENVS:ENVS_PER_PUMP (run.ray_envs_per_pump; the config's 32 without it), run in
    # turn (a long list may need two commands of 10 minutes). RAY_PUMP: run.ray_pump of every Ray run (sweep,
    # pipelined; the config's without it).
    for run in ${RAY_RUNS:-workers:64 ray:64 ray:128 ray:256}; do
      IFS=: read -r source envs per_pump <<< "$run"
      collect_run "$source" "$envs" "$per_pump"
    done
    if [ "${RAY_TRAIN:-0}" = 1 ]; then
      timeout --foreground --signal=INT -k 60 "${MINECRAFT_SECONDS:-360}" $PY -m dreamer.train +exp=minecraft \
        env=emulated run.collect=ray ${RAY_PUMP:+run.ray_pump=$RAY_PUMP} run.log_every=8192 hydra.run.dir="$OUT/ray-train-run" \
        > "$OUT/ray-train.log" 2>&1 || true
      $PY scripts/run_figures.py "$OUT/ray-train-run" --out "$OUT/ray-train.jsonl"
    fi
    ;;
  learn-dmc | learn-smoke)
    # LEARN_PRESET, LEARN_TASKS, LEARN_SEEDS, LEARN_SECONDS, LEARN_PARALLEL, LEARN_VARIANTS override the set
    # (LEARN_ROUND_FRAMES too, below; MPS: see start_mps); runs go
    # to $OUT/<group>/. LEARN_DIAGNOSE=1: after the set's command, scripts/diagnose_learning.py on each run.
    # LEARN_ARCHIVE=FILE.tgz: then every run's records (metrics, config, commit, logs, diagnoses; no checkpoints)
    # in one archive, e.g. under a GPU machine's $OUT. A finished run's folder holding only its records is
    # skipped by the next command (learn.py): unpack an archive's finished runs into $OUT to go on elsewhere.
    parallel=1
    if [ "$1" = learn-dmc ]; then
      # One H200, under MPS (on by default here): six dmc_proprio_paper runs at once made 28 to 29 updates/s
      # each, a seed of all six tasks to 100K frames in two 9-minute commands (LEARNING.md); dmc_proprio made
      # 1.61 x the updates of one alone with three at once and 2.35 x with six (BENCHMARKS.md).
      parallel=6
      # The recipe behind the reference's published curves (README, "Which DeepMind Control recipe matches the
      # reference's curves"); LEARN_PRESET=dmc_proprio runs its current config instead. LEARN_FRAMES: frames
      # per run (agent steps x the preset's action repeat).
      preset=${LEARN_PRESET:-dmc_proprio_paper}
      tasks=${LEARN_TASKS:-walker_walk,cartpole_swingup,cartpole_balance,reacher_easy,finger_spin,ball_in_cup_catch}
      # LEARN_ROUND_FRAMES: one round of the runs' episodes (16 envs x 1,000 frames); no command stops a run
      # within its last round (learn.py --round-frames), so its last training returns end at its length.
      set_args=(--frames "${LEARN_FRAMES:-100000}" --seconds "${LEARN_SECONDS:-540}"
                --round-frames "${LEARN_ROUND_FRAMES:-16000}" -- run.log_every=2000)
      points=50000,100000
    else
      preset=${LEARN_PRESET:-dmc_proprio}
      tasks=${LEARN_TASKS:-cartpole_balance}
      set_args=(--steps 400 --seconds "${LEARN_SECONDS:-600}" --min-start 10 -- +debug=smoke run.log_every=100
                run.eval_every=200 run.compile=false)
      points=200,400
    fi
    export MUJOCO_GL=${MUJOCO_GL:-disabled}  # proprio needs no renderer
    variants=()  # LEARN_VARIANTS="name:overrides|name:overrides": an A/B of every task and seed (learn.py --variant)
    # Several runs at once collect inline: the worker source's 16 processes and server per run took 100 to
    # 170 s after each command's warm-up to reach speed with six runs on one H200 (inline: 3 s), and in the
    # same 480 s an inline run made 14 % more updates (BENCHMARKS.md, "start-up"); one run alone keeps the
    # preset's worker source (its learner is busier).
    [ "${LEARN_PARALLEL:-$parallel}" -gt 1 ] && set_args+=(run.collect=inline)
    IFS='|' read -r -a given <<< "${LEARN_VARIANTS:-}"
    for variant in "${given[@]}"; do [ -n "$variant" ] && variants+=(--variant "$variant"); done
    $PY scripts/learn.py --dir "$OUT/$1" --preset "$preset" --tasks "$tasks" --seeds "${LEARN_SEEDS:-0,1,2}" \
      --parallel "${LEARN_PARALLEL:-$parallel}" "${variants[@]}" "${set_args[@]}" | tee -a "$OUT/$1.log"
    if [ "${LEARN_DIAGNOSE:-0}" = 1 ]; then  # each run's beliefs against an episode (scripts/diagnose_learning.py)
      for run in "$OUT/$1"/*/; do
        [ -d "$run/checkpoints" ] && { $PY scripts/diagnose_learning.py "$run" --episodes 1 || true; }
      done
    fi
    if grep -q "runs finished$" <(tail -n 1 "$OUT/$1.log"); then
      $PY scripts/learning_report.py "$OUT/$1" --out "$OUT/$1/LEARNING.md" --frames "$points"
    fi
    if [ -n "${LEARN_ARCHIVE:-}" ]; then  # the set's records without its checkpoints and replay, to carry off the machine
      archive=$(realpath -m "$LEARN_ARCHIVE")
      (cd "$OUT" && find "$1" "$1.log" -maxdepth 2 -type f \( -name metrics.jsonl -o -name '*.yaml' -o -name commit \
        -o -name variant -o -name 'diagnosis-*.json' -o -name '*.log' -o -name LEARNING.md -o -name '*.png' \) -print0 |
        tar czf "$archive" --null -T -)
      echo "records of $(find "$OUT/$1" -mindepth 2 -maxdepth 2 -name metrics.jsonl | wc -l) runs in $archive"
    fi
    ;;
  startup)
    export MUJOCO_GL=${MUJOCO_GL:-disabled}  # proprio needs no renderer
    $PY scripts/bench_startup.py --envs 16 -- +exp=dmc_proprio run.compile=false run.steps=10000000 \
      | tee "$OUT/startup-dmc.txt"
    $PY scripts/bench_startup.py --envs 64 -- +exp=minecraft env=emulated run.compile=false run.steps=100000000 \
      | tee "$OUT/startup-minecraft.txt"
    ;;
  envs)
    $PY scripts/bench_envs.py --suite emulated --workers 1,16,64 --seconds 6 | tee "$OUT/envs-emulated.txt"
    $PY scripts/bench_envs.py --suite crafter --workers 1,16,64 --seconds 6 | tee "$OUT/envs-crafter.txt"
    ;;
  *)
    sed -n '2,/^# MPS=1 before/p' "$0"
    exit 2
    ;;
esac
