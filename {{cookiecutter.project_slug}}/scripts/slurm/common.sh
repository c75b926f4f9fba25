# shellcheck shell=bash
# Shared by scripts/slurm/*.sbatch, which source it from the project root; not run on its own.
#
# job_setup "$@" sets, from SLURM's variables (or placeholders outside an allocation, for DRY_RUN):
#   NODES (host names, in SLURM_NODEID order)  NNODES (their count, or the environment's MIN:MAX)
#   HEAD (first node)  MASTER_PORT
#   NPROC_PER_NODE (processes per node: GPUs SLURM gave the node, unless set)
#   CPUS_PER_TASK (the node's CPUs: SLURM_CPUS_PER_TASK, from #SBATCH --cpus-per-task), exported as
#     SRUN_CPUS_PER_TASK (srun takes it from there since Slurm 22.05, not from the allocation) and
#     OMP_NUM_THREADS (an equal share per process, unless set; torchrun would set 1)
#   MAX_RESTARTS (default 1: the launcher restarts the processes of a failed node once, from the
#     newest checkpoint, e.g. at a smaller micro batch after an out-of-memory error)
#   JOB_ID (this job as scancel and scontrol name it: <array job id>_<task index> in a job array,
#     whose bare job id would name every task of the array, else SLURM_JOB_ID)
#   OUTPUT_DIR (default runs/<JOB_ID>: the same folder after a requeue)
#   TRAIN_ARGS (--config, --output_dir, --resume_from_checkpoint auto, then the script's arguments)
#   CONTAINER_SRUN, CONTAINER_EXEC, STEP_ENV (container_setup, below)
# An elastic range NNODES=MIN:MAX (torchrun.sbatch) must hold the allocation's node count; srun then
# keeps the other nodes' launchers running when one node's ends (--no-kill; submit with
# `sbatch --no-kill` so that SLURM keeps the job when it loses a node).
# launch_on_nodes NODE_CMD runs NODE_CMD once per node under srun; `\$SLURM_NODEID` in it is
# expanded on each node (its node rank). DRY_RUN=1 prints each node's command instead.
#
# Containers: CONTAINER_IMAGE=<image> runs each node's command with pyxis (srun --container-image:
# an image as pyxis names it, nvcr.io#nvidia/pytorch:25.10-py3 or docker://..., or a .sqsh file);
# APPTAINER_IMAGE=<file.sif> under `apptainer exec --nv`. Either mounts, each at its own path, the
# project (the working directory), OUTPUT_DIR and DATA_CACHE_DIR (set, it is also --data_cache_dir)
# where they lie outside it, and CONTAINER_CACHE (default ~/.cache) at /cache, where the image keeps
# HF_HOME and WANDB_DIR (Containerfile). DRY_RUN shows the options without looking for the image.
#
# Preemption: SLURM sends USR1 to this batch shell 120 s before the time limit (#SBATCH
# --signal=B:USR1@120). A checkpoint that takes longer to write needs a longer lead: submit with
# `sbatch --signal=B:USR1@600` or SBATCH_SIGNAL=B:USR1@600 (either overrides the #SBATCH line; keep
# `B:`, which sends the signal to this shell). The trap passes it to every process of the job step;
# the launchers ignore it (trap '' USR1) and the training processes stop at the next optimizer step
# with a checkpoint and exit 0; the job is then requeued, and on restart `--resume_from_checkpoint
# auto` continues from that checkpoint. Signal and requeue name the job as JOB_ID: in an array, this
# task alone.

source scripts/flags.sh

# shellcheck disable=SC2034  # TRAIN_ARGS and the others are read by the sbatch script
job_setup() {
  local name
  for name in SLURM_NNODES SLURM_GPUS_ON_NODE SLURM_CPUS_PER_TASK NPROC_PER_NODE OMP_NUM_THREADS; do
    whole_number "$name"
  done
  a_port MASTER_PORT
  count_of MAX_RESTARTS
  node_range NNODES
  if [[ -n "${SLURM_ARRAY_TASK_ID:-}" ]]; then
    JOB_ID=${SLURM_ARRAY_JOB_ID:-dry-run}_$SLURM_ARRAY_TASK_ID
  else
    JOB_ID=${SLURM_JOB_ID:-dry-run}
  fi
  if [[ -n "${SLURM_JOB_NODELIST:-}" ]]; then
    mapfile -t NODES < <(scontrol show hostnames "$SLURM_JOB_NODELIST")
  else  # outside an allocation (DRY_RUN=1 on a login node): placeholder names
    NODES=()
    for ((i = 0; i < ${SLURM_NNODES:-$DEFAULT_NODES}; i++)); do NODES+=("node$i"); done
  fi
  if [[ "${NNODES:-}" == *:* ]]; then
    fits_node_range "${#NODES[@]}"
  else
    NNODES=${#NODES[@]}
  fi
  HEAD=${NODES[0]}
  # a port per job, so jobs sharing a node do not collide
  MASTER_PORT=${MASTER_PORT:-$((20000 + ${SLURM_JOB_ID:-0} % 20000))}
  NPROC_PER_NODE=${NPROC_PER_NODE:-${SLURM_GPUS_ON_NODE:-$DEFAULT_GPUS_PER_NODE}}
  CPUS_PER_TASK=${SLURM_CPUS_PER_TASK:-$DEFAULT_CPUS_PER_TASK}
  export SRUN_CPUS_PER_TASK=$CPUS_PER_TASK
  export OMP_NUM_THREADS=${OMP_NUM_THREADS:-$((CPUS_PER_TASK > NPROC_PER_NODE ? CPUS_PER_TASK / NPROC_PER_NODE : 1))}
  MAX_RESTARTS=${MAX_RESTARTS:-1}
  OUTPUT_DIR=${OUTPUT_DIR:-runs/$JOB_ID}
  CONFIG=${CONFIG:-configs/train.yaml}
  names_a_file CONFIG "$CONFIG"
  TRAIN_ARGS=(--config "$CONFIG" --output_dir "$OUTPUT_DIR" --resume_from_checkpoint auto
              ${DATA_CACHE_DIR:+--data_cache_dir "$DATA_CACHE_DIR"} "$@")
  container_setup
  # the package runs from src/ without being installed
  export PYTHONPATH="src${PYTHONPATH:+:$PYTHONPATH}"
  echo "job $JOB_ID (restart ${SLURM_RESTART_COUNT:-0}): $(count "$NNODES" node nodes)$(elastic_note) x $(count "$NPROC_PER_NODE" process processes), head $HEAD:$MASTER_PORT, output $OUTPUT_DIR"
  echo "cpus: $CPUS_PER_TASK per node (SRUN_CPUS_PER_TASK=$SRUN_CPUS_PER_TASK), OMP_NUM_THREADS=$OMP_NUM_THREADS per process; max restarts $MAX_RESTARTS"
  if [[ -n "$CONTAINER_NOTE" ]]; then echo "$CONTAINER_NOTE"; fi
}

# `container_setup`: from CONTAINER_IMAGE (pyxis) or APPTAINER_IMAGE, the options srun takes
# (CONTAINER_SRUN) or the command before each node's (CONTAINER_EXEC), and the job log's line
# (CONTAINER_NOTE). STEP_ENV goes before a launcher that is not torchrun: under pyxis an image's
# enroot hook (NGC's PyTorch images) sets RANK, WORLD_SIZE and MASTER_ADDR for every step, as if
# each task were one training process. Both images set, or at run time no apptainer or no image
# file: one line and exit 2.
CONTAINER_SRUN=() CONTAINER_EXEC=() STEP_ENV="" CONTAINER_NOTE=""
# shellcheck disable=SC2034  # STEP_ENV is read by the sbatch scripts
container_setup() {
  local dir joined mounts=() image=${CONTAINER_IMAGE:-${APPTAINER_IMAGE:-}}
  if [[ -z "$image" ]]; then
    return
  fi
  if [[ -n "${CONTAINER_IMAGE:-}" && -n "${APPTAINER_IMAGE:-}" ]]; then
    echo "error: CONTAINER_IMAGE and APPTAINER_IMAGE are both set; set one: CONTAINER_IMAGE runs each node's" \
         "command with pyxis (srun --container-image), APPTAINER_IMAGE under apptainer exec" >&2
    exit 2
  fi
  # a file pyxis must tell from a registry's image by its leading / or ./
  if [[ -n "${CONTAINER_IMAGE:-}" && "$image" == *.sqsh && "$image" != /* ]]; then
    image=$PWD/$image
  fi
  for dir in "$PWD" "$OUTPUT_DIR" "${DATA_CACHE_DIR:-}"; do
    if [[ -n "$dir" ]]; then
      [[ "$dir" == /* ]] || dir=$PWD/$dir
      [[ "$dir" == "$PWD"/* ]] || mounts+=("$dir:$dir")
    fi
  done
  CONTAINER_CACHE=${CONTAINER_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}}
  mounts+=("$CONTAINER_CACHE:/cache")
  printf -v joined '%s,' "${mounts[@]}"
  if ! is_yes DRY_RUN; then
    if [[ -n "${APPTAINER_IMAGE:-}" ]] && ! command -v apptainer >/dev/null; then
      echo "error: APPTAINER_IMAGE is set and apptainer is not on PATH; load it (module load apptainer)," \
           "or run the image with pyxis: CONTAINER_IMAGE" >&2
      exit 2
    fi
    if [[ -n "${APPTAINER_IMAGE:-}" || "$image" == *.sqsh ]]; then
      names_a_file "${APPTAINER_IMAGE:+APPTAINER_IMAGE}${CONTAINER_IMAGE:+CONTAINER_IMAGE}" "$image"
    fi
    mkdir -p "$OUTPUT_DIR" "${DATA_CACHE_DIR:-$OUTPUT_DIR}" "$CONTAINER_CACHE"  # a mount's folder must exist
  fi
  if [[ -n "${CONTAINER_IMAGE:-}" ]]; then
    CONTAINER_SRUN=(--container-image="$image" --container-mounts="${joined%,}" --container-workdir="$PWD")
    STEP_ENV="env -u RANK -u LOCAL_RANK -u WORLD_SIZE -u MASTER_ADDR -u MASTER_PORT "
    CONTAINER_NOTE="container: srun $(quote "${CONTAINER_SRUN[@]}") (pyxis)"
  else
    CONTAINER_EXEC=(apptainer exec --nv --bind "${joined%,}" --pwd "$PWD" "$image")
    CONTAINER_NOTE="container: $(quote "${CONTAINER_EXEC[@]}") before each node's command"
  fi
}

# `fits_node_range ALLOCATED`: the range NNODES=MIN:MAX holds the ALLOCATED node count (every node
# runs a launcher: more than MAX would wait at the rendezvous, and restart the others over and
# over); else one line and exit 2.
fits_node_range() {
  if ((${NNODES%%:*} > $1 || ${NNODES##*:} < $1)); then
    echo "error: NNODES=$NNODES does not hold the $(count "$1" node nodes) of the job; use a range MIN:MAX with" \
         "MIN <= $1 <= MAX (sbatch --nodes MIN-MAX gives a job between MIN and MAX nodes)" >&2
    exit 2
  fi
}

elastic_note() {  # what an elastic range adds to the job's line
  if [[ "$NNODES" == *:* ]]; then echo " of ${#NODES[@]} allocated (elastic: srun --no-kill)"; fi
}

# `node_count_only LAUNCHER`: for a launcher that takes a fixed node count, an elastic NNODES range
# is one line and exit 2.
node_count_only() {
  if [[ "$NNODES" == *:* ]]; then
    echo "error: NNODES=$NNODES is a range, and $1 takes a node count; an elastic job runs under" \
         "scripts/slurm/torchrun.sbatch" >&2
    exit 2
  fi
}

count() {  # count N SINGULAR PLURAL: "1 node", "4 nodes"
  if [[ "$1" == 1 ]]; then echo "$1 $2"; else echo "$1 $3"; fi
}

quote() {  # the arguments, each quoted for bash, space-separated
  local quoted
  printf -v quoted '%q ' "$@"
  echo "${quoted% }"
}

PREEMPTED=0 WAIT_CUT=0
on_preemption_signal() {
  PREEMPTED=1 WAIT_CUT=1
  echo "job $JOB_ID got the preemption signal: every training process checkpoints at its next optimizer step"
  scancel --signal=USR1 "$JOB_ID"  # every process of the job's steps, on every node
}

launch_on_nodes() {
  local node_cmd=$1 i status=0 pid
  if is_yes DRY_RUN; then
    for i in "${!NODES[@]}"; do
      echo "${NODES[i]} (SLURM_NODEID=$i): ${CONTAINER_EXEC[*]:+$(quote "${CONTAINER_EXEC[@]}") }${node_cmd//\$SLURM_NODEID/$i}"
    done
    return 0
  fi
  trap on_preemption_signal USR1
  # in the background: bash runs a trap only between commands, and `wait` returns for one
  # a fixed node count: a node whose launcher fails ends the step on every node; an elastic
  # range: the other nodes carry on, and their torchrun continues without it
  local on_failure=--kill-on-bad-exit=1
  if [[ "$NNODES" == *:* ]]; then on_failure=--no-kill; fi
  # under Apptainer the launcher ignores USR1 inside the container: apptainer's own process takes the
  # signal and passes it on
  srun --nodes "${#NODES[@]}" --ntasks-per-node 1 "$on_failure" "${CONTAINER_SRUN[@]}" "${CONTAINER_EXEC[@]}" \
    bash -c "trap '' USR1; exec $node_cmd" &
  pid=$!
  # a wait that the trap cut short (status > 128) waits again: bash keeps the status of a step that
  # ended while the trap ran
  while :; do
    WAIT_CUT=0 status=0
    wait "$pid" || status=$?
    ((status > 128 && WAIT_CUT)) || break
  done
  if ((PREEMPTED && status == 0)) && [[ ! -d "$OUTPUT_DIR/final_model" ]]; then
    echo "requeueing job $JOB_ID: it resumes from $OUTPUT_DIR/checkpoints"
    scontrol requeue "$JOB_ID"
  fi
  return "$status"
}
