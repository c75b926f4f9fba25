#!/usr/bin/env bash
# A real two-node SLURM cluster on this machine, for the tests: Debian's slurmctld, two slurmd
# (node1, node2, both 127.0.0.1) and munge. Root only; installs the packages when missing.
# Usage: slurm_up.sh BASE_DIR   (then SLURM_CONF=BASE_DIR/etc/slurm.conf; slurm_down.sh BASE_DIR stops it)
# Every daemon it starts writes its PID under BASE_DIR/pids, and slurm_down.sh stops only those.
set -euo pipefail
BASE=$1
PARTITION=${PARTITION:-debug}
CPUS=${CPUS:-2}

if ! command -v slurmctld >/dev/null || ! command -v slurmd >/dev/null || ! command -v sbatch >/dev/null; then
  apt-get update -qq
  DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends \
    slurmctld slurmd slurm-client munge >/dev/null
fi
[ -s /etc/munge/munge.key ] || {
  /usr/sbin/mungekey --create --force
  chown munge:munge /etc/munge/munge.key
  chmod 400 /etc/munge/munge.key
}

rm -rf "$BASE"
mkdir -p "$BASE"/{etc,state/ctld,state/d,log,pids}
# munged (systemd would create /run/munge); started here only when none is running
install -d -o munge -g munge -m 755 /run/munge
if ! munge -n >/dev/null 2>&1; then
  runuser -u munge -- /usr/sbin/munged
  for _ in $(seq 1 50); do [ -s /run/munge/munged.pid ] && break; sleep 0.1; done
  cp /run/munge/munged.pid "$BASE/pids/munged.pid"
fi
munge -n | unmunge >/dev/null

cat >"$BASE/etc/slurm.conf" <<CONF
ClusterName=local
SlurmctldHost=localhost
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
CredType=cred/munge
# a requeued job may start again after cred_expire seconds (default 120): 10 keeps the tests short
AuthInfo=cred_expire=10
MpiDefault=none
MailProg=/bin/true
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
JobCompType=jobcomp/none
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
SchedulerType=sched/backfill
# a pass every 1-2 s (default 30 and 60): a requeued job starts once cred_expire is over, not up to
# a minute later (measured: 12 s from requeue to start, against 25-39 s)
SchedulerParameters=bf_interval=1,sched_interval=2
ReturnToService=2
GresTypes=gpu
SlurmctldPort=6817
StateSaveLocation=$BASE/state/ctld
SlurmdSpoolDir=$BASE/state/d/%n
SlurmctldPidFile=$BASE/pids/slurmctld.pid
SlurmdPidFile=$BASE/pids/slurmd-%n.pid
SlurmctldLogFile=$BASE/log/slurmctld.log
SlurmdLogFile=$BASE/log/slurmd-%n.log
NodeName=node[1-2] NodeHostname=localhost NodeAddr=127.0.0.1 Port=[17001-17002] CPUs=$CPUS RealMemory=1000 Gres=gpu:2 State=UNKNOWN
PartitionName=$PARTITION Nodes=node[1-2] Default=YES MaxTime=INFINITE State=UP
CONF
# two fake GPUs per node (gres needs device files; nothing uses them: the jobs run on CPU)
printf 'AutoDetect=off\nName=gpu File=/dev/tty[0-1]\n' >"$BASE/etc/gres.conf"
# the node names resolve to loopback, so a job's head node address stays on this machine
grep -qw node1 /etc/hosts || echo '127.0.0.1 node1 node2' >>/etc/hosts

export SLURM_CONF=$BASE/etc/slurm.conf
slurmctld -c
slurmd -N node1
slurmd -N node2
for _ in $(seq 1 120); do
  [ "$(sinfo -h -N -o %T 2>/dev/null | grep -c '^idle$')" = 2 ] && exit 0
  sleep 0.5
done
echo "the nodes did not become idle:" >&2
sinfo -N >&2 || true
exit 1
