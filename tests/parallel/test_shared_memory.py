"""The step plans' shared-memory segment outlives a tensor-parallel server killed with its whole
process group (SIGKILL takes the resource tracker that would unlink it too): the next
Broadcast.create on the machine removes it, and only it: a running writer's segment stays."""
from __future__ import annotations

import os
import pathlib
import signal
import subprocess
import sys

import pytest

from vt.parallel.channel import SHM_DIR, Broadcast, remove_orphaned_segments

ROOT = pathlib.Path(__file__).resolve().parents[2]
WRITER = """
import time
from vt.parallel.channel import Broadcast
channel = Broadcast.create(1)
print(channel.name, flush=True)
time.sleep(300)
"""

pytestmark = pytest.mark.skipif(not (os.path.isdir(SHM_DIR) and os.path.isdir("/proc/self")),
                                reason="shared memory segments are files of /dev/shm on Linux")


def _segment(name: str) -> pathlib.Path:
    return pathlib.Path(SHM_DIR) / name


def test_a_killed_process_groups_segment_is_removed_by_the_next_create():
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]))
    writer = subprocess.Popen([sys.executable, "-c", WRITER], cwd=ROOT, env=env, text=True,
                              stdout=subprocess.PIPE, start_new_session=True)
    mine = None
    try:
        name = writer.stdout.readline().strip()
        assert name and _segment(name).exists(), name
        mine = Broadcast.create(1)              # while the writer runs: its segment stays
        assert _segment(name).exists()
        os.killpg(writer.pid, signal.SIGKILL)   # the writer and its resource tracker
        writer.wait(10)
        assert _segment(name).exists()          # what the killed group leaves behind
        later = Broadcast.create(1)
        later.close()
        assert not _segment(name).exists()
        assert _segment(mine.name).exists()     # a live writer's segment is never taken
    finally:
        if writer.poll() is None:
            os.killpg(writer.pid, signal.SIGKILL)
            writer.wait(10)
        if mine is not None:
            mine.close()


def test_a_segment_whose_pid_runs_another_process_is_orphaned(tmp_path):
    """A writer's pid given to a later process (the start time differs) does not keep its
    segment; names that are not the channel's are never touched."""
    me = os.getpid()
    orphan = tmp_path / f"vt-tp-{me}-1-abcd1234"       # my pid, not my start time
    other = tmp_path / "psm_0123abcd"
    for f in (orphan, other):
        f.write_bytes(b"")
    assert remove_orphaned_segments(str(tmp_path)) == [orphan.name]
    assert not orphan.exists() and other.exists()
