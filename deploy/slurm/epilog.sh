#!/bin/bash
# Slurm Epilog for torchpass nodes: slurm.conf `Epilog=/etc/slurm/torchpass-epilog.sh`, on every node.
#
# After a job on this node, stop what it left: its node agent and that agent's ranks and spares (they
# die with their agent, by a parent-death signal; this catches one that was stopped, SIGSTOP, meanwhile).
# The job's id is torchpass's default for a Slurm job, slurm-$SLURM_JOB_ID.
set -uo pipefail
job="slurm-${SLURM_JOB_ID:-0}"
name=${SLURMD_NODENAME:-$(hostname)}
pattern="torchpass.* node --job $job --name $name "
pkill -TERM -f "$pattern" 2>/dev/null
for _ in 1 2 3 4 5 6 7 8 9 10; do
    pgrep -f "$pattern" >/dev/null || exit 0
    sleep 1
done
pkill -KILL -f "$pattern" 2>/dev/null
exit 0
