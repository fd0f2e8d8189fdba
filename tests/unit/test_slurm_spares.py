"""The Slurm spare-node keeper's decisions (`workers.detectors.slurm_spares`), with Slurm's commands
answered by a recorder: what it counts, what it submits and how it is quoted, its bound, what it
cancels. The keeper runs end to end on the real Slurm daemons in
`tests/integration/test_slurm_job.py`."""

from __future__ import annotations

import shlex
from collections.abc import Sequence
from pathlib import Path

import pytest
from pydantic import ValidationError

from job_agent import wire
from job_agent.wire.operator import RankStatus
from workers.detectors import slurm_spares, spare_nodes
from workers.detectors.slurm import SlurmError
from workers.detectors.slurm_spares import PREFIX, Queued, SlurmSpares, SpareNodeSettings
from workers.detectors.spare_nodes import RETRY_STARTS, missing


def _status(nodes: tuple[str, ...], idle: tuple[str, ...] = ()) -> wire.Status:
    """A training job on `nodes`, of which `idle` (as the job says) run no rank and may take
    some."""
    ranks = tuple(
        RankStatus(slot=i, agent=f"rank-{i}", state="training", step=5, node=n)
        for i, n in enumerate(n for n in nodes if n not in idle)
    )
    return wire.Status(
        job_id="j",
        state="training",
        generation=0,
        world_size=len(ranks),
        ranks=ranks,
        spares=2,
        nodes=nodes,
        idle_nodes=idle,
    )


def _q(state: str, node: str = "") -> Queued:
    return Queued("17", f"{PREFIX}j", state, node)


@pytest.mark.parametrize(
    ("count", "nodes", "idle", "queued", "want"),
    [
        (1, ("n1", "n2"), (), [], 1),  # no idle node, nothing queued
        (1, ("n1", "n2", "s1"), ("s1",), [_q("RUNNING", "s1")], 0),  # s1 joined, idle
        (1, ("n1", "n2"), (), [_q("PENDING")], 0),  # one waits in the queue
        (1, ("n1", "n2"), (), [_q("CONFIGURING", "s1")], 0),  # its node boots
        (1, ("n1", "n2"), (), [_q("RUNNING", "s1")], 0),  # running, its agent not joined yet
        (1, ("n1", "n2", "s1"), (), [_q("RUNNING", "s1")], 1),  # s1 took a drained node's ranks
        (2, ("n1", "n2", "n3"), ("n3",), [], 1),  # the allocation's own spare node counts
        (0, ("n1",), (), [], 0),
    ],
)
def test_what_is_missing(
    count: int, nodes: tuple[str, ...], idle: tuple[str, ...], queued: list[Queued], want: int
) -> None:
    running_on = [q.node if q.state == "RUNNING" else None for q in queued]
    assert missing(count, _status(nodes, idle), running_on) == want


class Recorder:
    """Slurm's client commands, answered from a script; every argv kept."""

    def __init__(self, queue: str = "") -> None:
        self.queue = queue
        self.calls: list[list[str]] = []
        self.next_id = 100

    def __call__(self, argv: Sequence[str]) -> str:
        self.calls.append(list(argv))
        if argv[0] == "squeue":
            return self.queue
        if argv[0] == "sbatch":
            self.next_id += 1
            return f"{self.next_id};cluster\n"
        return ""


def _keeper(
    tmp_path: Path, run: Recorder, status: wire.Status, monkeypatch: pytest.MonkeyPatch
) -> SlurmSpares:
    """A keeper over one registered, running job asking for one spare node; the job answers
    `status`."""
    job_dir = tmp_path / "jobs" / "job-1"
    job_dir.mkdir(parents=True)
    info = {
        "job_id": "job-1",
        "alive": True,
        "spare_node": {
            "count": 1,
            "spares": 2,
            "script": "/shared/train it.py",
            "args": ["--lr", "1e-3; rm -rf /"],
        },
    }
    monkeypatch.setattr(spare_nodes, "registered_jobs", lambda state_dir: [info])
    monkeypatch.setattr(spare_nodes, "ask", lambda info, frame, timeout: status)
    settings = SpareNodeSettings(
        partition="spares",
        reservation="standby",
        node_command="/opt/venv/bin/python -m torchpass.cli",
    )
    return SlurmSpares(tmp_path, settings, run=run)


def test_a_missing_spare_node_is_submitted_to_the_partition_quoted(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    run = Recorder()
    keeper = _keeper(tmp_path, run, _status(("n1", "n2")), monkeypatch)
    assert keeper.keep() == ["101"]
    (sbatch,) = [c for c in run.calls if c[0] == "sbatch"]
    assert (
        f"--job-name={PREFIX}job-1" in sbatch
        and "--partition=spares" in sbatch
        and "--nodes=1" in sbatch
    )
    assert "--reservation=standby" in sbatch and "--exclusive" in sbatch
    command = sbatch[sbatch.index("--wrap") + 1]
    # The script's path and arguments reach the node agent as words, never as shell.
    words = shlex.split(
        command.split("exec ", 1)[1]
        .replace('"$SLURMD_NODENAME"', "N")
        .replace('"$(hostname -i)"', "H")
    )
    assert words[:3] == ["/opt/venv/bin/python", "-m", "torchpass.cli"]
    assert words[-3:] == ["/shared/train it.py", "--lr", "1e-3; rm -rf /"]
    assert words[words.index("--slots") : words.index("--slots") + 2] == ["--slots", "0"]
    assert words[words.index("--spares") : words.index("--spares") + 2] == ["--spares", "2"]


def test_submissions_are_bounded_when_spare_nodes_never_join(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Each spare-node job ends at once (its agent cannot start): the queue is empty at every poll,
    yet only 1 + RETRY_STARTS are submitted within the window."""
    run = Recorder()
    keeper = _keeper(tmp_path, run, _status(("n1",)), monkeypatch)
    submitted = [s for _ in range(10) for s in keeper.keep()]
    assert len(submitted) == 1 + RETRY_STARTS


def test_a_spare_node_of_a_job_that_ended_is_cancelled(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The job's directory is here and its coordinator is not: its waiting spare node is cancelled;
    another state directory's (no such job here) is left alone."""
    sep = "\x1f"
    rows = [("55", f"{PREFIX}ended", "PENDING", ""), ("56", f"{PREFIX}elsewhere", "PENDING", "")]
    rows.append(("57", "other", "RUNNING", "x"))
    queue = "".join(sep.join(r) + "\n" for r in rows)
    run = Recorder(queue)
    (tmp_path / "jobs" / "ended").mkdir(parents=True)
    monkeypatch.setattr(spare_nodes, "registered_jobs", lambda state_dir: [])
    SlurmSpares(tmp_path, SpareNodeSettings(reservation="maint"), run=run).keep()
    assert [c for c in run.calls if c[0] == "scancel"] == [["scancel", "55"]]


def test_a_queue_it_cannot_read_keeps_nothing_and_says_so(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    def broken(argv: Sequence[str]) -> str:
        raise SlurmError(
            "squeue: exit 1: slurm_load_jobs error: Unable to contact slurm controller"
        )

    assert SlurmSpares(tmp_path, SpareNodeSettings(partition="p"), run=broken).keep() == []
    assert "could not be read" in caplog.text
    with pytest.raises(SlurmError, match="unreadable line"):
        slurm_spares.read_queue(lambda argv: f"{PREFIX}x only two\x1ffields\n")


def test_spare_nodes_need_somewhere_to_come_from() -> None:
    with pytest.raises(ValidationError, match="partition or a reservation"):
        SpareNodeSettings()
