#!/usr/bin/env bash
# Try the multi-host recipe on one machine: N processes x D simulated CPU devices, gloo collectives.
#   examples/multihost/local_cpu.sh [N=2] [D=4] [extra train_gpt.py arguments...]
# e.g. examples/multihost/local_cpu.sh 2 4 --steps 6 --ckpt-dir /tmp/gpt-ckpt
#      examples/multihost/local_cpu.sh 1 4 --steps 10 --ckpt-dir /tmp/gpt-ckpt   # resume on 4 devices
set -euo pipefail
cd "$(dirname "$0")/../.."
N=${1:-2}; D=${2:-4}; shift $(( $# > 2 ? 2 : $# ))
PORT=$(python -c 'import socket; s = socket.socket(); s.bind(("localhost", 0)); print(s.getsockname()[1])')
export JAX_PLATFORMS=cpu XLA_FLAGS="--xla_force_host_platform_device_count=$D" PYTHONPATH="$PWD"
export JAX_COORDINATOR_ADDRESS="localhost:$PORT" JAX_NUM_PROCESSES="$N"
pids=()
for ((i = 0; i < N; i++)); do
  JAX_PROCESS_ID=$i python examples/multihost/train_gpt.py "$@" &
  pids+=($!)
done
status=0
for pid in "${pids[@]}"; do wait "$pid" || status=$?; done
exit $status
