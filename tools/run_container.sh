#!/usr/bin/env bash
# Runs main.py inside a Singularity/Apptainer image, forwarding every argument to main.py.
#
#   IMAGE=neuron_inverter_ipu.sif DATA_DIR=/data tools/run_container.sh --model=neuron_inverter \
#       --data_path=/data/witness2c_excite.cellSpike_4prB8kHz.data.h5 --replicas=4
#
# Environment:
#   IMAGE        the .sif image (default: neuron_inverter_ipu.sif)
#   DATA_DIR     host folder with the datasets, bound at the same path (optional)
#   CACHE_DIR    the cache root (default: $XDG_CACHE_HOME, else ~/.cache): the container's main.py gets
#                XDG_CACHE_HOME=$CACHE_DIR, so its default caches are CACHE_DIR/neuron_inverter (the
#                built-in dataset) and CACHE_DIR/neuron_inverter/executables, as on the host; that
#                folder is bound. No --data_cache flag: main.py refuses it for --model=mnist.
#   LOG_DIR      a folder for run outputs (default: ./logs), bound at the same path; pass
#                --logdir=$LOG_DIR/<run> (the current folder is bound by the runtime anyway)
#   CONTAINER_GPU=1   add --nv (NVIDIA GPUs) for the stock TensorFlow image
#   SINGULARITY  the runtime (default: apptainer if installed, else singularity)
# The IPU-over-fabric configuration /etc/ipuof.conf.d is bound when the host has it, so the
# container's Poplar finds the IPUs of this partition.
set -euo pipefail

image=${IMAGE:-neuron_inverter_ipu.sif}
cache_root=${CACHE_DIR:-${XDG_CACHE_HOME:-$HOME/.cache}}
# CACHE_DIR may also name the application's cache folder itself (as ~/.cache/neuron_inverter): a folder
# of that name is taken as that folder; one that holds those caches under another name is refused, not
# left for a new, empty folder (the dataset generated again, every executable compiled again).
if [ -n "${CACHE_DIR:-}" ] && [ "$(basename "$CACHE_DIR")" = neuron_inverter ]; then
  cache_root=$(dirname "$CACHE_DIR")
elif [ -n "${CACHE_DIR:-}" ] && { [ -d "$CACHE_DIR/executables" ] || compgen -G "$CACHE_DIR/cellspike-*" >/dev/null; }; then
  echo "error: CACHE_DIR=$CACHE_DIR holds the application's caches directly, as CACHE_DIR meant before;" \
       "it now names their root (they go in CACHE_DIR/neuron_inverter): move them into" \
       "$CACHE_DIR/neuron_inverter, or name a folder called neuron_inverter" >&2
  exit 1
fi
cache_dir=$cache_root/neuron_inverter
log_dir=${LOG_DIR:-$PWD/logs}
runtime=${SINGULARITY:-$(command -v apptainer >/dev/null 2>&1 && echo apptainer || echo singularity)}
if ! command -v "$runtime" >/dev/null 2>&1; then
  if [ -n "${SINGULARITY:-}" ]; then
    echo "error: SINGULARITY=$runtime: no such command on the PATH" >&2
  else
    echo "error: neither apptainer nor singularity is on the PATH: install one (or load its module), or name it with SINGULARITY=" >&2
  fi
  exit 1
fi
case $image in
  *://*) ;;  # docker://, oras://, library://: the runtime fetches it
  *) [ -e "$image" ] || { echo "error: IMAGE=$image: no such image (build one from tools/containers/, docs/hpc.md)" >&2; exit 1; } ;;
esac
mkdir -p "$cache_dir" "$log_dir"

binds=()
[ -d /etc/ipuof.conf.d ] && binds+=(--bind /etc/ipuof.conf.d)
[ -n "${DATA_DIR:-}" ] && binds+=(--bind "$DATA_DIR:$DATA_DIR")
binds+=(--bind "$cache_dir:$cache_dir" --bind "$log_dir:$log_dir")
gpu=()
[ "${CONTAINER_GPU:-0}" = 1 ] && gpu=(--nv)

# ${gpu[@]+...}: an empty array is "unbound" to `set -u` in older bash.
# The caches through XDG_CACHE_HOME, not flags: --data_cache is refused by models without the built-in
# dataset. `env` sets it with any runtime version (Apptainer's --env is not in older Singularity).
exec "$runtime" exec ${gpu[@]+"${gpu[@]}"} "${binds[@]}" "$image" \
    env XDG_CACHE_HOME="$cache_root" python3 /opt/neuron_inverter/main.py "$@"
