#!/usr/bin/env bash
# Multi-host GPU VMs in the cloud (or any hosts you can ssh into): one process per VM, driving all
# of its GPUs. Run from a machine that can ssh into every host; the repository and a shared (or
# cloud-storage) checkpoint directory must exist at the same path on each.
#   examples/multihost/cloud_gpu.sh host0 host1 [host2 ...] -- [train_gpt.py arguments]
#
# The same three variables launch it on Kubernetes: an Indexed Job (or JobSet) with one pod per VM
# sets JAX_PROCESS_ID=$JOB_COMPLETION_INDEX, JAX_NUM_PROCESSES=<completions> and
# JAX_COORDINATOR_ADDRESS=<pod 0's headless-service name>:1234. On Cloud TPU VMs and GKE TPU
# slices jax.distributed.initialize() needs no variables at all.
set -euo pipefail
hosts=()
while (( $# )) && [[ $1 != -- ]]; do hosts+=("$1"); shift; done
(( $# )) && shift
(( ${#hosts[@]} )) || { echo "usage: $0 HOST0 HOST1 ... -- [train_gpt.py args]" >&2; exit 2; }
PORT=${PORT:-1234}
REPO=${REPO:-$PWD}
args=$(printf ' %q' "$@")
pids=()
for i in "${!hosts[@]}"; do
  ssh "${hosts[$i]}" "cd $REPO && JAX_COORDINATOR_ADDRESS=${hosts[0]}:$PORT JAX_NUM_PROCESSES=${#hosts[@]} \
    JAX_PROCESS_ID=$i python -u examples/multihost/train_gpt.py$args" 2>&1 | sed "s/^/[${hosts[$i]}] /" &
  pids+=($!)
done
status=0
for pid in "${pids[@]}"; do wait "$pid" || status=$?; done
exit $status
