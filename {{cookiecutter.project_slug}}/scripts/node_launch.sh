#!/usr/bin/env bash
# torchrun on one node of a job that Kubernetes or SkyPilot started: the command of the containers
# of k8s/trainjob.yaml and k8s/jobset.yaml, and the run of sky/train.yaml. Each controller gives the
# node count, this node's rank and the first node's address in variables of its own:
#   TrainJob (Kubeflow Trainer's torch runtime): PET_NNODES, PET_NODE_RANK, PET_MASTER_ADDR,
#     PET_MASTER_PORT, PET_NPROC_PER_NODE
#   JobSet: JOB_COMPLETION_INDEX (the node rank); NNODES, NPROC_PER_NODE and MASTER_ADDR (the first
#     pod's name under the JobSet's headless service) come from k8s/jobset.yaml
#   SkyPilot: SKYPILOT_NODE_RANK, SKYPILOT_NUM_NODES, SKYPILOT_NODE_IPS (the first is the head's),
#     SKYPILOT_NUM_GPUS_PER_NODE, SKYPILOT_TASK_ID (the same after a recovery)
# The torchrun options are the sbatch scripts' (torchrun_args, scripts/flags.sh): a c10d rendezvous
# that the first node holds. Arguments go to the entry point after
#   --config "$CONFIG" --output_dir "$OUTPUT_DIR" --resume_from_checkpoint auto
# so that a restarted job continues from the newest checkpoint in OUTPUT_DIR (a persistent volume);
# SIGTERM stops the job after a checkpoint, with exit code 143 (below).
# Environment: ENTRY (pytorch | accelerate | trainer{% if 'doctor' in cookiecutter.__extras.split(',') %} | doctor{% endif %}), NNODES (overrides the controller's count;
# MIN:MAX for an elastic range), NPROC_PER_NODE (overrides too), MASTER_PORT (JobSet, SkyPilot:
# 29500), MAX_RESTARTS (1), RUN_ID (the job's name, the same on every node), OUTPUT_DIR
# (runs/<run id>), CONFIG (configs/train.yaml), PYTHON (python), DRY_RUN=1 (print the command).
set -euo pipefail
cd "$(dirname "$0")/.."
source scripts/flags.sh

# `given_by CONTROLLER NAME...`: each variable NAME, which CONTROLLER sets on every node, is set and
# not blank; else one line and exit 2.
given_by() {
  local controller=$1 name value
  shift
  for name in "$@"; do
    value=${!name:-}
    if [[ -z "${value//[[:space:]]/}" ]]; then
      echo "error: $name is not set; $controller sets it on every node (scripts/node_launch.sh runs there)" >&2
      exit 2
    fi
  done
}

# `take NAME SOURCE CHECK`: NAME, unless set, takes the value of the controller's variable SOURCE,
# which CHECK (scripts/flags.sh) checks under its own name: a line names the variable that was set.
declare -A TAKEN=()
take() {
  if [[ -z "${!1:-}" ]]; then
    "$3" "$2" "; $1 overrides it"
    printf -v "$1" '%s' "${!2}"
    TAKEN[$1]=$2
  fi
}

if [[ -n "${PET_NODE_RANK+set}" ]]; then
  controller="a TrainJob (Kubeflow Trainer's torch runtime)" rank_name=PET_NODE_RANK
  given_by "$controller" PET_NODE_RANK PET_NNODES PET_MASTER_ADDR PET_MASTER_PORT PET_NPROC_PER_NODE
  count_of PET_NODE_RANK
  a_port PET_MASTER_PORT
  NODE_RANK=$PET_NODE_RANK HEAD=$PET_MASTER_ADDR MASTER_PORT=$PET_MASTER_PORT
  take NNODES PET_NNODES node_range
  take NPROC_PER_NODE PET_NPROC_PER_NODE whole_number
elif [[ -n "${SKYPILOT_NODE_RANK+set}" ]]; then
  controller="SkyPilot" rank_name=SKYPILOT_NODE_RANK
  given_by "$controller" SKYPILOT_NODE_RANK SKYPILOT_NUM_NODES SKYPILOT_NODE_IPS SKYPILOT_NUM_GPUS_PER_NODE
  count_of SKYPILOT_NODE_RANK
  # the head's address comes first; SkyPilot writes one a line (spaces and blank lines are taken too)
  read -r -d '' -a ips <<< "$SKYPILOT_NODE_IPS" || true
  NODE_RANK=$SKYPILOT_NODE_RANK HEAD=${ips[0]}
  take NNODES SKYPILOT_NUM_NODES node_range
  take NPROC_PER_NODE SKYPILOT_NUM_GPUS_PER_NODE whole_number
  RUN_ID=${RUN_ID:-${SKYPILOT_TASK_ID:-}}
elif [[ -n "${JOB_COMPLETION_INDEX+set}" ]]; then
  controller="k8s/jobset.yaml" rank_name=JOB_COMPLETION_INDEX
  given_by "the Job of a JobSet" JOB_COMPLETION_INDEX
  count_of JOB_COMPLETION_INDEX
  given_by "$controller" NNODES NPROC_PER_NODE MASTER_ADDR
  NODE_RANK=$JOB_COMPLETION_INDEX HEAD=$MASTER_ADDR
else
  echo "error: no node rank: PET_NODE_RANK (TrainJob), JOB_COMPLETION_INDEX (JobSet) or SKYPILOT_NODE_RANK" \
       "(SkyPilot) is set; on this machine use scripts/train_local.sh" >&2
  exit 2
fi
node_range NNODES
whole_number NPROC_PER_NODE
if ((NODE_RANK >= ${NNODES##*:})); then
  echo "error: $rank_name=$NODE_RANK is not a node rank of ${TAKEN[NNODES]:-NNODES}=$NNODES (0 to" \
       "$((${NNODES##*:} - 1))): the job has more nodes than that; make NNODES and the node count of" \
       "$controller agree" >&2
  exit 2
fi
MASTER_PORT=${MASTER_PORT:-29500}
a_port MASTER_PORT
MAX_RESTARTS=${MAX_RESTARTS:-1}
count_of MAX_RESTARTS
RUN_ID=${RUN_ID:-$HEAD}
OUTPUT_DIR=${OUTPUT_DIR:-runs/$RUN_ID}
CONFIG=${CONFIG:-configs/train.yaml}
names_a_file CONFIG "$CONFIG"
ENTRY=${ENTRY:-{{ 'pytorch' if cookiecutter.entry_points == 'all' else cookiecutter.entry_points }}}
known_entry
PYTHON=${PYTHON:-python}
# The package runs from src/ without being installed.
export PYTHONPATH="src${PYTHONPATH:+:$PYTHONPATH}"

echo "node $NODE_RANK of $NNODES ($controller): $NPROC_PER_NODE processes, rendezvous $HEAD:$MASTER_PORT," \
     "run $RUN_ID, output $OUTPUT_DIR"
torchrun_args "$((NODE_RANK == 0 ? 1 : 0))"
cmd=("$PYTHON" -m {{ cookiecutter.project_slug }}.torchrun "${TORCHRUN_ARGS[@]}" -m "$(entry_module)"
     --config "$CONFIG" --output_dir "$OUTPUT_DIR" --resume_from_checkpoint auto "$@")
if is_yes DRY_RUN; then
  printf '%q ' "${cmd[@]}"
  echo
  exit 0
fi

# Kubernetes stops a pod (eviction, preemption, `kubectl delete`) with SIGTERM to this script, then
# SIGKILL after terminationGracePeriodSeconds. The training processes take SIGUSR1 (or SIGTERM) as the
# request to stop after the next optimizer step with a checkpoint, all ranks alike. SIGTERM is passed
# on to them as SIGUSR1, which torchrun ignores (as under the sbatch scripts): SIGTERM to torchrun
# would end it as soon as its workers stop, and the first node's torchrun holds the rendezvous that
# the other nodes' torchrun still read until theirs have stopped too (measured: they then fail with a
# traceback). Once the workers have stopped the script exits 143, so that the JobSet restarts the job
# and it resumes from that checkpoint.
stopping=0 pid=
# shellcheck disable=SC2329  # run by the trap below
on_sigterm() {
  local stat fields
  stopping=1
  echo "SIGTERM: every training process checkpoints after its next optimizer step"
  # torchrun's children, the training processes (each in a session of its own: not in its group)
  for stat in /proc/[0-9]*/stat; do
    read -r fields < "$stat" 2>/dev/null || continue
    fields=${fields##*) }  # state, parent, ... after the command's name
    fields=${fields#* }
    if [[ -n "$pid" && "${fields%% *}" == "$pid" ]]; then
      kill -USR1 "${stat//[^0-9]/}" 2>/dev/null || true
    fi
  done
}
trap on_sigterm TERM
trap '' USR1  # torchrun inherits it ignored; the training processes listen for it
"${cmd[@]}" &
pid=$!
status=0
wait "$pid" || status=$?
while ((status > 128)) && kill -0 "$pid" 2>/dev/null; do  # the wait was cut short by the trap
  status=0
  wait "$pid" || status=$?
done
if ((stopping && status == 0)); then
  exit 143
fi
exit "$status"
