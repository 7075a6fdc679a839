#!/usr/bin/env bash
# Starts a one-host SLURM (munge, slurmctld, slurmd) so the tests can launch jobs with srun, as on a cluster.
# Needs root and Debian's slurm-wlm and munge. Idempotent: a SLURM that already answers is left alone.
# The node line comes from `slurmd -C`, so the configuration matches whatever machine this runs on.
set -euo pipefail

if [[ $EUID -ne 0 ]]; then
    echo "slurm_up.sh: needs root (starts munged, slurmctld and slurmd)" >&2
    exit 1
fi
for tool in munged slurmctld slurmd sinfo; do
    command -v "$tool" > /dev/null || { echo "slurm_up.sh: $tool missing (apt-get install slurm-wlm munge)" >&2; exit 1; }
done
if sinfo -h -o %T 2> /dev/null | grep -qE '^(idle|mixed|allocated)'; then
    echo "slurm_up.sh: SLURM already up"
    exit 0
fi

# munge: a key (Debian's package makes one; a bare image may not), its run directory, the daemon as its user.
install -d -o munge -g munge -m 0700 /etc/munge /var/lib/munge /var/log/munge
install -d -o munge -g munge -m 0755 /run/munge
if [[ ! -s /etc/munge/munge.key ]]; then
    dd if=/dev/urandom of=/etc/munge/munge.key bs=1024 count=1 status=none
fi
chown munge:munge /etc/munge/munge.key && chmod 0400 /etc/munge/munge.key
if ! munge -n > /dev/null 2>&1; then
    runuser -u munge -- munged
fi

# slurm.conf: one node (this host, as slurmd -C describes it), one partition, no cgroups (containers lack them).
node_line=$(slurmd -C | head -n 1)
host=$(hostname -s)
install -d /etc/slurm /var/spool/slurmctld /var/spool/slurmd /var/log/slurm
cat > /etc/slurm/slurm.conf << EOF
ClusterName=ci
SlurmctldHost=${host}
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
MpiDefault=none
SchedulerType=sched/backfill
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
ReturnToService=2
JobAcctGatherType=jobacct_gather/none
${node_line} State=UNKNOWN
PartitionName=debug Nodes=ALL Default=YES MaxTime=INFINITE State=UP OverSubscribe=YES
EOF

pgrep -x slurmctld > /dev/null || slurmctld
pgrep -x slurmd > /dev/null || slurmd
for _ in $(seq 60); do
    state=$(sinfo -h -n "$host" -o %T 2> /dev/null || true)
    case "$state" in
        idle*|mixed*|allocated*) echo "slurm_up.sh: SLURM up ($host $state)"; exit 0 ;;
        down*|drain*) scontrol update nodename="$host" state=resume 2> /dev/null || true ;;
    esac
    sleep 1
done
echo "slurm_up.sh: SLURM did not come up; last state: '${state:-none}'" >&2
tail -n 20 /var/log/slurm/slurmctld.log /var/log/slurm/slurmd.log >&2 || true
exit 1
