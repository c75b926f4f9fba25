#!/usr/bin/env bash
# Every row of a sweep (src/{{ cookiecutter.project_slug }}/sweep.py) on this machine, one after another, each through
# scripts/train_local.sh (ENTRY, NPROC_PER_NODE, PYTHON and the rest as there) into the row's folder;
# flags after the sweep file go to every row. Every row is checked before the first starts. A row
# already trained ends at once and one stopped part-way resumes, so running the sweep again finishes it.
# Each row is a W&B run named by its folder, in the group named after the sweep file.
#   scripts/sweep_local.sh configs/sweeps/lr.yaml --max_steps 20
set -euo pipefail
cd "$(dirname "$0")/.."
if [[ $# -eq 0 || "$1" == -* ]]; then
  echo "error: name the sweep file first: scripts/sweep_local.sh configs/sweeps/<name>.yaml [flags...]" >&2
  exit 2
fi
SWEEP=$1
shift
PYTHON=${PYTHON:-python}
export PYTHONPATH="src${PYTHONPATH:+:$PYTHONPATH}"
rows=$("$PYTHON" -m {{ cookiecutter.project_slug }}.sweep "$SWEEP" "$@") || exit
count=$(wc -l <<< "$rows")
export WANDB_RUN_GROUP=${WANDB_RUN_GROUP:-$(basename "$SWEEP" .yaml)}
for ((i = 0; i < count; i++)); do
  # the row's folder, its first config file, then its other arguments, one a line
  row=$("$PYTHON" -m {{ cookiecutter.project_slug }}.sweep --row "$i" "$SWEEP" "$@") || exit
  mapfile -t row <<< "$row"
  echo "sweep $SWEEP: row $i of $count, ${row[0]}"
  WANDB_NAME=${row[0]##*/} scripts/train_local.sh --config "${row[1]}" "${row[@]:2}" --output_dir "${row[0]}" \
    --resume_from_checkpoint auto "$@"
done
