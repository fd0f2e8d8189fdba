"""State flattening, digests and the authenticated transfer, point to point and striped over several
donors, with real tensors and sockets (the donors that fail are real sockets speaking the real
protocol)."""

from __future__ import annotations

import threading
from datetime import timedelta
from typing import Any

import pytest
import torch

from job_agent import wire
from job_agent.rank.state import TrackedState, shard_file
from job_agent.transfer.donor import StateServer, TransferError
from job_agent.transfer.receiver import receive_state

SECRET = b"k" * 32
WAIT = timedelta(seconds=10)


def _trained(seed: int, width: int = 32) -> TrackedState:
    torch.manual_seed(seed)
    model = torch.nn.Sequential(
        torch.nn.Linear(width, width), torch.nn.ReLU(), torch.nn.Linear(width, 1)
    )
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=2)
    for _ in range(3):
        opt.zero_grad()
        model(torch.randn(8, width)).pow(2).mean().backward()
        opt.step()
        sched.step()
    return TrackedState(model, opt, {"sched": sched})


def _fresh(seed: int, width: int = 32) -> TrackedState:
    torch.manual_seed(seed)
    model = torch.nn.Sequential(
        torch.nn.Linear(width, width), torch.nn.ReLU(), torch.nn.Linear(width, 1)
    )
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    state = TrackedState(model, opt, {"sched": torch.optim.lr_scheduler.StepLR(opt, step_size=2)})
    state.warm()
    return state


def _serve(
    state: TrackedState, step: int, receivers: int = 1, secret: bytes = SECRET
) -> tuple[StateServer, dict]:
    server = StateServer(SECRET, "127.0.0.1")
    out: dict = {}

    def run() -> None:
        try:
            out["digest"] = server.serve(
                state.snapshot(step), receivers, timedelta(seconds=10), lambda n: None
            )
        except TransferError as e:
            out["error"] = e

    out["thread"] = threading.Thread(target=run)
    out["thread"].start()
    return server, out


def _at(*ports: int) -> list[wire.Source]:
    """Donors on this host: slot i serves on ports[i]."""
    return [wire.Source(slot=i, host="127.0.0.1", port=p) for i, p in enumerate(ports)]


def test_the_digest_depends_on_every_byte_and_the_step() -> None:
    a = _trained(0)
    d = a.snapshot(5).digest()
    assert d == a.snapshot(5).digest()
    assert d != a.snapshot(6).digest()
    next(iter(a.model.parameters())).data.view(-1)[0] += 1e-7
    assert d != a.snapshot(5).digest()


def test_a_spare_receives_model_optimizer_and_extras_bit_for_bit() -> None:
    donor, spare = _trained(0), _fresh(1)
    before = [t.data_ptr() for _, t in spare.snapshot(0).tensors]
    server, out = _serve(donor, 3)
    stats = receive_state(spare, _at(server.port), SECRET, timedelta(seconds=10))
    out["thread"].join(10)
    assert stats.step == 3
    assert stats.digest == out["digest"] == donor.snapshot(3).digest() == spare.snapshot(3).digest()
    assert spare.extras["sched"].state_dict() == donor.extras["sched"].state_dict()
    # Received in place: the warm spare's own memory holds the state now.
    assert [t.data_ptr() for _, t in spare.snapshot(0).tensors] == before


def test_one_donor_serves_several_receivers() -> None:
    donor = _trained(0)
    server, out = _serve(donor, 9, receivers=2)
    digests = [
        receive_state(_fresh(s), _at(server.port), SECRET, timedelta(seconds=10)).digest
        for s in (1, 2)
    ]
    out["thread"].join(10)
    assert digests == [out["digest"]] * 2


def test_a_peer_without_the_secret_gets_nothing_and_the_real_receiver_still_does() -> None:
    donor = _trained(0)
    server, out = _serve(donor, 1)
    with pytest.raises(TransferError):
        receive_state(_fresh(1), _at(server.port), b"wrong" * 8, timedelta(seconds=5))
    stats = receive_state(_fresh(2), _at(server.port), SECRET, timedelta(seconds=5))
    out["thread"].join(10)
    assert stats.digest == out["digest"]


def test_a_state_of_another_architecture_is_refused() -> None:
    donor = _trained(0, width=32)
    server, out = _serve(donor, 1)
    with pytest.raises(TransferError, match="does not fit"):
        receive_state(_fresh(1, width=16), _at(server.port), SECRET, timedelta(seconds=5))
    out["thread"].join(10)


def test_a_checkpoint_restores_the_same_state(tmp_path) -> None:
    a = _trained(0)
    a.save_checkpoint(tmp_path / "c.pt", 3)
    b = _fresh(1)
    assert b.load_checkpoint(tmp_path / "c.pt") == 3
    assert b.snapshot(3).digest() == a.snapshot(3).digest()


def test_replicas_report_the_same_shard_and_other_layouts_another() -> None:
    """The redundancy a job reports is measured from what each rank holds, never assumed."""
    a, b = _trained(0), _fresh(1)  # different values, the same structure: replicas of one shard
    assert a.layout() == b.layout() and a.layout().parallelism == "data_parallel"
    assert _trained(0, width=16).layout().shard != a.layout().shard


def test_a_sharded_parameter_is_a_shard_of_its_own(tmp_path) -> None:
    """A DTensor sharded over a (one-rank) mesh: reported as sharded, keyed by its placement and
    place."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    store = dist.FileStore(str(tmp_path / "store"), 1)
    dist.init_process_group("gloo", store=store, rank=0, world_size=1)
    try:
        mesh = init_device_mesh("cpu", (1,))
        model = torch.nn.Linear(4, 4)
        plain = TrackedState(model).layout()
        model.weight = torch.nn.Parameter(
            distribute_tensor(model.weight.detach(), mesh, [Shard(0)])
        )
        sharded = TrackedState(model).layout()
    finally:
        dist.destroy_process_group()
    assert sharded.parallelism == "sharded" and sharded.shard != plain.shard


def test_strays_before_the_receiver_are_skipped_and_the_transfer_goes_on() -> None:
    """A connect-then-close, six garbage bytes and a silent connection reach the donor first; each
    is dropped (the silent one after AUTH_TIMEOUT) and the real receiver still gets the state."""
    import socket

    from job_agent.transfer.donor import AUTH_TIMEOUT

    donor = _trained(0)
    server, out = _serve(donor, 3, receivers=2)
    addr = ("127.0.0.1", server.port)
    socket.create_connection(addr).close()
    with socket.create_connection(addr) as garbage:
        garbage.sendall(b"\x00garba")
    silent = socket.create_connection(addr)
    try:
        stats = receive_state(_fresh(1), _at(server.port), SECRET, WAIT)
        again = receive_state(_fresh(2), _at(server.port), SECRET, WAIT)
        # The donor hung up on the silent one (its end is there to read), not left it open.
        silent.settimeout(AUTH_TIMEOUT.total_seconds())
        try:
            while silent.recv(4096):  # the donor's challenge, never answered
                pass
        except TimeoutError:
            pytest.fail("the donor left the silent connection open")
    finally:
        silent.close()
    out["thread"].join(10)
    assert "error" not in out and stats.digest == again.digest == out["digest"]


def test_each_rank_of_a_sharded_job_keeps_its_own_shard_files_rotated(tmp_path) -> None:
    """Rank 0's file is the checkpoint's name; every other rank's shard is beside it, and each rank
    keeps its own latest `keep` (one rank's files never push another's out)."""
    a = _trained(0)
    for step in (19, 39, 59):
        for slot in (0, 1, 2):
            a.save_rotated(tmp_path, step, keep=2, slot=slot)
    names = sorted(p.name for p in tmp_path.glob("step-*.pt"))
    assert names == [
        "step-00000039.pt",
        "step-00000039.rank-1.pt",
        "step-00000039.rank-2.pt",
        "step-00000059.pt",
        "step-00000059.rank-1.pt",
        "step-00000059.rank-2.pt",
    ]
    assert (
        shard_file(tmp_path / "step-00000059.pt", 2).exists()
        and shard_file(tmp_path / "x.pt", 0).name == "x.pt"
    )


def test_a_sharded_state_moves_as_its_local_shards_and_loads_back_as_dtensors(tmp_path) -> None:
    """FSDP2 on a one-rank mesh: the snapshot holds each DTensor's local tensor (the same memory, so
    a receiver takes it in place), and a checkpoint loads back into the DTensors, optimizer state
    included."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import DTensor

    store = dist.FileStore(str(tmp_path / "store"), 1)
    dist.init_process_group("gloo", store=store, rank=0, world_size=1)
    try:
        mesh = init_device_mesh("cpu", (1,))

        def build(seed: int) -> TrackedState:
            torch.manual_seed(seed)
            model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Linear(8, 2))
            fully_shard(model, mesh=mesh)
            opt = torch.optim.AdamW(model.parameters(), lr=0.1)
            model(torch.randn(4, 8)).sum().backward()
            opt.step()
            return TrackedState(model, opt)

        a, b = build(0), build(1)
        snap = a.snapshot(5)
        assert snap.tensors and not any(isinstance(t, DTensor) for _, t in snap.tensors)
        weight: Any = next(p for p in a.model.parameters())
        # no copy
        assert any(t.data_ptr() == weight._local_tensor.data_ptr() for _, t in snap.tensors)
        a.save_checkpoint(tmp_path / "c.pt", 5)
        assert b.snapshot(5).digest() != snap.digest()
        assert b.load_checkpoint(tmp_path / "c.pt") == 5
        assert b.snapshot(5).digest() == snap.digest()
        assert all(isinstance(p, DTensor) for p in b.model.parameters())
        assert b.optimizer is not None
        assert all(
            isinstance(v, DTensor)
            for s in b.optimizer.state.values()
            for v in s.values()
            if v.dim()
        )
    finally:
        dist.destroy_process_group()
