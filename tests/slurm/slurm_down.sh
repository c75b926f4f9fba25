#!/usr/bin/env bash
# Stop the daemons slurm_up.sh started (by the PIDs it recorded), nothing else.
BASE=$1
for pidfile in "$BASE"/pids/*.pid; do
  [ -f "$pidfile" ] && kill "$(cat "$pidfile")" 2>/dev/null
done
exit 0
