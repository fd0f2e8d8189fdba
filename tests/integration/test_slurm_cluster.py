"""The real-Slurm test cluster (tests/slurm/cluster.py) behaves like the clusters jobs will run on.

Everything here is real: a private munged, slurmctld and one slurmd per node (Debian's slurm-wlm
22.05), real `scontrol update` state changes seen through `sinfo --json`, a real `sbatch` job whose
`srun` step runs on two nodes, and real Prolog/Epilog scripts run by slurmd. Skipped only where
Slurm cannot run at all (not root, or the packages cannot be installed), with the reason printed.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from tests.slurm.cluster import SlurmCluster, SlurmStartError, available

pytestmark = pytest.mark.integration

HOOK = """#!/bin/sh
# Written by slurmd as root with a bare environment: absolute paths only.
echo "$SLURMD_NODENAME $SLURM_JOB_ID" > {dir}/{name}.$SLURM_JOB_ID.$SLURMD_NODENAME
"""


@pytest.fixture(scope="module")
def hooks(tmp_path_factory: pytest.TempPathFactory) -> Path:
    d = tmp_path_factory.mktemp("hooks")
    for name in ("prolog", "epilog"):
        script = d / f"{name}.sh"
        script.write_text(HOOK.format(dir=d, name=name))
        script.chmod(0o755)
    return d


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory, hooks: Path) -> Iterator[SlurmCluster]:
    reason = available()
    if reason:
        pytest.skip(reason)
    root = tmp_path_factory.mktemp("slurm")
    with SlurmCluster(root, nodes=3, prolog=hooks / "prolog.sh", epilog=hooks / "epilog.sh") as c:
        yield c


def wait_for(what: str, check: Callable[[], bool], timeout: float = 15) -> None:
    deadline = time.monotonic() + timeout
    while not check():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout} s waiting for {what}")
        time.sleep(0.05)


def wait_job_done(cluster: SlurmCluster, job_id: str, timeout: float = 20) -> str:
    """Wait until the job leaves squeue (epilogs included); return its final JobState."""
    wait_for(
        f"job {job_id}",
        lambda: not cluster.run("squeue", "-h", "-j", job_id).stdout.strip(),
        timeout,
    )
    show = cluster.run("scontrol", "show", "job", "-o", job_id).stdout
    return show.split("JobState=")[1].split()[0]


def test_every_node_starts_idle(cluster: SlurmCluster) -> None:
    out = cluster.run("sinfo", "-h", "-N", "-o", "%N %P %T").stdout.split("\n")
    rows = sorted(line.split() for line in out if line)
    assert rows == [
        ["node1", "train*", "idle"],
        ["node2", "train*", "idle"],
        ["node3", "train*", "idle"],
        ["spare1", "spares", "idle"],
    ]


def test_drain_shows_flag_and_reason(cluster: SlurmCluster) -> None:
    try:
        cluster.drain("node2", "xid 79 on gpu 3")
        node = cluster.node_states()["node2"]
        assert node.flags == ("DRAIN",)
        assert node.drained
        assert node.reason == "xid 79 on gpu 3"
        assert node.state == "IDLE"
        assert "State=IDLE+DRAIN" in cluster.run("scontrol", "show", "node", "-o", "node2").stdout
    finally:
        cluster.resume("node2")
    assert not cluster.node_states()["node2"].drained


def test_down_then_resume(cluster: SlurmCluster) -> None:
    try:
        cluster.down("node3", "node lost")
        node = cluster.node_states()["node3"]
        assert (node.state, node.reason) == ("DOWN", "node lost")
        assert cluster.node_states()["node1"].state == "IDLE"
    finally:
        cluster.resume("node3")
    # Resumed, the node is IDLE at once but flagged NOT_RESPONDING until slurmctld has pinged its
    # slurmd.
    assert cluster.node_states()["node3"].state == "IDLE"
    wait_for("node3 to answer", lambda: cluster.node_states()["node3"].flags == ())


def test_sbatch_runs_srun_on_two_nodes_and_hooks_on_both(
    cluster: SlurmCluster, hooks: Path
) -> None:
    jobs = cluster.root / "jobs"
    script = jobs / "two_nodes.sh"
    script.write_text(
        f"#!/bin/bash\n#SBATCH --nodes=2 --ntasks-per-node=1\n#SBATCH --output={jobs}/%j.out\nsrun "
        f"--nodes=2 --ntasks-per-node=1 --output={jobs}/%j.%t.step bash -c 'echo "
        "$SLURMD_NODENAME'\n"
    )
    job_id = cluster.run("sbatch", "--parsable", "--partition=train", str(script)).stdout.strip()
    assert wait_job_done(cluster, job_id) == "COMPLETED"
    names = sorted((jobs / f"{job_id}.{task}.step").read_text().strip() for task in (0, 1))
    assert names == ["node1", "node2"]
    # PrologFlags=Alloc: on every allocated node, not only the batch host
    for name in ("prolog", "epilog"):
        ran = sorted(p.read_text().split()[0] for p in hooks.glob(f"{name}.{job_id}.*"))
        assert ran == ["node1", "node2"], name


def test_spares_partition_takes_jobs(cluster: SlurmCluster) -> None:
    job_id = cluster.run(
        "sbatch", "--parsable", "--partition=spares", "--wrap", "srun true"
    ).stdout.strip()
    assert wait_job_done(cluster, job_id) == "COMPLETED"
    assert "NodeList=spare1" in cluster.run("scontrol", "show", "job", "-o", job_id).stdout


def test_stop_leaves_no_process_even_with_a_job_running(tmp_path: Path) -> None:
    c = SlurmCluster(tmp_path, nodes=2, spare_partition=None)
    with c:
        job_id = c.run(
            "sbatch", "--parsable", "--nodes=2", "--wrap", "srun sleep 300"
        ).stdout.strip()
        wait_for(
            "the step", lambda: c.run("squeue", "-h", "-s", "-j", job_id).stdout.count(".0") == 1
        )
        assert c.processes()
    assert c.processes() == []


def test_failed_start_raises_with_logs_and_leaves_nothing(tmp_path: Path) -> None:
    c = SlurmCluster(tmp_path, nodes=1, partition="no spaces allowed")
    # Every daemon reads the same file: whichever stops first on it is named (slurmd can beat
    # slurmctld).
    with pytest.raises(
        SlurmStartError, match=r"(slurmctld|slurmd-node1|slurmd-spare1) exited"
    ) as failed:
        c.start()
    assert "Parse error" in str(failed.value)  # the daemons' log tails come with the error
    assert c.processes() == []
