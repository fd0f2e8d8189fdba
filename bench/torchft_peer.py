"""torchft 0.2.0 (pytorch/torchft) recovering from one SIGKILLed replica, on the training of
`bench/peers.py`.

`torchft_run` starts torchft's lighthouse and 4 replica groups of 1 rank each running
`bench/torchft_ddp.py` (the model, data, step count and kill point of `bench.peers`), SIGKILLs
replica group 1 as it begins step `KILL_STEP` and at once starts a replacement for it, then reads
the replicas' step log:

- kill -> training again: every surviving group has begun a step after the kill, and the replacement
  has begun a step of its own, after healing, that the quorum committed (a replica that is still
  healing, whose gradients torchft zeroes, does not count as training); the latest of these minus
  the kill time;
- steps recomputed: distinct steps some group had logged "end" for before the kill and that are
  begun again after it (the replacement's pre-heal placeholder step 0 excluded: see
  `bench/torchft_ddp.py`);
- median step seconds over begin -> end pairs.

torchft lives in its own virtualenv, `.bench-venvs/torchft-0.2.0`, made once on first use: a `.pth`
file reuses this project's virtualenv (and its torch) and pip adds torchft 0.2.0 and its
OpenTelemetry dependencies. Run: `.venv/bin/python -m bench.torchft_peer [-v] [--runs N]` (N runs of
each setting, about 2 minutes for one of each; -v prints the step log around each kill).
"""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import statistics
import subprocess
import sys
import sysconfig
import tempfile
import time
from pathlib import Path

from bench import read_step_log

ROOT = Path(__file__).resolve().parent.parent
VENV = ROOT / ".bench-venvs" / "torchft-0.2.0"
RANKS, STEPS, KILL_RANK, KILL_STEP = 4, 40, 1, 15
MODEL = ("--width", "1024", "--depth", "8", "--batch", "32", "--samples", "4096")
# the lighthouse forms a quorum, and the Manager commits, with 3 of the 4 groups
MIN_REPLICAS = RANKS - 1
JOB_TIMEOUT = 300.0  # seconds for one whole run; past it every process is killed
# mid_step=True: the kill this long after the victim's "begin" (a step takes about 0.3 s)
MID_STEP_S = 0.1

# torchft's defaults, for reference: lighthouse heartbeat_timeout_ms 5000, join_timeout_ms 60000,
# quorum_tick_ms 100; Manager timeout, quorum_timeout and connect_timeout 60 s, heartbeat_interval
# 100 ms; ProcessGroupGloo timeout 60 s. tuned=False passes none of these, so torchft's own defaults
# apply.
TUNED_LIGHTHOUSE = {"heartbeat_timeout_ms": 200, "join_timeout_ms": 1000, "quorum_tick_ms": 10}
TUNED_MANAGER = {
    "heartbeat-ms": 20,
    "timeout-s": 10,
    "quorum-timeout-s": 10,
    "connect-timeout-s": 5,
    "pg-timeout-s": 5,
}
TUNED = (
    "lighthouse "
    + " ".join(f"--{k} {v}" for k, v in TUNED_LIGHTHOUSE.items())
    + "; replicas "
    + " ".join(f"--{k} {v}" for k, v in TUNED_MANAGER.items())
)


def ensure_venv() -> Path:
    """The torchft virtualenv's python, made on first use."""
    python = VENV / "bin" / "python"
    if python.exists() and _imports_torchft(python):
        return python
    subprocess.run([sys.executable, "-m", "venv", str(VENV)], check=True, timeout=120)
    site = Path(_printed(python, "import sysconfig; print(sysconfig.get_paths()['purelib'])"))
    # this project's site-packages (torch among them) after the venv's own, so nothing downloads
    # torch again
    (site / "_torchpass_venv.pth").write_text(sysconfig.get_paths()["purelib"] + "\n")
    pip = [str(python), "-m", "pip", "install", "--disable-pip-version-check", "-q"]
    subprocess.run([*pip, "--no-deps", "torchft==0.2.0"], check=True, timeout=600)
    deps = (
        "opentelemetry-api>=1.39.0",
        "opentelemetry-sdk>=1.39.0",
        "opentelemetry-exporter-otlp-proto-http>=1.39.0",
    )
    subprocess.run([*pip, *deps], check=True, timeout=600)
    assert _imports_torchft(python), f"torchft does not import in {VENV}"
    return python


def _imports_torchft(python: Path) -> bool:
    probe = subprocess.run(
        [str(python), "-c", "import torchft, torch; print(torch.__version__)"],
        check=False,
        capture_output=True,
        env={**os.environ, "OMP_NUM_THREADS": "1"},
        timeout=120,
    )
    return probe.returncode == 0


def torch_version() -> str:
    return _printed(ensure_venv(), "import torch; print(torch.__version__)")


def _printed(python: Path, code: str) -> str:
    """What `code` prints, run by the torchft virtualenv's `python`."""
    cmd = [str(python), "-c", code]
    return subprocess.run(
        cmd, check=True, capture_output=True, text=True, timeout=120
    ).stdout.strip()


def torchft_run(
    d: Path, tuned: bool, mid_step: bool = False
) -> tuple[float, int, float, float] | str:
    """(kill -> all 4 replica groups training again, steps recomputed, median step seconds, seconds
    from the kill to each group's next step summed over the groups) under torchft, or why the job
    never trained again. Leaves its logs in `d`: steps.log, lighthouse.out, replica-*.out.

    mid_step=False: the victim is killed as it begins step KILL_STEP, before it has asked for the
    step's quorum (it holds there after logging "begin"; without the hold the kill races its quorum
    request, which leaves within a millisecond or two). mid_step=True: killed MID_STEP_S after that
    "begin", in its forward and backward pass, once the lighthouse holds its quorum request."""
    python = ensure_venv()
    log = d / "steps.log"
    port = _free_port()
    lighthouse_args = ["--bind", f"127.0.0.1:{port}", "--min_replicas", str(MIN_REPLICAS)]
    replica_args = [str(ROOT / "bench" / "torchft_ddp.py"), "--steps", str(STEPS), *MODEL]
    replica_args += ["--min-replicas", str(MIN_REPLICAS), "--step-log", str(log)]
    if tuned:
        lighthouse_args += [a for k, v in TUNED_LIGHTHOUSE.items() for a in (f"--{k}", str(v))]
        replica_args += [a for k, v in TUNED_MANAGER.items() for a in (f"--{k}", str(v))]
    procs: list[subprocess.Popen[bytes]] = []

    def start(
        cmd: list[str], out: Path, env: dict[str, str] | None = None
    ) -> subprocess.Popen[bytes]:
        with out.open("w") as f:
            proc = subprocess.Popen(
                cmd,
                env={**os.environ, "OMP_NUM_THREADS": "1", **(env or {})},
                stdout=f,
                stderr=subprocess.STDOUT,
                start_new_session=True,  # its own process group, killed whole on the way out
            )
        procs.append(proc)
        return proc

    def replica(group: int, name: str) -> subprocess.Popen[bytes]:
        env = {
            "REPLICA_GROUP_ID": str(group),
            "NUM_REPLICA_GROUPS": str(RANKS),
            "TORCHFT_LIGHTHOUSE": f"http://127.0.0.1:{port}",
            "MASTER_ADDR": "127.0.0.1",
            # the group's own TCPStore (a fresh one for the replacement)
            "MASTER_PORT": str(_free_port()),
            "RANK": "0",
            "WORLD_SIZE": "1",
            "LOCAL_RANK": "0",
        }
        hold = ["--hold-at-step", str(KILL_STEP)] if name == str(KILL_RANK) and not mid_step else []
        return start([str(python), *replica_args, *hold], d / f"replica-{name}.out", env)

    deadline = time.monotonic() + JOB_TIMEOUT
    try:
        lighthouse = start(
            [str(python.with_name("torchft_lighthouse")), *lighthouse_args], d / "lighthouse.out"
        )
        _wait_port(port, lighthouse, deadline)
        replicas = [replica(g, str(g)) for g in range(RANKS)]
        victim = replicas[KILL_RANK]
        while not any(
            r == KILL_RANK and s == KILL_STEP and p == victim.pid and e == "begin"
            for r, s, p, _, e in read_step_log(log)
        ):
            if time.monotonic() > deadline or any(p.poll() is not None for p in replicas):
                return (
                    "the job ended or hung before the kill (exit codes "
                    f"{[p.poll() for p in replicas]})"
                )
            time.sleep(0.005)
        if mid_step:
            time.sleep(MID_STEP_S)
        killed_at = time.time()
        os.kill(victim.pid, signal.SIGKILL)
        (d / "killed_at").write_text(f"{killed_at:.6f} {victim.pid}\n")
        # What a scheduler (torchx, Kubernetes) would do: start a new process for the lost replica
        # group. Here it starts the instant the kill is sent, with no detection or scheduling delay:
        # that favours torchft.
        replacement = replica(KILL_RANK, f"{KILL_RANK}-replacement")
        victim.wait(10)
        live = [p for p in replicas if p is not victim] + [replacement]
        for p in live:
            left = deadline - time.monotonic()
            try:
                p.wait(max(left, 0.1))
            except subprocess.TimeoutExpired:
                break
        codes = [p.poll() for p in live]
    finally:
        for p in procs:
            _kill_tree(p)
    return _measure(d, killed_at, victim.pid, replacement.pid, codes)


def _measure(
    d: Path, killed_at: float, victim: int, new: int, codes: list[int | None]
) -> tuple[float, int, float, float] | str:
    rows = read_step_log(d / "steps.log")
    ended = {(r, s, p) for r, s, p, _, e in rows if e == "end"}
    first: dict[int, float] = {}
    for r, s, p, t, e in rows:
        if e != "begin" or t <= killed_at or p == victim:
            continue
        # still healing, or a step that did not commit
        if p == new and (s == 0 or (r, s, p) not in ended):
            continue
        first.setdefault(r, t)
    if len(first) < RANKS:
        missing = sorted(set(range(RANKS)) - set(first))
        outs = [(d / f"replica-{g}.out").read_text() for g in range(RANKS) if g != KILL_RANK]
        if all("assert fut._fut" in out for out in outs):
            return (
                f"never trained again: the quorum for step {KILL_STEP} already held the killed "
                "replica, gloo failed the survivors' allreduce (connection reset) and all 3 "
                "survivors then crashed on torchft/ddp.py's `assert fut._fut` in its DDP comm "
                f"hook, leaving no replica to heal from (groups {missing} never began a step "
                f"again; exit codes {codes})"
            )
        return f"replica group(s) {missing} never trained again after the kill (exit codes {codes})"
    again = max(first.values()) - killed_at
    done_before = {s for _, s, _, t, e in rows if e == "end" and t <= killed_at}
    begun_after = {
        s for _, s, p, t, e in rows if e == "begin" and t > killed_at and not (p == new and s == 0)
    }
    begins = {(r, s, p): t for r, s, p, t, e in rows if e == "begin"}
    steps = [t - begins[(r, s, p)] for r, s, p, t, e in rows if e == "end" and (r, s, p) in begins]
    # each group's own wait: the survivors go on first
    lost = sum(t - killed_at for t in first.values())
    return again, len(done_before & begun_after), statistics.median(steps), lost


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _wait_port(port: int, proc: subprocess.Popen[bytes], deadline: float) -> None:
    while time.monotonic() < deadline and proc.poll() is None:
        try:
            socket.create_connection(("127.0.0.1", port), timeout=0.5).close()
            return
        except OSError:
            time.sleep(0.05)
    raise RuntimeError(f"torchft's lighthouse did not listen on 127.0.0.1:{port}")


def _kill_tree(proc: subprocess.Popen[bytes]) -> None:
    """SIGKILL the process group the child leads (it was started in a new session), then reap it."""
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGKILL)
    with contextlib.suppress(subprocess.TimeoutExpired):
        proc.wait(10)


def _around_kill(d: Path, before: int = 8, after: int = 40) -> list[str]:
    """The raw step log around the kill, with times made relative to it."""
    killed_at, victim = (d / "killed_at").read_text().split()
    t0 = float(killed_at)
    rows = [line.split() for line in (d / "steps.log").read_text().splitlines()]
    i = next((k for k, row in enumerate(rows) if float(row[3]) > t0), len(rows))
    fmt = [f"  {r} {s:>2} {p} {float(t) - t0:+8.3f} {e}" for r, s, p, t, e in rows]
    return [*fmt[max(0, i - before) : i], f"  ---- SIGKILL pid {victim}", *fmt[i : i + after]]


def _timeline(d: Path) -> str:
    """When, after the kill, the survivors committed the step in flight and the replacement came up
    and healed."""
    killed_at, victim = (d / "killed_at").read_text().split()
    t0, rows = float(killed_at), read_step_log(d / "steps.log")
    before = {p for _, _, p, t, _ in rows if t <= t0}
    survivors = [
        t
        for r, s, p, t, e in rows
        if e == "end" and s >= KILL_STEP and p in before and r != KILL_RANK
    ]
    new = [
        (s, t, e)
        for r, s, p, t, e in rows
        if r == KILL_RANK and p not in before and str(p) != victim
    ]
    up = next((t for s, t, e in new if e == "begin"), None)
    healed = next(((s, t) for s, t, e in new if e == "begin" and s > 0), None)
    parts = [
        f"survivors' first commit +{min(survivors) - t0:.2f} s"
        if survivors
        else "no survivor committed"
    ]
    parts.append(
        f"replacement's first step begun +{up - t0:.2f} s"
        if up
        else "replacement never began a step"
    )
    if healed:
        parts.append(f"healed, begins step {healed[0]} at +{healed[1] - t0:.2f} s")
    return "; ".join(parts)


def main() -> int:
    runs = int(sys.argv[sys.argv.index("--runs") + 1]) if "--runs" in sys.argv else 1
    print(f"torchft 0.2.0 with torch {torch_version()} ({VENV})")
    print(f"tuned: {TUNED}")
    cases = [
        (tuned, mid, i) for tuned in (False, True) for mid in (False, True) for i in range(runs)
    ]
    with tempfile.TemporaryDirectory(prefix="torchpass-torchft-") as tmp:
        for tuned, mid, i in cases:
            name = (
                f"{'tuned' if tuned else 'default'}, killed "
                f"{'mid-step' if mid else 'as it begins the step'}"
            )
            d = Path(tmp) / f"{int(tuned)}{int(mid)}-{i}"
            d.mkdir()
            t0 = time.monotonic()
            result = torchft_run(d, tuned, mid_step=mid)
            if isinstance(result, str):
                print(f"{name}: {result} ({time.monotonic() - t0:.0f} s)")
                for out in sorted(d.glob("replica-*.out")):  # each replica's last error lines
                    errors = [line for line in out.read_text().splitlines() if "rror" in line]
                    print(f"  {out.name}: {[e[:300] for e in errors[-2:]]}")
            else:
                again, recomputed, step_s, _ = result
                print(
                    f"{name}: kill -> training again {again:.2f} s, {recomputed} step(s) "
                    f"recomputed, median step {step_s:.3f} s ({time.monotonic() - t0:.0f} s)\n  "
                    f"{_timeline(d)}"
                )
            if "-v" in sys.argv[1:] and (d / "killed_at").exists():
                print("\n".join(_around_kill(d)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
