"""Ctrl-C during a command's start-up is never lost (vt/cli/interrupt.py)."""
import asyncio
import io
import os
import signal
import time

import pytest

from vt.cli import interrupt
from vt.cli.start_up import StartUpLog


def _swallowed_sigint():
    """A SIGINT delivered into code that catches everything, as a library's bare except does."""
    try:
        os.kill(os.getpid(), signal.SIGINT)
        time.sleep(1)   # the handler runs at the next bytecode: the sleep is interrupted
    except BaseException:   # noqa: BLE001 (what a careless library does)
        pass


def test_a_swallowed_ctrl_c_is_raised_at_the_next_start_up_line():
    log = StartUpLog("vt serve", out=io.StringIO(), terminal=False)
    with interrupt.remembered_sigint():
        _swallowed_sigint()
        with pytest.raises(KeyboardInterrupt):
            log.line("vt serve: ring mode")
    log.line("after the command: nothing is remembered")


def test_without_a_ctrl_c_the_start_up_lines_print():
    out = io.StringIO()
    with interrupt.remembered_sigint():
        StartUpLog("vt serve", out=out, terminal=False).line("vt serve: ring mode")
    assert out.getvalue() == "vt serve: ring mode\n"


def test_asyncio_leaves_sigint_to_the_command():
    """asyncio.run takes SIGINT over only from Python's default handler; a signal in the
    window before the server installs its own would then cancel a task not yet running."""
    async def handler():
        return signal.getsignal(signal.SIGINT)
    with interrupt.remembered_sigint():
        inside = asyncio.run(handler())
        assert signal.getsignal(signal.SIGINT) is inside
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler
