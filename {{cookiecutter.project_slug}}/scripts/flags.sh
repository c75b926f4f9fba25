# shellcheck shell=bash
# Sourced by the launch scripts: their variables' checks, and the torchrun options that every
# multi-node launch shares (scripts/slurm/*.sbatch, scripts/node_launch.sh).
# `is_yes NAME`: whether the variable NAME says yes (1, true, yes) or no
# (0, false, no, unset, empty), any case; anything else ends the script with one line and exit 2.
is_yes() {
  local value=${!1:-0}
  case "${value,,}" in
    1 | true | yes) return 0 ;;
    0 | false | no) return 1 ;;
  esac
  echo "error: $1=${!1} is not yes or no; use 1, true or yes, or 0, false or no" >&2
  exit 2
}

# `whole_number NAME [NOTE]`: the variable NAME, when set, is a whole number of at least 1; anything
# else ends the script with one line (NOTE after it) and exit 2.
whole_number() {
  if [[ -n "${!1+set}" && ! "${!1}" =~ ^[1-9][0-9]*$ ]]; then
    echo "error: $1=${!1} is not a whole number of at least 1${2:-}" >&2
    exit 2
  fi
}

# `count_of NAME`: the same for a whole number that may be 0.
count_of() {
  if [[ -n "${!1+set}" && ! "${!1}" =~ ^(0|[1-9][0-9]*)$ ]]; then
    echo "error: $1=${!1} is not a whole number" >&2
    exit 2
  fi
}

# `a_port NAME`: the variable NAME, when set, is a TCP port (1-65535); else one line and exit 2.
a_port() {
  if [[ -n "${!1+set}" ]] && ! [[ "${!1}" =~ ^[1-9][0-9]{0,4}$ && "${!1}" -le 65535 ]]; then
    echo "error: $1=${!1} is not a port (1-65535)" >&2
    exit 2
  fi
}

{%- set doctor = 'doctor' in cookiecutter.__extras.split(',') %}

# `known_entry`: ENTRY names an entry point of this project (src/<package>/train_<ENTRY>.py){{ ' or\n# the doctor;' if doctor else ';\n#' }} else one line naming them and exit 2.
known_entry() {
{%- if not doctor %}
  if [[ "$ENTRY" == doctor ]]; then
    echo "error: ENTRY=doctor belongs to the extra 'doctor' (the doctor (python -m {{ cookiecutter.project_slug }}.doctor) and the record of a hung collective), which this project was baked without; add it with \`cruft update\` and extras including doctor, or re-bake (docs/extending.md)" >&2
    exit 2
  fi
{%- endif %}
  if [[ {{ '"$ENTRY" != doctor && ' if doctor }}! -f "src/{{ cookiecutter.project_slug }}/train_$ENTRY.py" ]]; then
    local entries=(src/{{ cookiecutter.project_slug }}/train_*.py) listed
    entries=("${entries[@]##*/train_}")
    printf -v listed '%s, ' "${entries[@]%.py}"
    echo "error: ENTRY=$ENTRY is not an entry point of this project; use ${listed%, }{{ ' or doctor' if doctor }}" >&2
    exit 2
  fi
}

# `names_a_file NAME PATH`: PATH, which the variable NAME chose, is a file; else one line and exit 2.
names_a_file() {
  if [[ ! -f "$2" ]]; then
    echo "error: $1=${!1:-} names $2, which is not a file" >&2
    exit 2
  fi
}

# `node_range NAME [NOTE]`: the variable NAME, when set, is a node count N or an elastic range MIN:MAX
# (1 <= MIN <= MAX); anything else ends the script with one line (NOTE after it) and exit 2.
node_range() {
  if [[ -n "${!1+set}" ]] && ! [[ "${!1}" =~ ^([1-9][0-9]*)(:([1-9][0-9]*))?$ &&
    ( -z "${BASH_REMATCH[3]}" || "${BASH_REMATCH[1]}" -le "${BASH_REMATCH[3]}" ) ]]; then
    echo "error: $1=${!1} is not a node count N or a range MIN:MAX of at least 1 (e.g. 2 or 1:4)${2:-}" >&2
    exit 2
  fi
}

{%- if doctor %}

# `entry_module`: the module that ENTRY names: the entry point train_<ENTRY>, or for ENTRY=doctor
# the doctor, which checks the launch (ranks, network, versions, an all-reduce) and trains nothing.
entry_module() {
  if [[ "$ENTRY" == doctor ]]; then
    echo "{{ cookiecutter.project_slug }}.doctor"
  else
    echo "{{ cookiecutter.project_slug }}.train_$ENTRY"
  fi
}
{%- else %}

# `entry_module`: the module that ENTRY names, the entry point train_<ENTRY>.
entry_module() {
  echo "{{ cookiecutter.project_slug }}.train_$ENTRY"
}
{%- endif %}

# `torchrun_args`: torchrun's options for one node of a job, into the array TORCHRUN_ARGS, from
# NNODES (N, or MIN:MAX: torchrun then starts with any count in the range and restarts the
# processes when a node joins or leaves), NPROC_PER_NODE, MAX_RESTARTS, HEAD and MASTER_PORT (the
# c10d rendezvous: the first node's address), RUN_ID (the same on every node; the run folder's lock
# knows a restart by it) and RDZV_CONF (more rendezvous settings, key=value,...: last_call_timeout,
# join_timeout). Its argument says whether this node holds the rendezvous: 1 or 0, or empty for
# torchrun's guess from the host's names (the first to start holds it where several guess so).
# shellcheck disable=SC2034  # TORCHRUN_ARGS is read by the scripts that source this file
torchrun_args() {
  rendezvous_conf
  local conf=${1:+is_host=$1}
  conf+=${RDZV_CONF:+${conf:+,}$RDZV_CONF}
  TORCHRUN_ARGS=(--nnodes "$NNODES" --nproc_per_node "$NPROC_PER_NODE" --max-restarts "$MAX_RESTARTS"
                 --rdzv_backend c10d --rdzv_endpoint "$HEAD:$MASTER_PORT" --rdzv_id "$RUN_ID")
  if [[ -n "$conf" ]]; then
    TORCHRUN_ARGS+=(--rdzv_conf "$conf")
  fi
  if [[ "$NNODES" == *:* ]]; then
    # A node that joins a running job waits for an address the shared store never gets (torch 2.13's
    # dynamic rendezvous): each round publishes its own, the processes' address being the first node's name.
    export TORCH_DISABLE_SHARE_RDZV_TCP_STORE=${TORCH_DISABLE_SHARE_RDZV_TCP_STORE:-1}
  fi
}

# `rendezvous_conf`: RDZV_CONF, when set, is key=value,... of the c10d rendezvous's settings (torch
# ignores a key it does not know, and a malformed one ends torchrun with a traceback); else one line
# and exit 2.
rendezvous_conf() {
  local item items
  if [[ -z "${RDZV_CONF:-}" ]]; then
    return
  fi
  IFS=, read -r -a items <<< "$RDZV_CONF,"  # a comma after the last item keeps an empty one before it
  for item in "${items[@]}"; do
    if ! [[ "$item" =~ ^(join|last_call|close|heartbeat|read)_timeout=[1-9][0-9]*$ ||
            "$item" =~ ^keep_alive_(interval|max_attempt)=[1-9][0-9]*$ || "${item,,}" =~ ^is_host=(0|1|true|false)$ ||
            "$item" =~ ^store_type=(tcp|file)$ ]]; then
      echo "error: RDZV_CONF=$RDZV_CONF: '$item' is not a rendezvous setting; use key=value,... of join_timeout," \
           "last_call_timeout, close_timeout, heartbeat_timeout, read_timeout, keep_alive_interval," \
           "keep_alive_max_attempt (whole numbers of at least 1), is_host (true or false), store_type (tcp or file)" >&2
      exit 2
    fi
  done
}
