#!/usr/bin/env bash
# Install what the real-Slurm test cluster (tests/slurm/cluster.py) needs: Debian's slurm-wlm (22.05 on
# Debian 12: slurmctld, slurmd and the clients) and munge. Idempotent: exits 0 at once when slurmctld is
# already on PATH. Needs root (or sudo) and the Debian package mirror.
set -euo pipefail
# The daemons live in /usr/sbin, which a non-root PATH may lack.
export PATH="$PATH:/usr/sbin:/sbin"

if command -v slurmctld >/dev/null 2>&1 && command -v munged >/dev/null 2>&1; then
    echo "slurm: already installed ($(command -v slurmctld), $(slurmctld -V 2>/dev/null || echo '?')); nothing to do"
    exit 0
fi

SUDO=""
if [ "$(id -u)" -ne 0 ]; then
    if command -v sudo >/dev/null 2>&1; then
        SUDO="sudo"
    else
        echo "slurm: not installed and not root (no sudo): cannot install slurm-wlm munge" >&2
        exit 1
    fi
fi

start=$(date +%s)
echo "slurm: installing slurm-wlm munge with apt-get"
export DEBIAN_FRONTEND=noninteractive
# apt-get update only when the package lists are missing (a fresh container): it is the slow part.
if ! apt-cache show slurm-wlm >/dev/null 2>&1; then
    echo "slurm: apt-get update (no package lists for slurm-wlm)"
    $SUDO apt-get update -q
fi
$SUDO apt-get install -y -q --no-install-recommends slurm-wlm munge
echo "slurm: installed $(slurmctld -V) in $(( $(date +%s) - start )) s"
