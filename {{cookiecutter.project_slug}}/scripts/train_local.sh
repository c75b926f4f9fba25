#!/usr/bin/env bash
# torchrun on this machine: one process per GPU, or 2 processes on a CPU-only machine (through
# src/{{ cookiecutter.project_slug }}/torchrun.py, torchrun itself but for a Ctrl-C: one line, not a traceback).
# Arguments are passed through to the entry point; environment variables set the launch:
#   scripts/train_local.sh --max_steps 20 --report_to none
#   ENTRY=pytorch NPROC_PER_NODE=4 scripts/train_local.sh --config configs/train.yaml
#   DRY_RUN=1 scripts/train_local.sh        # print the command instead of running it (1/true/yes)
# ENTRY: pytorch | accelerate | trainer{% if 'doctor' in cookiecutter.__extras.split(',') %}, or doctor (make doctor: checks the launch, trains nothing){% endif %}.
# PYTHON: the interpreter (default: python).
# NNODES (default 1): more than this machine, each node running this script with the same
# MASTER_ADDR (the first node's), MASTER_PORT and RUN_ID: a count N, or MIN:MAX for an elastic job
# that continues on fewer nodes when one is lost (torchrun_args in scripts/flags.sh: the c10d
# rendezvous on MASTER_ADDR, MAX_RESTARTS (1), RDZV_CONF); the entry point then gets
# --resume_from_checkpoint auto before your arguments, so a restart resumes:
#   NNODES=1:2 MASTER_ADDR=10.0.0.1 MASTER_PORT=29400 RUN_ID=run7 scripts/train_local.sh --output_dir runs/run7
set -euo pipefail
cd "$(dirname "$0")/.."
source scripts/flags.sh

ENTRY=${ENTRY:-{{ 'pytorch' if cookiecutter.entry_points == 'all' else cookiecutter.entry_points }}}
known_entry
PYTHON=${PYTHON:-python}
NNODES=${NNODES:-1}
node_range NNODES
whole_number NPROC_PER_NODE
a_port MASTER_PORT
if [[ -z "${NPROC_PER_NODE:-}" ]]; then
  NPROC_PER_NODE=$("$PYTHON" -c 'import torch; print(torch.cuda.device_count() or 2)')
fi
MASTER_ADDR=${MASTER_ADDR:-127.0.0.1}
if [[ -z "${MASTER_PORT:-}" ]]; then
  MASTER_PORT=$("$PYTHON" -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])')
fi
# The package runs from src/ without being installed.
export PYTHONPATH="src${PYTHONPATH:+:$PYTHONPATH}"

if [[ "$NNODES" == 1 ]]; then
  cmd=("$PYTHON" -m {{ cookiecutter.project_slug }}.torchrun --nnodes 1 --nproc_per_node "$NPROC_PER_NODE"
       --master_addr "$MASTER_ADDR" --master_port "$MASTER_PORT"
       -m "$(entry_module)" "$@")
else
  MAX_RESTARTS=${MAX_RESTARTS:-1}
  count_of MAX_RESTARTS
  HEAD=$MASTER_ADDR RUN_ID=${RUN_ID:-$MASTER_PORT}
  echo "nodes $NNODES: $NPROC_PER_NODE processes here, rendezvous $HEAD:$MASTER_PORT, run $RUN_ID," \
       "max restarts $MAX_RESTARTS"
  torchrun_args ""
  cmd=("$PYTHON" -m {{ cookiecutter.project_slug }}.torchrun "${TORCHRUN_ARGS[@]}" -m "$(entry_module)"
       --resume_from_checkpoint auto "$@")
fi
if is_yes DRY_RUN; then
  printf '%q ' "${cmd[@]}"
  echo
  exit 0
fi
exec "${cmd[@]}"
