"""The receiver's side of a state transfer: the state taken in disjoint slices from several replicas
at once, each slice verified, a failed donor's slice taken again from another, and nothing installed
unless the whole state arrived and hashes to what the donors hold (`job_agent.transfer.donor` is the
donor's side).

A slice is a byte range of the tensors laid end to end in manifest order, one per donor, received
straight into the receiver's own memory. Each is hashed as it arrives and compared with the digest
its donor computed of what it sent; a donor that fails, stalls past `STALL` or sends a slice that
differs is dropped, and its slice goes to the next donor free. The state's digest (the donors'
definition: header and every byte) is computed in order while the slices arrive, and the state is
installed only when it equals the digest every donor reported of its own state: replicas that differ
fail the transfer, never mix.
"""

from __future__ import annotations

import contextlib
import itertools
import socket
import threading
import time
from collections import deque
from collections.abc import Iterator, Sequence
from datetime import timedelta

import torch

from job_agent import wire
from job_agent.transfer.donor import CHUNK, Hasher, Progress, TransferError, TransferStats, tune
from job_agent.transfer.snapshot import Snapshot, StateMismatch, Transferable, state_hash
from job_agent.wire.protocol import ProtocolError, connect, recv_frame, send_frame
from torchpass.incident.steps import Stripe

# a donor silent this long mid-slice is dropped and its slice taken elsewhere
STALL = timedelta(seconds=10)
# a state smaller than this per donor takes fewer slices (the others stand by)
MIN_SLICE = 64 * 2**10


class _Layout:
    """Where each byte of the state goes: the targets' host memory, laid end to end."""

    def __init__(self, targets: list[torch.Tensor]) -> None:
        self.targets = targets
        # CPU tensors are filled in place; device tensors through a host buffer, copied up at the
        # end.
        self.hosts = [
            t
            if t.device.type == "cpu" and t.is_contiguous()
            else torch.empty(t.shape, dtype=t.dtype)
            for t in targets
        ]
        self._host = Snapshot({}, [("", h) for h in self.hosts])
        self.total = self._host.nbytes

    def range(self, start: int, stop: int) -> Iterator[memoryview]:
        return self._host.host_range(start, stop)

    def slices(self, donors: int) -> list[tuple[int, int]]:
        k = max(1, min(donors, self.total // MIN_SLICE))
        bounds = [self.total * i // k for i in range(k + 1)]
        return list(itertools.pairwise(bounds))

    def finish(self) -> list[torch.Tensor]:
        for t, h in zip(self.targets, self.hosts, strict=True):
            if h is not t:
                t.copy_(h)
        return self.targets


class _Peer:
    def __init__(self, source: wire.Source, sock: socket.socket, head: wire.StateHeader) -> None:
        self.source = source
        self.sock = sock
        self.head = head


class _Striped:
    """The slices, who holds which, and what arrived: shared by one thread per donor and the
    digest."""

    def __init__(
        self, layout: _Layout, deadline: float, on_progress: Progress, donors: int
    ) -> None:
        self.layout = layout
        self.slices = layout.slices(donors)
        self.deadline = deadline
        self.on_progress = on_progress
        self.cond = threading.Condition()
        self.todo: deque[int] = deque()  # slices whose donor failed: the next donor free takes them
        self.done: dict[int, Stripe] = {}
        self.arrived = [0] * len(self.slices)  # bytes of each slice in memory, from its start
        self.dropped: dict[int, str] = {}  # donor slot -> why it was dropped
        self.running = 0
        self.over = False
        self.rehash = False  # a slice that differed may have been read by the in-order digest
        self.got = 0

    def run(self, peers: Sequence[_Peer], head: bytes) -> str | None:
        """Every slice from the donors, each donor's thread taking its own first; the state's digest
        in order (None if it could not be had as the slices arrived). `complete` says whether all
        arrived."""
        self.running = len(peers)
        workers = [
            threading.Thread(
                target=self.work, args=(p, i if i < len(self.slices) else None), daemon=True
            )
            for i, p in enumerate(peers)
        ]
        for t in workers:
            t.start()
        digest: list[str | None] = [None]
        chaser = threading.Thread(
            target=lambda: digest.__setitem__(0, self.digest(head)), daemon=True
        )
        chaser.start()
        with self.cond:
            self.cond.wait_for(
                lambda: self.complete or self.running == 0,
                max(0.0, self.deadline - time.monotonic()),
            )
            self.over = True
            self.cond.notify_all()
            finished = self.complete
        if not finished:
            for p in peers:
                with contextlib.suppress(OSError):
                    p.sock.shutdown(socket.SHUT_RDWR)
        for t in [*workers, chaser]:
            t.join(5)
        return digest[0]

    @property
    def complete(self) -> bool:
        return len(self.done) == len(self.slices)

    def work(self, peer: _Peer, own: int | None) -> None:
        """One donor's thread: its own slice, then any slice a failed donor left, until all
        arrived."""
        j = own
        try:
            while True:
                if j is None and (j := self._next()) is None:
                    break
                self._fetch(peer, j)
                j = None
            send_frame(peer.sock, wire.StateAck())
        except (OSError, ConnectionError, ProtocolError, TransferError) as e:
            with self.cond:
                self.dropped[peer.source.slot] = str(e)[:500]
                if j is not None and j not in self.done:
                    self.todo.append(j)
        finally:
            peer.sock.close()
            with self.cond:
                self.running -= 1
                self.cond.notify_all()

    def _next(self) -> int | None:
        with self.cond:
            ready = self.cond.wait_for(
                lambda: self.todo or self.complete or self.over, self.deadline - time.monotonic()
            )
            if self.todo and not self.over:
                return self.todo.popleft()
            if not ready:
                raise TransferError("timed out waiting for the other slices")
            return None

    def _fetch(self, peer: _Peer, j: int) -> None:
        a, b = self.slices[j]
        send_frame(peer.sock, wire.StateWant(start=a, stop=b))
        hasher = Hasher()
        got = 0
        try:
            for view in self.layout.range(a, b):
                for i in range(0, len(view), CHUNK):
                    piece = view[i : i + CHUNK]
                    _fill(peer.sock, piece)
                    hasher.feed(piece)
                    got += len(piece)
                    with self.cond:
                        self.arrived[j] = max(self.arrived[j], got)
                        self.got += len(piece)
                        total = self.got
                        self.cond.notify_all()
                    self.on_progress(total)
            end = recv_frame(peer.sock)
        finally:
            mine = hasher.hexdigest()
        if not isinstance(end, wire.StateEnd):
            raise ProtocolError(f"expected the end of the slice, got {end.t!r}")
        if end.slice_digest != mine:
            with self.cond:
                self.rehash = True
            raise TransferError(
                f"slice [{a}, {b}) hashes to {mine[:12]}, donor rank {peer.source.slot} sent "
                f"{end.slice_digest[:12]}"
            )
        stripe = Stripe(
            donor=peer.source.slot,
            start=a,
            stop=b,
            digest=mine,
            sent_digest=end.slice_digest,
            donor_digest=end.digest,
        )
        with self.cond:
            self.done[j] = stripe
            self.cond.notify_all()

    def digest(self, head: bytes) -> str | None:
        """The state's digest in order, each slice as far as it arrived; None if the transfer ended
        first."""
        h = state_hash(head)
        for j, (a, b) in enumerate(self.slices):
            pos = a
            while pos < b:
                with self.cond:
                    self.cond.wait_for(lambda: a + self.arrived[j] > pos or self.over)  # noqa: B023
                    upto = a + self.arrived[j]
                    if upto <= pos:
                        return None
                for view in self.layout.range(pos, upto):
                    h.update(view)
                pos = upto
        return h.hexdigest()


def _fill(sock: socket.socket, view: memoryview) -> None:
    got = 0
    while got < len(view):
        k = sock.recv_into(view[got:])
        if k == 0:
            raise ConnectionError("donor closed the connection mid-slice")
        got += k


def _open(
    sources: Sequence[wire.Source], secret: bytes, wait: float
) -> tuple[list[_Peer], dict[int, str]]:
    """A session with every donor at once, each up to its header; the donors that answered, and why
    the others did not."""
    peers: list[_Peer | None] = [None] * len(sources)
    why: dict[int, str] = {}

    def one(i: int, src: wire.Source) -> None:
        try:
            sock = connect(src.host, src.port, secret, timedelta(seconds=wait))
        except (OSError, ProtocolError) as e:
            why[src.slot] = f"cannot reach donor at {src.host}:{src.port}: {e}"
            return
        try:
            sock.settimeout(wait)
            tune(sock)
            head = recv_frame(sock)
            if not isinstance(head, wire.StateHeader):
                raise ProtocolError(f"expected the state header, got {head.t!r}")
            peers[i] = _Peer(src, sock, head)
        except (OSError, ProtocolError) as e:
            sock.close()
            why[src.slot] = f"no state header: {e}"

    threads = [
        threading.Thread(target=one, args=(i, s), daemon=True) for i, s in enumerate(sources)
    ]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return [p for p in peers if p is not None], why


def receive_state(
    tracked: Transferable,
    sources: Sequence[wire.Source],
    secret: bytes,
    timeout: timedelta,
    on_progress: Progress = lambda n: None,
) -> TransferStats:
    """Receive the state of the replicas in `sources` into `tracked`, in slices, verify it and
    install it."""
    t0 = time.perf_counter()
    deadline = time.monotonic() + timeout.total_seconds()
    stall = min(STALL, timeout).total_seconds()
    peers, dropped = _open(sources, secret, stall)
    if not peers:
        raise TransferError("no donor could be reached: " + "; ".join(dropped.values()))
    ref = peers[0].head
    for p in peers[1:]:
        if p.head != ref:  # another step, another model: not a replica of the first
            dropped[p.source.slot] = f"holds another state (step {p.head.header.get('step')})"
            p.sock.close()
    peers = [p for p in peers if p.source.slot not in dropped]
    try:
        targets = tracked.receive_targets(ref.manifest)
    except StateMismatch as e:
        for p in peers:
            p.sock.close()
        raise TransferError(f"receiving state failed: {e}") from e
    snap = Snapshot(ref.header, [(e.path, t) for e, t in zip(ref.manifest, targets, strict=True)])
    layout = _Layout(targets)
    run = _Striped(layout, deadline, on_progress, len(peers))
    run.dropped.update(dropped)
    digest = run.run(peers, snap.header_bytes())
    if not run.complete:
        missing = [f"[{a}, {b})" for j, (a, b) in enumerate(run.slices) if j not in run.done]
        raise TransferError(
            f"slice(s) {', '.join(missing)} could not be had from any donor: "
            + "; ".join(f"rank {s}: {w}" for s, w in sorted(run.dropped.items()))
        )
    stripes = tuple(run.done[j] for j in range(len(run.slices)))
    held = sorted({s.donor_digest for s in stripes})
    if len(held) != 1:
        raise TransferError(
            f"the donors' states differ ({', '.join(d[:12] for d in held)}): not installed"
        )
    staged = layout.finish()
    stream = snap.digest() if run.rehash or digest is None else digest
    if stream != held[0]:
        raise TransferError(f"digest mismatch: donor {held[0]}, received {stream}")
    try:
        step = tracked.load(
            ref.header, {e.path: t for e, t in zip(ref.manifest, staged, strict=True)}
        )
    except StateMismatch as e:
        raise TransferError(str(e)) from e
    return TransferStats(
        digest=stream,
        nbytes=layout.total,
        seconds=time.perf_counter() - t0,
        step=step,
        stripes=stripes,
        dropped=tuple(sorted(run.dropped)),
    )
