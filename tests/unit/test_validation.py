"""Environment validation: the pass rules on a job's facts, and scheduler detection with the real
probes.

Slurm is detected through fake `scontrol`/`sinfo` scripts put first on PATH. Kubernetes is detected
with the real `kubernetes` client through a kubeconfig pointing at a *stub* API server (http.server
on 127.0.0.1) that answers only GET /version: no API server can run on the CI machines.
"""

from __future__ import annotations

import json
import re
import threading
import time
import tomllib
from collections.abc import Iterator
from datetime import UTC, datetime
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import pytest
from temporalio.testing import ActivityEnvironment

from activities.validation import (
    ValidationActivities,
    ValidationSettings,
    probe_kubernetes,
    probe_slurm,
)
from torchpass.validation.checks import (
    build_report,
    evaluate_control_plane,
    evaluate_job,
    evaluate_scheduler,
    with_check,
)
from torchpass.validation.facts import (
    ControlPlaneFacts,
    JobDescription,
    SchedulerFacts,
    SchedulerProbe,
    ValidationTarget,
)
from torchpass.validation.report import (
    Check,
    CheckResult,
    CheckStatus,
    ReportStatus,
    ValidationReport,
)
from torchpass.validation.versions import SUPPORTED_TORCH, parse_version, version_in_range

ROOT = Path(__file__).resolve().parents[2]
NOW = datetime(2025, 1, 1, tzinfo=UTC)


def desc(**kw: Any) -> JobDescription:
    fields: dict[str, Any] = {
        "job_id": "j",
        "agent_version": "0.1.0",
        "state": "training",
        "generation": 0,
        "world_size": 4,
        "ranks_connected": 4,
        "spares_ready": 1,
        "spares_warming": 0,
        "backend": "gloo",
        "backend_available": True,
        "torch_version": "2.13.0+cpu",
        "cuda_available": False,
        "shard_replicas": {"model": 4},
        **kw,
    }
    return JobDescription.model_validate(fields)


def by_name(checks: list[CheckResult]) -> dict[str, CheckResult]:
    return {c.name: c for c in checks}


# --- the job's checks
# ---------------------------------------------------------------------------------


def test_a_healthy_data_parallel_job_passes_every_job_check() -> None:
    checks = evaluate_job(desc())
    assert [c.name for c in checks] == [
        Check.AGENT,
        Check.TORCH,
        Check.BACKEND,
        Check.SAME_STACK,
        Check.SPARES,
        Check.REDUNDANCY,
    ]
    assert all(c.passed for c in checks), checks


def test_an_empty_spare_pool_fails() -> None:
    c = by_name(evaluate_job(desc(spares_ready=0)))[Check.SPARES]
    assert not c.passed and "--spares" in c.detail


def test_a_pool_of_spares_still_warming_fails_and_says_to_validate_again() -> None:
    c = by_name(evaluate_job(desc(spares_ready=0, spares_warming=2)))[Check.SPARES]
    assert not c.passed and "2 warming" in c.detail and "again" in c.detail


def test_redundancy_of_one_fails() -> None:
    c = by_name(evaluate_job(desc(world_size=1, ranks_connected=1, shard_replicas={"model": 1})))
    assert not c[Check.REDUNDANCY].passed
    assert "below 2 replicas" in c[Check.REDUNDANCY].detail


def test_every_shard_needs_two_replicas() -> None:
    c = by_name(evaluate_job(desc(shard_replicas={"a": 2, "b": 1, "c": 3})))[Check.REDUNDANCY]
    assert not c.passed and "shard(s) b below" in c.detail
    assert by_name(evaluate_job(desc(shard_replicas={"a": 2, "b": 2})))[Check.REDUNDANCY].passed


def test_a_job_reporting_no_shards_fails_redundancy() -> None:
    assert not by_name(evaluate_job(desc(shard_replicas={})))[Check.REDUNDANCY].passed


@pytest.mark.parametrize(
    "kw",
    [{"ranks_connected": 3}, {"state": "starting"}, {"state": "failed"}],
    ids=["rank-missing", "starting", "failed"],
)
def test_the_agent_must_hold_every_rank_of_a_training_job(kw: dict[str, Any]) -> None:
    c = by_name(evaluate_job(desc(**kw)))[Check.AGENT]
    assert not c.passed and "every rank" in c.detail


def test_a_job_without_the_agent_fails_agent_present_with_the_reason() -> None:
    """`--no-agent`: its wrapper processes connect, so every slot looks held; the job says it runs
    no agent, and the check fails naming it (its failures would only ever restart the job)."""
    c = by_name(evaluate_job(desc(live_migration=False)))[Check.AGENT]
    assert not c.passed and "--no-agent" in c.detail and "never migrated live" in c.detail
    assert by_name(evaluate_job(desc()))[Check.AGENT].passed


def test_an_unreachable_job_fails_agent_present_and_leaves_the_rest_unchecked() -> None:
    checks = evaluate_job(None, "describe_job failed: activity ScheduleToClose timeout")
    assert not any(c.passed for c in checks)
    assert "ScheduleToClose" in checks[0].detail and checks[0].name == Check.AGENT
    assert all("not checked" in c.detail for c in checks[1:])


@pytest.mark.parametrize(
    ("version", "ok"),
    [
        ("2.6.0", True),
        ("2.13.0+cpu", True),
        ("2.99", True),
        ("2.5.1", False),
        ("3.0.0", False),
        ("1.13", False),
    ],
)
def test_the_jobs_torch_must_be_in_the_supported_range(version: str, ok: bool) -> None:
    assert by_name(evaluate_job(desc(torch_version=version)))[Check.TORCH].passed is ok


def test_an_unparsable_torch_version_fails() -> None:
    c = by_name(evaluate_job(desc(torch_version="nightly")))[Check.TORCH]
    assert not c.passed and "not a version" in c.detail


def _env(slots: tuple[int, ...], **kw: Any) -> dict[str, Any]:
    base = {"torch_version": "2.13.0+cpu", "backend": "gloo", "backend_available": True}
    return {"slots": slots, "cuda_available": False, **base, **kw}


def test_the_ranks_own_environments_are_checked_each_and_a_bad_host_is_named() -> None:
    """A job whose ranks run on two kinds of host (the coordinator's own host says nothing of them):
    each environment the ranks reported is checked, and one that fails fails the check naming its
    ranks."""
    good = {"backend": None, "torch_version": None}
    both = [_env((0, 1)), _env((2, 3), backend="nccl", cuda_available=True, nccl_version="2.21.5")]
    checks = by_name(evaluate_job(desc(**good, environments=both)))
    assert checks[Check.TORCH].passed and checks[Check.BACKEND].passed
    assert "rank(s) [2, 3]: backend nccl" in checks[Check.BACKEND].detail
    bad = [_env((0, 1)), _env((2, 3), backend="nccl", cuda_available=True, backend_available=False)]
    backend = by_name(evaluate_job(desc(**good, environments=bad)))[Check.BACKEND]
    assert not backend.passed and "rank(s) [2, 3]: backend nccl: NOT available" in backend.detail
    old = [_env((0,)), _env((1, 2, 3), torch_version="2.5.1")]
    torch_check = by_name(evaluate_job(desc(**good, environments=old)))[Check.TORCH]
    assert not torch_check.passed and "rank(s) [1, 2, 3]: torch 2.5.1 is not" in torch_check.detail


def test_nodes_on_different_stacks_fail_the_same_stack_check_naming_each() -> None:
    """Two GPU nodes, each in the supported range, one with another driver: each passes the torch
    and backend checks alone, and the job fails for being on two stacks (the finding: the check
    validated one host and said nothing of the others)."""
    gpu = {"backend": "nccl", "cuda_available": True, "nccl_version": "2.21.5"}
    a = _env((0, 1), nodes=("gpu-a",), cuda_version="12.8", driver_version="570.86", **gpu)
    b = {**a, "slots": (2, 3), "nodes": ("gpu-b",), "driver_version": "550.54"}
    flat = {"backend": None, "torch_version": None}
    checks = by_name(evaluate_job(desc(**flat, environments=[a, b])))
    assert checks[Check.TORCH].passed and checks[Check.BACKEND].passed
    stack = checks[Check.SAME_STACK]
    assert not stack.passed, stack
    assert "driver 550.54, nccl (NCCL 2.21.5) on node(s) gpu-b (rank(s) [2, 3])" in stack.detail
    assert "driver 570.86" in stack.detail and "node(s) gpu-a" in stack.detail
    same = by_name(evaluate_job(desc(**flat, environments=[{**a, "slots": (0, 1, 2, 3)}])))
    assert same[Check.SAME_STACK].passed
    assert "every rank: torch 2.13.0+cpu, CUDA 12.8, driver 570.86" in same[Check.SAME_STACK].detail


def test_no_rank_that_reported_its_environment_fails_the_torch_and_backend_checks() -> None:
    checks = by_name(evaluate_job(desc(backend=None, torch_version=None)))
    assert not checks[Check.TORCH].passed and "no rank has reported" in checks[Check.TORCH].detail
    assert not checks[Check.BACKEND].passed


def test_backends() -> None:
    assert not by_name(evaluate_job(desc(backend_available=False)))[Check.BACKEND].passed
    nccl = {"backend": "nccl", "cuda_available": True}
    assert not by_name(evaluate_job(desc(**nccl)))[Check.BACKEND].passed  # NCCL version unknown
    ok = by_name(evaluate_job(desc(**nccl, nccl_version="2.21.5")))[Check.BACKEND]
    assert ok.passed and "NCCL 2.21.5" in ok.detail
    # Ranks on gloo while CUDA is there would not be the supported NCCL path.
    assert not by_name(evaluate_job(desc(cuda_available=True)))[Check.BACKEND].passed


def test_supported_torch_range_matches_pyproject() -> None:
    deps = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["dependencies"]
    torch_dep = next(d for d in deps if re.match(r"torch\b", d))
    assert torch_dep.removeprefix("torch").replace(" ", "") == SUPPORTED_TORCH


def test_version_parsing() -> None:
    assert parse_version("2.13.0+cpu") == (2, 13, 0)
    assert parse_version("v1.30.2") == (1, 30, 2)
    assert version_in_range("2.6", ">=2.6.0,<3") and not version_in_range("3", ">=2.6,<3")
    assert version_in_range("2.7", "==2.7.0") and not version_in_range("2.7", "!=2.7")
    with pytest.raises(ValueError):
        version_in_range("2.7", "~=2.7")


# --- control plane and scheduler
# ----------------------------------------------------------------------


def control(**kw: Any) -> ControlPlaneFacts:
    fields: dict[str, Any] = {
        "task_queue": "q",
        "namespace": "default",
        "temporal_server_version": "1.32.0",
        "torch_version": "2.13.0+cpu",
        "gloo_available": True,
        **kw,
    }
    return ControlPlaneFacts.model_validate(fields)


def test_a_healthy_control_plane_passes() -> None:
    temporal, torch = evaluate_control_plane(control())
    assert temporal.passed and "1.32.0" in temporal.detail
    assert torch.passed and "gloo" in torch.detail


def test_control_plane_failures() -> None:
    assert not evaluate_control_plane(control(temporal_error="UNAVAILABLE: refused"))[0].passed
    no_torch = evaluate_control_plane(
        control(torch_version=None, torch_error="ImportError: no torch")
    )[1]
    assert not no_torch.passed and "not importable" in no_torch.detail
    assert not evaluate_control_plane(control(gloo_available=False))[1].passed
    assert not evaluate_control_plane(control(cuda_available=True))[1].passed  # CUDA without NCCL


def probe(name: str, found: bool) -> SchedulerProbe:
    return SchedulerProbe.model_validate(
        {"scheduler": name, "found": found, "detail": f"{name} seen"}
    )


def test_no_scheduler_fails_with_what_was_seen() -> None:
    c = evaluate_scheduler(
        SchedulerFacts(probes=(probe("slurm", False), probe("kubernetes", False)))
    )
    assert not c.passed and "neither Kubernetes nor Slurm" in c.detail and "slurm seen" in c.detail


def test_a_local_run_is_waived_never_passed_under_the_explicit_override() -> None:
    facts = SchedulerFacts(probes=(probe("slurm", False),), allow_local=True)
    c = evaluate_scheduler(facts)
    assert c.status is CheckStatus.WAIVED and not c.passed
    assert (
        "TORCHPASS_VALIDATION_ALLOW_LOCAL" in c.detail and "local-development override" in c.detail
    )
    assert "WAIVED" in c.detail and "customer contract" in c.detail
    # A scheduler found is a pass, override or not.
    found = evaluate_scheduler(SchedulerFacts(probes=(probe("slurm", True),), allow_local=True))
    assert found.status is CheckStatus.PASSED and found.passed


def test_a_report_with_a_waiver_is_not_passed_but_lists_the_waived_checks() -> None:
    ok, waived = (
        CheckResult(name="a", passed=True),
        CheckResult(name="s", status=CheckStatus.WAIVED),
    )
    report = build_report("c", "j", [ok, waived], NOW)
    assert report.status is ReportStatus.PASSED_WITH_WAIVERS and not report.passed
    assert report.waived == ("s",)
    failed = with_check(report, CheckResult(name="b", passed=False))
    assert failed.status is ReportStatus.FAILED and not failed.passed and failed.waived == ("s",)
    clean = build_report("c", "j", [ok], NOW)
    assert clean.status is ReportStatus.PASSED and clean.passed and clean.waived == ()
    # The JSON keeps `passed` beside `status`, and reads back the same.
    data = json.loads(report.model_dump_json())
    assert (data["status"], data["passed"], data["waived"]) == ("passed_with_waivers", False, ["s"])
    assert [(c["status"], c["passed"]) for c in data["checks"]] == [
        ("passed", True),
        ("waived", False),
    ]
    assert ValidationReport.model_validate_json(report.model_dump_json()) == report


def test_a_report_cannot_claim_a_pass_its_checks_do_not_show() -> None:
    waived = CheckResult(name="s", status=CheckStatus.WAIVED)
    with pytest.raises(ValueError, match="its checks say passed_with_waivers"):
        ValidationReport(
            contract_id="c", job_id="j", passed=True, checks=(waived,), validated_at=NOW
        )
    with pytest.raises(ValueError, match="contradicts"):
        CheckResult(name="s", status=CheckStatus.WAIVED, passed=True)
    with pytest.raises(ValueError, match="status"):
        CheckResult.model_validate({"name": "s"})


def test_a_report_saved_before_statuses_existed_still_decodes() -> None:
    """The payload ContractWorkflow histories in tests/histories/ hold: `passed` only, no status."""
    old = (
        '{"contract_id":"c","job_id":"j","passed":%s,"checks":[{"name":"torch_backend","passed":%s,'
        '"detail":""}],"validated_at":"2037-10-30T01:00:00.615000Z"}'
    )
    passed = ValidationReport.model_validate_json(old % ("true", "true"))
    assert passed.status is ReportStatus.PASSED and passed.checks[0].status is CheckStatus.PASSED
    failed = ValidationReport.model_validate_json(old % ("false", "false"))
    assert failed.status is ReportStatus.FAILED and failed.checks[0].status is CheckStatus.FAILED


def test_either_scheduler_passes() -> None:
    c = evaluate_scheduler(
        SchedulerFacts(probes=(probe("slurm", False), probe("kubernetes", True)))
    )
    assert c.passed and c.detail.startswith("kubernetes detected")


def test_the_report_passes_only_when_every_check_passed() -> None:
    ok = CheckResult(name="a", passed=True)
    report = build_report("c", "j", [ok, ok], NOW)
    assert report.passed
    assert not with_check(report, CheckResult(name="b", passed=False)).passed
    assert not build_report("c", "j", [ok, CheckResult(name="b", passed=False)], NOW).passed


# --- Slurm detection: fake client binaries on PATH
# ----------------------------------------------------


@pytest.fixture
def bare_env(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """No scheduler at all: an empty PATH directory, no Slurm or in-cluster variables, no
    kubeconfig."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    monkeypatch.setenv("PATH", str(bin_dir))
    for var in ("SLURM_JOB_ID", "KUBERNETES_SERVICE_HOST", "TORCHPASS_VALIDATION_ALLOW_LOCAL"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv("KUBECONFIG", str(tmp_path / "no-kubeconfig"))
    return bin_dir


def fake(bin_dir: Path, name: str, body: str) -> None:
    script = bin_dir / name
    script.write_text(f"#!/bin/sh\n{body}\n")
    script.chmod(0o755)


def test_slurm_is_detected_when_its_controller_is_up(
    bare_env: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    fake(bare_env, "scontrol", 'echo "Slurmctld(primary) at ctl1 is UP"')
    fake(bare_env, "sinfo", 'echo "slurm 22.05.8"')
    monkeypatch.setenv("SLURM_JOB_ID", "4242")
    p = probe_slurm(ValidationSettings())
    assert (
        p.found
        and "ctl1 is UP" in p.detail
        and "22.05.8" in p.detail
        and "SLURM_JOB_ID=4242" in p.detail
    )


def test_slurm_with_its_controller_down_is_not_detected(bare_env: Path) -> None:
    fake(bare_env, "scontrol", 'echo "Slurmctld(primary) at ctl1 is DOWN"; exit 1')
    p = probe_slurm(ValidationSettings())
    assert not p.found and "exited 1" in p.detail and "DOWN" in p.detail


def test_no_slurm_client_is_not_detected(bare_env: Path) -> None:
    p = probe_slurm(ValidationSettings())
    assert not p.found and "scontrol is not on PATH" in p.detail


def test_a_hanging_slurm_command_is_bounded(
    bare_env: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    fake(bare_env, "scontrol", "exec /bin/sleep 30")
    monkeypatch.setenv("TORCHPASS_VALIDATION_COMMAND_TIMEOUT", "0.5")
    settings = ValidationSettings()
    assert settings.command_timeout == 0.5
    p = probe_slurm(settings)
    # Stopped at its timeout (0.5 s, the one it was given): one left to end on its own (30 s) would
    # have answered, with nothing on stdout ("controller not up").
    assert not p.found and "did not answer" in p.detail


# --- Kubernetes detection: the real client against a stub API server
# ----------------------------------


# The shape a real API server returns for GET /version (the client validates every field).
VERSION = {
    "major": "1",
    "minor": "30",
    "gitVersion": "v1.30.0-stub",
    "gitCommit": "0" * 40,
    "gitTreeState": "clean",
    "buildDate": "2024-04-17T00:00:00Z",
    "goVersion": "go1.22.2",
    "compiler": "gc",
    "platform": "linux/amd64",
}


class _StubApi(BaseHTTPRequestHandler):
    """A stub, not Kubernetes: answers GET /version like an API server and records the
    Authorization."""

    seen: list[str | None] = []

    def do_GET(self) -> None:
        _StubApi.seen.append(self.headers.get("Authorization"))
        if self.path.rstrip("/") != "/version":  # the client asks for /version/
            self.send_error(404)
            return
        body = json.dumps(VERSION).encode()
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, format: str, *args: Any) -> None:
        pass


@pytest.fixture
def stub_api() -> Iterator[str]:
    server = ThreadingHTTPServer(("127.0.0.1", 0), _StubApi)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}"
    finally:
        server.shutdown()
        server.server_close()
        thread.join(timeout=5)


def kubeconfig(path: Path, server: str) -> Path:
    path.write_text(
        json.dumps(
            {
                "apiVersion": "v1",
                "kind": "Config",
                "clusters": [{"name": "stub", "cluster": {"server": server}}],
                "users": [{"name": "me", "user": {"token": "stub-token"}}],
                "contexts": [{"name": "stub", "context": {"cluster": "stub", "user": "me"}}],
                "current-context": "stub",
            }
        )
    )
    return path


def test_kubernetes_is_detected_through_a_kubeconfig(
    bare_env: Path, stub_api: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("KUBECONFIG", str(kubeconfig(tmp_path / "config", stub_api)))
    _StubApi.seen.clear()
    p = probe_kubernetes(ValidationSettings())
    assert p.found, p.detail
    assert "v1.30.0-stub" in p.detail and stub_api in p.detail
    assert _StubApi.seen == ["Bearer stub-token"]


def test_no_kubeconfig_and_no_cluster_is_not_detected(bare_env: Path) -> None:
    p = probe_kubernetes(ValidationSettings())
    assert not p.found and "KUBERNETES_SERVICE_HOST unset" in p.detail


def test_an_api_server_that_does_not_answer_is_not_detected(
    bare_env: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    server = ThreadingHTTPServer(("127.0.0.1", 0), _StubApi)
    dead = f"http://127.0.0.1:{server.server_address[1]}"
    server.server_close()  # nothing listens there any more
    monkeypatch.setenv("KUBECONFIG", str(kubeconfig(tmp_path / "config", dead)))
    monkeypatch.setenv("TORCHPASS_VALIDATION_API_TIMEOUT", "2")
    settings = ValidationSettings()
    t0 = time.monotonic()
    p = probe_kubernetes(settings)
    # Liveness, not speed: the probe of a dead server is bounded by its API timeout (two attempts at
    # most, each bounded by it); refused at once here, it must not wait any longer than that.
    assert time.monotonic() - t0 < 5 * settings.api_timeout
    assert not p.found and "kubeconfig" in p.detail


def test_in_cluster_without_a_service_account_is_not_detected(
    bare_env: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("KUBERNETES_SERVICE_HOST", "10.0.0.1")
    monkeypatch.setenv("KUBERNETES_SERVICE_PORT", "443")
    p = probe_kubernetes(ValidationSettings())
    assert not p.found and "in-cluster" in p.detail


async def test_detect_scheduler_activity_reports_both_probes(
    bare_env: Path, stub_api: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    fake(bare_env, "scontrol", "exit 1")
    monkeypatch.setenv("KUBECONFIG", str(kubeconfig(tmp_path / "config", stub_api)))
    facts = await ActivityEnvironment().run(
        ValidationActivities(ValidationSettings()).detect_scheduler, ValidationTarget(job_id="j")
    )
    assert [(p.scheduler, p.found) for p in facts.probes] == [
        ("slurm", False),
        ("kubernetes", True),
    ]
    assert evaluate_scheduler(facts).passed and not facts.allow_local


async def test_a_bare_machine_fails_the_scheduler_check_unless_waived(
    bare_env: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    acts = ValidationActivities(ValidationSettings())
    facts = await ActivityEnvironment().run(acts.detect_scheduler, ValidationTarget(job_id="j"))
    assert not evaluate_scheduler(facts).passed
    monkeypatch.setenv("TORCHPASS_VALIDATION_ALLOW_LOCAL", "true")
    acts = ValidationActivities(ValidationSettings())
    facts = await ActivityEnvironment().run(acts.detect_scheduler, ValidationTarget(job_id="j"))
    waived = evaluate_scheduler(facts)
    assert facts.allow_local and waived.status is CheckStatus.WAIVED and not waived.passed
