"""Validation activities served by the control worker: the control plane, the cluster scheduler, and
the recording of a report on its contract.

The first two gather facts; `torchpass.validation.checks` judges them. The job's own facts come from
`describe_job` on the job's task queue (activities/job.py). Every external call is bounded: the
Temporal RPCs by their timeout, Slurm commands through `run_slurm`, the Kubernetes API by
`_request_timeout`.
"""

from __future__ import annotations

import asyncio
import shutil
import subprocess
from collections.abc import Callable, Sequence
from datetime import timedelta
from pathlib import Path
from typing import Any

from temporalio import activity
from temporalio.api.workflowservice.v1 import GetSystemInfoRequest
from temporalio.client import Client, WorkflowUpdateFailedError
from temporalio.exceptions import ApplicationError
from temporalio.service import RPCError, RPCStatusCode

from activities.validation_settings import ValidationSettings
from torchpass.contract.coverage import JobCoverage
from torchpass.ids import ContractMessage, ValidationActivity, contract_workflow_id
from torchpass.validation.facts import (
    ControlPlaneFacts,
    SchedulerFacts,
    SchedulerProbe,
    ValidationTarget,
)
from torchpass.validation.report import RecordValidationInput, RecordValidationResult


class SlurmUnavailable(Exception):
    """A Slurm command is not installed here or did not answer in time."""


def run_slurm(args: Sequence[str], timeout: float) -> str:
    """Run one Slurm client command, bounded and without a shell; its stdout, or
    SlurmUnavailable."""
    exe = shutil.which(args[0])
    if exe is None:
        raise SlurmUnavailable(f"{args[0]} is not on PATH")
    try:
        done = subprocess.run(
            [exe, *args[1:]], capture_output=True, text=True, timeout=timeout, check=False
        )
    except subprocess.TimeoutExpired as e:
        raise SlurmUnavailable(f"{' '.join(args)} did not answer within {timeout:.0f} s") from e
    except OSError as e:
        raise SlurmUnavailable(f"{' '.join(args)} could not run: {e}") from e
    if done.returncode != 0:
        err = (done.stderr or done.stdout).strip()[:300]
        raise SlurmUnavailable(f"{' '.join(args)} exited {done.returncode}: {err}")
    return done.stdout.strip()


def probe_slurm(s: ValidationSettings) -> SchedulerProbe:
    """Slurm is there when its controller answers `scontrol ping` as UP."""
    in_job = f"; SLURM_JOB_ID={s.slurm_job_id}" if s.slurm_job_id else ""
    try:
        ping = run_slurm(["scontrol", "ping"], s.command_timeout)
    except SlurmUnavailable as e:
        return SchedulerProbe(scheduler="slurm", found=False, detail=f"{e}{in_job}")
    if " is UP" not in ping:
        return SchedulerProbe(
            scheduler="slurm", found=False, detail=f"controller not up: {ping[:300]}{in_job}"
        )
    try:
        version = run_slurm(["sinfo", "--version"], s.command_timeout)
    except SlurmUnavailable as e:
        version = f"version unknown ({e})"
    return SchedulerProbe(
        scheduler="slurm", found=True, detail=f"{ping[:300]}; {version[:100]}{in_job}"
    )


def _kubeconfig(s: ValidationSettings) -> Path | None:
    candidates = [Path(p) for p in (s.kubeconfig or "").split(":") if p] or [
        Path.home() / ".kube" / "config"
    ]
    return next((p for p in candidates if p.is_file()), None)


def probe_kubernetes(s: ValidationSettings) -> SchedulerProbe:
    """Kubernetes is there when its API server answers /version, in-cluster or through a
    kubeconfig."""
    from kubernetes import client, config
    from kubernetes.client.exceptions import ApiException
    from kubernetes.config.config_exception import ConfigException
    from urllib3.exceptions import HTTPError

    cfg = client.Configuration()
    where = "in-cluster configuration"
    try:
        if s.kubernetes_service_host:
            config.load_incluster_config(client_configuration=cfg)
        else:
            path = _kubeconfig(s)
            if path is None:
                return SchedulerProbe(
                    scheduler="kubernetes",
                    found=False,
                    detail="not in a cluster (KUBERNETES_SERVICE_HOST unset) and no kubeconfig "
                    "found",
                )
            where = f"kubeconfig {path}"
            config.load_kube_config(
                config_file=str(path), client_configuration=cfg, persist_config=False
            )
        # one retry: a flaky connection is not a missing cluster, a dead one is quick to see
        cfg.retries = 1
        with client.ApiClient(cfg) as api:
            info = client.VersionApi(api).get_code(_request_timeout=s.api_timeout)
    except (ConfigException, ApiException, HTTPError, OSError, ValueError) as e:
        detail = f"{where}: {type(e).__name__}: {e}"
        return SchedulerProbe(scheduler="kubernetes", found=False, detail=detail[:2000])
    return SchedulerProbe(
        scheduler="kubernetes",
        found=True,
        detail=f"API server {cfg.host} version {info.git_version} ({where})",
    )


def _torch_facts() -> dict[str, Any]:
    try:
        import torch
        import torch.distributed as dist
    except ImportError as e:  # a control plane without torch fails the check, it does not crash
        return {"torch_error": f"{type(e).__name__}: {e}"}
    cuda = torch.cuda.is_available()
    nccl = dist.is_available() and dist.is_nccl_available()
    facts: dict[str, Any] = {
        "torch_version": str(torch.__version__),
        "gloo_available": dist.is_available() and dist.is_gloo_available(),
        "nccl_available": nccl,
        "cuda_available": cuda,
    }
    if cuda and nccl:
        v = torch.cuda.nccl.version()
        facts["nccl_version"] = ".".join(map(str, v)) if isinstance(v, tuple) else str(v)
    return facts


class ValidationActivities:
    """Built by the control worker; `client` describes the Temporal server (default: the worker's
    own)."""

    def __init__(self, settings: ValidationSettings, client: Client | None = None) -> None:
        self.settings = settings
        self._client = client

    @activity.defn(name=ValidationActivity.CHECK_CONTROL_PLANE)
    async def check_control_plane(self, inp: ValidationTarget) -> ControlPlaneFacts:
        # Running at all proves this worker polls Temporal; asking the server for its version proves
        # the client can still reach it now, and names the server in the report.
        info = activity.info()
        client = self._client or activity.client()
        version, error = None, None
        try:
            # retried by the client on a transient error (a busy server is not an unreachable one)
            resp = await client.workflow_service.get_system_info(
                GetSystemInfoRequest(),
                retry=True,
                timeout=timedelta(seconds=self.settings.api_timeout),
            )
            version = resp.server_version or None
        except RPCError as e:
            error = f"{e.status.name}: {e.message}"
        return ControlPlaneFacts(
            task_queue=info.task_queue,
            namespace=info.workflow_namespace,
            temporal_server_version=version,
            temporal_error=error,
            **await asyncio.to_thread(_torch_facts),
        )

    @activity.defn(name=ValidationActivity.DETECT_SCHEDULER)
    async def detect_scheduler(self, inp: ValidationTarget) -> SchedulerFacts:
        slurm, kube = await asyncio.gather(
            asyncio.to_thread(probe_slurm, self.settings),
            asyncio.to_thread(probe_kubernetes, self.settings),
        )
        return SchedulerFacts(probes=(slurm, kube), allow_local=self.settings.allow_local)

    @activity.defn(name=ValidationActivity.RECORD_VALIDATION)
    async def record_validation(self, inp: RecordValidationInput) -> RecordValidationResult:
        """Run ContractWorkflow's `record_validation` update; a missing or refusing contract is an
        answer, not an error (only an unreachable server is retried)."""
        client = self._client or activity.client()
        handle = client.get_workflow_handle(
            contract_workflow_id(inp.customer_id, inp.report.contract_id)
        )
        try:
            coverage = await handle.execute_update(
                ContractMessage.RECORD_VALIDATION,
                inp.report,
                result_type=JobCoverage,
                rpc_timeout=timedelta(seconds=self.settings.api_timeout),
            )
        except RPCError as e:
            if e.status != RPCStatusCode.NOT_FOUND:
                raise  # the server did not answer: retried
            return RecordValidationResult(
                recorded=False, detail=f"no running contract: {e.message}"[:2000]
            )
        except WorkflowUpdateFailedError as e:
            why = (
                f"{e.cause.type}: {e.cause.message}"
                if isinstance(e.cause, ApplicationError)
                else str(e)
            )
            return RecordValidationResult(
                recorded=False, detail=f"the contract refused it: {why}"[:2000]
            )
        status = coverage.changes[-1].status.value if coverage.changes else "unknown"
        return RecordValidationResult(recorded=True, detail=f"job {coverage.job_id} now {status}")


def validation_activities(
    settings: ValidationSettings, client: Client | None = None
) -> list[Callable[..., Any]]:
    """The activity callables for the control worker."""
    acts = ValidationActivities(settings, client)
    return [acts.check_control_plane, acts.detect_scheduler, acts.record_validation]
