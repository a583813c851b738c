#!/usr/bin/env bash
# Minecraft on a Slurm allocation: the Ray head and the trainer on the first node (its GPUs), Ray workers on
# the others (their CPUs host the env actors). Every node runs the dreamer image or has the package, JDK 8
# and MineRL installed (README, "Env workers on a Ray cluster").
#
#   sbatch --nodes=3 --exclusive scripts/ray_slurm.sh [overrides of python -m dreamer.train ...]
#
# RUN_IN prefixes every command on a node, e.g. RUN_IN="apptainer exec --nv dreamer.sif" (the image as a
# Singularity/Apptainer file); empty where the package is installed on the nodes. RAY_PORT: the head's port.
# HEAD_ENV_CPUS: CPUs of the first node that env actors may use (0: none, the GPU node keeps its cores for
# the trainer and the inference server). The run's token (RAY_AUTH_TOKEN) is made here and passed to every
# node through the environment: Ray 2.60 enforces token authentication.
#SBATCH --job-name=dreamer-minecraft
#SBATCH --ntasks-per-node=1
#SBATCH --output=dreamer-%j.log
set -euo pipefail

run_in=${RUN_IN:-}
port=${RAY_PORT:-6379}
mapfile -t nodes < <(scontrol show hostnames "$SLURM_JOB_NODELIST")
head=${nodes[0]}
export RAY_AUTH_MODE=token
RAY_AUTH_TOKEN=$(python3 -c "import secrets; print(secrets.token_hex(32))")
export RAY_AUTH_TOKEN

echo "Ray head on $head:$port; workers on ${nodes[*]:1}"
# shellcheck disable=SC2086  # RUN_IN is a command prefix: split on purpose
srun --nodes=1 --ntasks=1 -w "$head" $run_in ray start --head --port="$port" \
  --num-cpus="${HEAD_ENV_CPUS:-0}" --include-dashboard=false --block &
sleep 30
for node in "${nodes[@]:1}"; do
  # Under a virtual X server: the env actors' MineRL instances open a window.
  # shellcheck disable=SC2086
  srun --nodes=1 --ntasks=1 -w "$node" $run_in xvfb-run -a ray start --address="$head:$port" --block &
done
sleep 30
status=0
# shellcheck disable=SC2086
srun --nodes=1 --ntasks=1 -w "$head" --overlap $run_in xvfb-run -a \
  python -m dreamer.train +exp=minecraft run.collect=ray run.ray_address="$head:$port" "$@" || status=$?
# The trainer has ended its actors; the Ray processes end with the job (Slurm ends its remaining steps).
exit $status
