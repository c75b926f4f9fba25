# shellcheck shell=bash
# Sourced by the launch scripts.
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

# `whole_number NAME`: the variable NAME, when set, is a whole number of at least 1; anything else
# ends the script with one line and exit 2.
whole_number() {
  if [[ -n "${!1+set}" && ! "${!1}" =~ ^[1-9][0-9]*$ ]]; then
    echo "error: $1=${!1} is not a whole number of at least 1" >&2
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

# `names_a_file NAME PATH`: PATH, which the variable NAME chose, is a file; else one line and exit 2.
names_a_file() {
  if [[ ! -f "$2" ]]; then
    echo "error: $1=${!1:-} names $2, which is not a file" >&2
    exit 2
  fi
}
