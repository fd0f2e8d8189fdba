"""The local launcher gives each process of a host its own GPU: real processes (started cold, the
quick way for a script that imports nothing), each writing the LOCAL_RANK it was given."""

from __future__ import annotations

import time
from datetime import timedelta
from pathlib import Path

from job_agent.launch.launcher import LocalLauncher


def _seen(out: Path, agent: str) -> int:
    deadline = time.monotonic() + 30
    while not (out / agent).exists() or not (out / agent).read_text():
        assert time.monotonic() < deadline, f"{agent} never said its LOCAL_RANK"
        time.sleep(0.02)
    return int((out / agent).read_text())


def test_each_live_process_holds_its_own_local_rank_and_a_freed_one_is_given_again(
    tmp_path: Path,
) -> None:
    """Ranks 0-2 get 0, 1, 2 (a single host once gave them all 0: one GPU for the whole job); the
    one on 1 dies and the next process gets 1 again; a LOCAL_RANK the caller chose (a node agent
    steering off a failed GPU) is kept; the host's own LOCAL_RANK (a launcher run inside another) is
    never inherited."""
    script = tmp_path / "say.py"
    script.write_text(
        "import os, sys, time\n"
        "where = os.path.join(sys.argv[1], os.environ['TORCHPASS_AGENT_ID'])\n"
        "open(where, 'w').write(os.environ['LOCAL_RANK'])\n"
        "time.sleep(60)\n"
    )
    launcher = LocalLauncher(str(script), [str(tmp_path)], base_env={"LOCAL_RANK": "5"}, fork=False)
    try:
        for agent in ("a", "b", "c"):
            launcher.spawn(agent, {"TORCHPASS_AGENT_ID": agent})
        assert [_seen(tmp_path, a) for a in "abc"] == [0, 1, 2]
        launcher.kill("b")
        launcher.wait("b")
        assert launcher.devices() == {"a": 0, "c": 2} and launcher.free_devices(2) == [1, 3]
        launcher.spawn("d", {"TORCHPASS_AGENT_ID": "d"})
        launcher.spawn("e", {"TORCHPASS_AGENT_ID": "e", "LOCAL_RANK": "6"})
        assert (_seen(tmp_path, "d"), _seen(tmp_path, "e")) == (1, 6)
        assert launcher.devices() == {"a": 0, "c": 2, "d": 1, "e": 6}
    finally:
        launcher.shutdown(timedelta(seconds=5))
