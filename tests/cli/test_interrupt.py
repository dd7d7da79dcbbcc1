"""Ctrl-C reaches a command whatever SIGINT disposition its process inherited
(vt/cli/interrupt.py)."""
import os
import signal
import time

import pytest

from vt.cli.interrupt import sigint_raises


def test_an_inherited_ignored_sigint_raises_inside_a_command():
    previous = signal.signal(signal.SIGINT, signal.SIG_IGN)   # as a background job inherits it
    try:
        with sigint_raises():
            with pytest.raises(KeyboardInterrupt):
                os.kill(os.getpid(), signal.SIGINT)
                time.sleep(1)   # interrupted by the handler at the next bytecode
        assert signal.getsignal(signal.SIGINT) is signal.SIG_IGN   # given back afterwards
    finally:
        signal.signal(signal.SIGINT, previous)
