#!/usr/bin/env bash
# A one-node SLURM on localhost (Debian's slurm-wlm + munge) for tests/cluster/test_slurm_job.py: slurmctld
# and slurmd as root, no cgroups (proctrack/linuxproc: CI boxes and containers often lack a writable cgroup
# tree), the node declared with more CPUs than it has (config_overrides) so that a job's trainer ranks,
# orchestrator and inference server all get one. Idempotent: a second call reloads the config and checks.
# Usage: sudo .ci/slurm-up.sh   (installs the packages with apt-get when sbatch is missing)
set -euo pipefail
if ! command -v slurmctld >/dev/null || ! command -v munged >/dev/null; then
  # a fresh box may hold no package lists yet: read them once if the first try finds nothing to install
  DEBIAN_FRONTEND=noninteractive apt-get install -y -q slurm-wlm munge >/dev/null 2>&1 || {
    apt-get update -q >/dev/null && DEBIAN_FRONTEND=noninteractive apt-get install -y -q slurm-wlm munge >/dev/null; }
fi
host=$(hostname -s)
conf=/etc/slurm/slurm.conf
mem_mb=$(( $(awk '/MemTotal/ {print $2}' /proc/meminfo) / 1024 - 2048 ))
mkdir -p /etc/slurm /var/spool/slurmctld /var/spool/slurmd /var/log/slurm /run/munge /var/lib/munge /var/log/munge
if [ ! -s /etc/munge/munge.key ]; then
  mkdir -p /etc/munge
  dd if=/dev/urandom of=/etc/munge/munge.key bs=1024 count=1 status=none
fi
chown -R munge:munge /etc/munge /run/munge /var/lib/munge /var/log/munge 2>/dev/null || true
chmod 0400 /etc/munge/munge.key
cat > "$conf.new" <<CONF
ClusterName=primejax-ci
SlurmctldHost=$host
SlurmUser=root
AuthType=auth/munge
StateSaveLocation=/var/spool/slurmctld
SlurmdSpoolDir=/var/spool/slurmd
SlurmctldPidFile=/run/slurmctld.pid
SlurmdPidFile=/run/slurmd.pid
SlurmctldLogFile=/var/log/slurm/slurmctld.log
SlurmdLogFile=/var/log/slurm/slurmd.log
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
JobAcctGatherType=jobacct_gather/none
SelectType=select/cons_tres
SelectTypeParameters=CR_Core_Memory
DefMemPerCPU=1024
SlurmdParameters=config_overrides
ReturnToService=2
MpiDefault=none
KillWait=10
InactiveLimit=0
MinJobAge=300
NodeName=$host CPUs=16 Sockets=1 CoresPerSocket=16 ThreadsPerCore=1 RealMemory=$mem_mb State=UNKNOWN
PartitionName=debug Nodes=$host Default=YES MaxTime=INFINITE State=UP OverSubscribe=YES
CONF
mv "$conf.new" "$conf"
pgrep -x munged >/dev/null || su -s /bin/sh munge -c /usr/sbin/munged 2>/dev/null || /usr/sbin/munged --force
pgrep -x slurmctld >/dev/null && scontrol reconfigure || /usr/sbin/slurmctld
pgrep -x slurmd >/dev/null || /usr/sbin/slurmd
for _ in $(seq 60); do
  state=$(sinfo -h -n "$host" -o %T 2>/dev/null || true)
  case "$state" in idle*|mix*|alloc*) echo "slurm up: $host $state"; exit 0 ;; esac
  scontrol update nodename="$host" state=resume >/dev/null 2>&1 || true
  sleep 1
done
echo "slurm did not come up (node state: ${state:-none}); see /var/log/slurm/" >&2
exit 1
