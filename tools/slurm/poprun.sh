#!/bin/bash
# Multi-instance IPU training with poprun: I host processes (instances) share R replicas of P IPUs.
#   tools/slurm/poprun.sh INSTANCES REPLICAS IPUS_PER_REPLICA [more main.py flags]
#   e.g. srun --ipus=8 tools/slurm/poprun.sh 2 4 2 --pipeline_stages=2 --gradient_accumulation=8
# popdist decides the replicas (main.py takes poprun's count) and each instance reads its own shards.
# POPRUN_ARGS: more poprun options, word-split, e.g. the V-IPU partition and server where poprun cannot
# find them itself: POPRUN_ARGS="--vipu-partition=slurm_1234 --vipu-server-host=10.1.3.101".
set -euo pipefail
instances=${1:?instances}; replicas=${2:?replicas}; ipus_per_replica=${3:?IPUs per replica}
shift 3
cache=${CACHE_DIR:-$HOME/.cache/neuron_inverter/executables}
command -v poprun >/dev/null 2>&1 || {
  echo "error: poprun is not on the PATH: it comes with the Poplar SDK (source <sdk>/enable first)" >&2; exit 1; }
# shellcheck disable=SC2086  # POPRUN_ARGS is a list of options
exec poprun ${POPRUN_ARGS:-} --num-instances="$instances" --num-replicas="$replicas" \
    --ipus-per-replica="$ipus_per_replica" --executable-cache-path="$cache" \
    python3 main.py --model=neuron_inverter --backend=ipu --replicas="$replicas" \
    --ipus_per_replica="$ipus_per_replica" "$@"
