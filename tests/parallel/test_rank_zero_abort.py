"""A step that fails on rank 0 stops the tensor-parallel group with a reason that says what
failed (the step's error), so that a server's "engine stopped" line explains itself."""
import pytest

pytest.importorskip("torch")

from vt.executor.runner import Runner  # noqa: E402
from vt.parallel.rank import RankZeroRunner  # noqa: E402


class _Group:
    failure = None
    reason = None

    def stop(self, reason):
        self.reason = reason


def _runner(monkeypatch):
    monkeypatch.setattr(Runner, "abort", lambda self, cause=None: None)
    runner = RankZeroRunner.__new__(RankZeroRunner)   # the group alone is what abort uses
    runner.group = _Group()
    return runner


def test_rank_0s_failed_step_names_its_error(monkeypatch):
    runner = _runner(monkeypatch)
    runner.abort(RuntimeError("the sampler's input was NaN"))
    assert runner.group.reason == "a step failed on rank 0: RuntimeError: the sampler's input was NaN"


def test_a_failure_the_group_saw_first_is_the_reason(monkeypatch):
    runner = _runner(monkeypatch)
    runner.group.failure = "tensor-parallel rank 1 (pid 7) died: killed by signal 9"
    runner.abort(RuntimeError("a collective failed"))
    assert runner.group.reason == "tensor-parallel rank 1 (pid 7) died: killed by signal 9"


def test_a_worker_that_takes_seconds_to_show_as_dead_is_still_the_reason():
    """A killed worker's sockets close (so rank 0's collective fails) before its exit can be
    seen; under load that took over 3 s. stop() waits for it and names the dead rank."""
    import multiprocessing
    import threading
    import time

    from vt.parallel.group import RankGroup

    worker = multiprocessing.get_context("fork").Process(target=time.sleep, args=(3.5,))
    worker.start()
    group = RankGroup.__new__(RankGroup)   # the state stop() reads
    group._procs, group.failure, group.dist_backend = [worker], None, "gloo"
    group._lock, group._closing = threading.Lock(), threading.Event()
    group._shut_down = lambda message, grace_s: None
    group.stop("a step failed on rank 0: RuntimeError: Connection reset by peer")
    assert group.failure.startswith(f"tensor-parallel rank 1 (pid {worker.pid}) died"), group.failure
