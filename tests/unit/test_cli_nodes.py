"""`torchpass run --nnodes` and `torchpass node` refuse what cannot work, before they start
anything."""

from __future__ import annotations

from pathlib import Path

import pytest

from job_agent.node.agent import EXIT_REFUSED
from torchpass.cli import main

SCRIPT = str(Path(__file__).resolve().parents[2] / "examples" / "train_dp.py")


@pytest.mark.parametrize(
    ("argv", "says"),
    [
        (["--nnodes", "2"], "--nproc-per-node"),
        (["--nnodes", "2", "--nproc-per-node", "2", "--nproc", "3"], "--nproc-per-node"),
        (["--remote"], "go with --nnodes"),
        (["--host", "0.0.0.0"], "reach the coordinator at"),
    ],
    ids=["no-ranks-per-node", "world-disagrees", "remote-alone", "wildcard-address"],
)
def test_run_refuses_a_world_it_cannot_place(
    argv: list[str],
    says: str,
    capsys: pytest.CaptureFixture[str],
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("TORCHPASS_STATE_DIR", str(tmp_path))
    assert main(["run", *argv, SCRIPT]) == 2
    err = capsys.readouterr().err
    assert says in err, err


def test_a_node_without_the_jobs_secret_says_so(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    argv = ["node", "--job", "job-1", "--coordinator", "127.0.0.1:9", "--host", "127.0.0.1"]
    assert main([*argv, "--secret-file", str(tmp_path / "missing"), SCRIPT]) == EXIT_REFUSED
    assert "cannot read the job's secret" in capsys.readouterr().err


def test_a_node_whose_copy_of_the_secret_others_can_read_is_refused_with_the_fix(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    """The job's secret copied to a node readable by its other users (0644, a plain copy) was
    taken silently: it is refused, naming the file and the fix, before the node reaches the
    coordinator."""
    secret = tmp_path / "job.secret"
    secret.write_text("00" * 32)
    secret.chmod(0o644)
    argv = ["node", "--job", "job-1", "--coordinator", "127.0.0.1:9", "--host", "127.0.0.1"]
    assert main([*argv, "--secret-file", str(secret), SCRIPT]) == EXIT_REFUSED
    err = capsys.readouterr().err
    assert f"chmod 600 {secret}" in err and "mode 0644" in err, err
