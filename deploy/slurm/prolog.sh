#!/bin/bash
# Slurm Prolog for torchpass nodes: slurm.conf `Prolog=/etc/slurm/torchpass-prolog.sh`, on every node.
#
# Before a job starts on a node, check what torchpass needs there. A failing prolog makes Slurm drain
# the node with the reason (so it gets no job until repaired), which the torchpass detector then sees.
#   - the shared state directory is mounted and writable (TORCHPASS_PROLOG_STATE_DIR, default
#     /shared/torchpass: the prolog does not see the job's environment);
#   - no node agent of an earlier job is still running here (it would hold the GPUs).
set -uo pipefail
state=${TORCHPASS_PROLOG_STATE_DIR:-/shared/torchpass}
probe="$state/.prolog-${SLURMD_NODENAME:-$(hostname)}-${SLURM_JOB_ID:-0}"
if ! touch "$probe" 2>/dev/null; then
    echo "torchpass prolog: state directory $state not writable on ${SLURMD_NODENAME:-$(hostname)}" >&2
    exit 1
fi
rm -f "$probe"
left=$(pgrep -f "torchpass.* node --job .* --name ${SLURMD_NODENAME:-$(hostname)} " || true)
if [[ -n "$left" ]]; then
    echo "torchpass prolog: node agent(s) of an earlier job still running: $left" >&2
    exit 1
fi
exit 0
