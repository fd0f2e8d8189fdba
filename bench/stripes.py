"""Striped vs single-donor state transfer, with each node's link limited.

Four hosts, each a network namespace of its own on one bridge: three donors and a receiver. Each
donor host's egress is limited with `tc` (a token bucket, `RATE`), as a node's NIC shared with
training traffic is; the receiver's is not. Each donor is a real process holding the same ~50 MB of
model + Adam state (4 x Linear(1024, 1024), seeded, a few steps trained) and serves it with the real
`StateServer`; the receiver, a process on its own host, takes it with the real striped receiver
(`job_agent.transfer.receiver`) from k = 1, 2 and 3 donors in turn, `REPEATS` times each, in one
invocation. The figure is the receiver's own time from connecting to the state installed and
verified; each result's digest must equal the donors'. Target: k donors >= 0.8 x k times as fast as
one. Needs root (namespaces and tc); writes its block of docs/benchmarks.md. Run: `.venv/bin/python
-m bench.stripes` (about a minute).
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import time
from datetime import UTC, datetime, timedelta
from typing import TYPE_CHECKING

from bench import write_block
from torchpass.dev.hosts import Host, fabric

if TYPE_CHECKING:
    from job_agent.rank.state import TrackedState

RATE = "400mbit"
REPEATS = 3
WIDTH, DEPTH = 1024, 4
_SECRET_ENV = "TORCHPASS_BENCH_SECRET"


def _state(seed: int) -> TrackedState:
    import torch

    from job_agent.rank.state import TrackedState

    torch.manual_seed(seed)
    layers = [torch.nn.Linear(WIDTH, WIDTH) for _ in range(DEPTH)]
    model = torch.nn.Sequential(*layers)
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    for _ in range(2):
        opt.zero_grad()
        model(torch.randn(8, WIDTH)).pow(2).mean().backward()
        opt.step()
    return TrackedState(model, opt)


def donor(host: str) -> None:
    """On a donor host: for each `serve` line on stdin, serve the state once; print the port, then
    done."""
    from job_agent.transfer.donor import StateServer

    state = _state(0)
    secret = bytes.fromhex(os.environ[_SECRET_ENV])
    snap = state.snapshot(1)
    print(json.dumps({"digest": snap.digest()}), flush=True)
    for line in sys.stdin:
        if line.strip() != "serve":
            continue
        server = StateServer(secret, host)
        print(json.dumps({"port": server.port}), flush=True)
        server.serve(snap, 1, timedelta(seconds=120), lambda n: None)
        print(json.dumps({"served": server.bytes_sent}), flush=True)


def receiver() -> None:
    """On the receiver's host: for each line of donors (JSON), take the state; print seconds and
    digest."""
    from job_agent import wire
    from job_agent.transfer.receiver import receive_state

    secret = bytes.fromhex(os.environ[_SECRET_ENV])
    for line in sys.stdin:
        sources = [wire.Source.model_validate(s) for s in json.loads(line)]
        state = _state(1)  # a warm spare's own memory, other values
        stats = receive_state(state, sources, secret, timedelta(seconds=120))
        print(
            json.dumps({"seconds": stats.seconds, "digest": stats.digest, "bytes": stats.nbytes}),
            flush=True,
        )


def _start(h: Host, role: str, env: dict[str, str]) -> subprocess.Popen[str]:
    cmd = h.command([sys.executable, "-m", "bench.stripes", role, h.address])
    return subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=env)


def _ask(p: subprocess.Popen[str], line: str | None = None) -> dict[str, object]:
    assert p.stdin is not None and p.stdout is not None
    if line is not None:
        p.stdin.write(line + "\n")
        p.stdin.flush()
    out = p.stdout.readline()
    if not out:
        raise RuntimeError(f"bench process {p.args!r} ended")
    return dict(json.loads(out))


def _limit(h: Host) -> None:
    """Limit the host's egress to RATE on its one interface."""
    links = subprocess.run(
        [*h.prefix, "ip", "-o", "link", "show"], capture_output=True, text=True, check=True
    )
    dev = next(
        ln.split(":")[1].strip().split("@")[0]
        for ln in links.stdout.splitlines()
        if ": lo:" not in ln
    )
    tc = [
        "tc",
        "qdisc",
        "add",
        "dev",
        dev,
        "root",
        "tbf",
        "rate",
        RATE,
        "burst",
        "256kb",
        "latency",
        "100ms",
    ]
    subprocess.run([*h.prefix, *tc], check=True, capture_output=True)


def main() -> int:
    env = {**os.environ, _SECRET_ENV: os.urandom(32).hex()}
    t0 = time.monotonic()
    with fabric(4) as hosts:
        if hosts.mode != "netns":
            print(
                "bench.stripes needs network namespaces and tc (root): links cannot be limited here"
            )
            return 2
        *donor_hosts, recv_host = hosts.hosts
        for h in donor_hosts:
            _limit(h)
        donors = [_start(h, "donor", env) for h in donor_hosts]
        recv = _start(recv_host, "receiver", env)
        try:
            digests = {str(_ask(d)["digest"]) for d in donors}
            assert len(digests) == 1, "the donors must hold one state"
            times: dict[int, list[float]] = {}
            size = 0
            for _ in range(REPEATS):
                for k in (1, 2, 3):
                    ports = [_ask(d, "serve")["port"] for d in donors[:k]]
                    sources = [
                        {"slot": i, "host": donor_hosts[i].address, "port": p}
                        for i, p in enumerate(ports)
                    ]
                    got = _ask(recv, json.dumps(sources))
                    for d in donors[:k]:
                        _ask(d)  # served
                    assert got["digest"] in digests, f"k={k}: the receiver holds another state"
                    times.setdefault(k, []).append(float(str(got["seconds"])))
                    size = int(str(got["bytes"]))
        finally:
            for p in (*donors, recv):
                p.kill()
    seconds = time.monotonic() - t0
    one = statistics.median(times[1])
    lines = [
        f"## Striped vs single-donor transfer ({datetime.now(UTC):%Y-%m-%d}, `python -m "
        "bench.stripes`)",
        "",
        f"{size / 1e6:.0f} MB of model + Adam state, each donor's host egress limited to {RATE}/s "
        "with tc, the",
        "receiver's not; donors and receiver each a network namespace of its own on one bridge, "
        "real",
        f"`StateServer`s and the striped receiver. Median of {REPEATS}, the receiver's own time to "
        "the state",
        f"installed and verified (digest equal to the donors'). One invocation, {seconds:.0f} s.",
        "",
        "| donors k | seconds | MB/s | speed-up | target (0.8 x k) |",
        "|---|---|---|---|---|",
    ]
    ok = True
    for k, ts in times.items():
        m = statistics.median(ts)
        met = one / m >= 0.8 * k
        ok = ok and met
        lines.append(
            f"| {k} | {m:.2f} | {size / m / 1e6:.0f} | {one / m:.2f}x | "
            f"{'met' if met else 'NOT met'} |"
        )
    print("\n".join(lines))
    write_block("stripes", lines)
    return 0 if ok else 1


if __name__ == "__main__":
    if len(sys.argv) > 2 and sys.argv[1] == "donor":
        donor(sys.argv[2])
    elif len(sys.argv) > 2 and sys.argv[1] == "receiver":
        receiver()
    else:
        sys.exit(main())
