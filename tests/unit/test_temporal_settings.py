"""The Temporal connection settings refuse, at start-up, what would connect less safely than it
looks."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from pydantic import ValidationError

from torchpass.cli import main
from workers.temporal import ExposedKeyFile, TemporalSettings


def test_a_client_certificate_without_its_key_is_an_error_not_plaintext(tmp_path: Path) -> None:
    cert = tmp_path / "client.pem"
    cert.write_text("cert")
    with pytest.raises(ValidationError, match="tls_cert and tls_key go together"):
        TemporalSettings(tls_cert=cert)
    with pytest.raises(ValidationError, match="tls_cert and tls_key go together"):
        TemporalSettings(tls_key=cert)


def test_a_tls_file_that_is_not_there_is_named(tmp_path: Path) -> None:
    with pytest.raises(ValidationError, match="tls_ca: no such file"):
        TemporalSettings(tls_ca=tmp_path / "missing.pem")


def test_plaintext_off_this_host_needs_to_be_asked_for() -> None:
    for here in ("127.0.0.1:7233", "localhost:7233", "[::1]:7233", "127.0.0.2:1"):
        assert not TemporalSettings(address=here).encrypted
    with pytest.raises(ValidationError, match=r"plaintext connection to temporal\.example:7233"):
        TemporalSettings(address="temporal.example:7233")
    assert TemporalSettings(address="temporal.example:7233", allow_plaintext=True)
    assert TemporalSettings(address="temporal.example:7233", tls=True).encrypted


def test_the_api_key_comes_from_the_environment_or_a_file_never_a_flag(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    key = tmp_path / "key"
    key.write_text("k-123\n")
    key.chmod(0o600)
    s = TemporalSettings(address="x.tmprl.cloud:7233", api_key_file=key)
    assert s.encrypted and s.key() == "k-123"
    monkeypatch.setenv("TORCHPASS_TEMPORAL_API_KEY", "k-env")
    env = TemporalSettings(address="x.tmprl.cloud:7233")
    assert env.key() == "k-env" and "k-env" not in repr(env)
    assert main(["incidents", "list", "--api-key", "k-in-ps"]) == 2
    err = capsys.readouterr().err
    assert "--api-key would show the key" in err and "k-in-ps" not in err


@pytest.mark.parametrize("mode", [0o644, 0o640, 0o604, 0o660], ids=lambda m: f"{m:04o}")
@pytest.mark.parametrize("name", ["api_key_file", "tls_key"])
def test_a_key_file_other_users_can_read_is_refused_with_the_fix(
    tmp_path: Path, name: str, mode: int
) -> None:
    """An API key or client key in a file its group or everyone can read was taken silently: it is
    refused, naming the file and the fix."""
    cert, key = tmp_path / "client.pem", tmp_path / "secret.key"
    cert.write_text("cert")
    key.write_text("k-123\n")
    key.chmod(mode)
    given: dict[str, Any] = {name: key, "tls_cert": cert} if name == "tls_key" else {name: key}
    with pytest.raises(ValidationError, match=rf"{name}: .* chmod 600 {key}") as e:
        TemporalSettings(address="x.tmprl.cloud:7233", **given)
    assert isinstance(e.value.errors()[0]["ctx"]["error"], ExposedKeyFile)
    assert f"mode {mode:04o}" in str(e.value)
    key.chmod(0o600)
    assert TemporalSettings(address="x.tmprl.cloud:7233", **given).encrypted
    key.chmod(0o400)
    assert TemporalSettings(address="x.tmprl.cloud:7233", **given).encrypted


def test_the_command_line_names_an_exposed_key_file_and_the_fix(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    key = tmp_path / "api.key"
    key.write_text("k-123\n")
    key.chmod(0o644)
    assert main(["incidents", "list", "--api-key-file", str(key)]) == 2
    err = capsys.readouterr().err
    assert f"chmod 600 {key}" in err and "k-123" not in err


LOOPBACK = [
    "127.0.0.1:7233",
    "127.1:7233",
    "127.0.0.2:1",
    "127.255.255.254:7233",
    "0x7f.1:7233",
    "localhost:7233",
    "localhost.:7233",
    "LOCALHOST.:7233",
    "LocalHost:7233",
    "[::1]:7233",
    "[0:0:0:0:0:0:0:1]:7233",
    "[::ffff:127.0.0.1]:7233",
    "[::1]",
    "::1",
    "0:0:0:0:0:0:0:1",
]
OFF_HOST = [
    "temporal.example:7233",
    "10.0.0.5:7233",
    "128.0.0.1:7233",
    "1.127:7233",
    "0.0.0.0:7233",
    "[::2]:7233",
    "[::ffff:10.0.0.1]:7233",
    "localhost.example:7233",
    "localhost..:7233",
    "mylocalhost:7233",
    "127.0.0.1.example:7233",
    "127.0.0.1 temporal.example:7233",
]


@pytest.mark.parametrize(
    ("address", "here"),
    [*((a, True) for a in LOOPBACK), *((a, False) for a in OFF_HOST)],
    ids=[*LOOPBACK, *OFF_HOST],
)
def test_every_spelling_of_loopback_is_on_this_host_and_nothing_else(
    address: str, here: bool
) -> None:
    """127.1 and localhost. were refused as off this host (plaintext to loopback needed
    --allow-plaintext); a name is never looked up, so only localhost counts among names."""
    if here:
        assert not TemporalSettings(address=address).encrypted
    else:
        with pytest.raises(ValidationError, match="off this host"):
            TemporalSettings(address=address)
