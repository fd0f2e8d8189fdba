"""The cluster's enrolment key on a job host (`workers.job.enrolment_key`, `endorsement`): made by
`torchpass contract enrolment-key` (its owner's alone), refused readable by others or malformed,
and vouching for the job's own key in a way only its public half verifies."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from torchpass.cli import main
from torchpass.incident.attestation import JobKey, endorsed
from torchpass.job import JobSpec
from workers.job import endorsement, enrolment_key
from workers.temporal import ExposedKeyFile


def test_the_enrolment_key_vouches_for_the_jobs_key(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "enrolment.key"
    assert main(["contract", "enrolment-key", "--out", str(out)]) == 0
    public = capsys.readouterr().out.strip()
    assert (os.stat(out).st_mode & 0o777) == 0o600
    assert main(["contract", "enrolment-key", "--out", str(out)]) != 0  # never over a key
    spec = JobSpec(job_id="j", script=out, state_dir=tmp_path, enrolment_key_file=out)
    key = JobKey.generate()
    word = endorsement(spec, key)
    assert endorsed(public, "j", key.public, word)
    assert not endorsed(public, "j", JobKey.generate().public, word)
    assert endorsement(spec.model_copy(update={"enrolment_key_file": None}), key) is None


def test_an_enrolment_key_others_can_read_or_that_is_no_key_is_refused(tmp_path: Path) -> None:
    exposed = tmp_path / "exposed.key"
    exposed.write_text(JobKey.generate().private_hex())
    exposed.chmod(0o644)
    with pytest.raises(ExposedKeyFile, match="chmod 600"):
        enrolment_key(exposed)
    garbage = tmp_path / "garbage.key"
    garbage.write_text("not a key")
    garbage.chmod(0o600)
    with pytest.raises(ValueError, match="enrolment-key --out"):
        enrolment_key(garbage)
