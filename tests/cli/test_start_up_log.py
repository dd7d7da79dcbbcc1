"""The start-up lines of `vt serve` / `vt generate` (vt/cli/start_up.py): in place on a
terminal, one line per phase elsewhere, with a line every PERIOD_S while a phase runs long."""
import io

from vt.cli.start_up import PERIOD_S, StartUpLog
from vt.engine.progress import StartUpProgress


class _Clock:
    def __init__(self):
        self.now = 100.0

    def __call__(self):
        return self.now


def _phase(log, clock, name, total, step_s):
    for done in range(total + 1):
        log(StartUpProgress(name, done, total, f"piece {done}" if done else ""))
        clock.now += step_s


def test_not_a_terminal_one_line_per_phase_and_one_per_period_of_a_long_phase():
    out, clock = io.StringIO(), _Clock()
    log = StartUpLog("vt serve", out, terminal=False, clock=clock)
    _phase(log, clock, "capturing decode graphs", 8, 0.1)
    log.line("vt serve: a message")
    _phase(log, clock, "loading weights", 4, PERIOD_S * 0.75)   # 3.75 s a piece
    assert out.getvalue().splitlines() == [
        "vt serve: capturing decode graphs 8/8 (piece 8) in 0.8 s",
        "vt serve: a message",
        "vt serve: loading weights 2/4 (piece 2)",     # 7.5 s in: the first period passed
        "vt serve: loading weights 4/4 (piece 4) in 15.0 s",
    ]


def test_on_a_terminal_the_phase_line_is_rewritten_in_place():
    out, clock = io.StringIO(), _Clock()
    log = StartUpLog("vt serve", out, terminal=True, clock=clock)
    _phase(log, clock, "warming up eager steps", 2, 0.5)
    log(StartUpProgress("capturing decode graphs", 0, 3))
    log.line("vt serve: interrupted line ends first")
    assert out.getvalue() == (
        "\r\033[Kvt serve: warming up eager steps 0/2"
        "\r\033[Kvt serve: warming up eager steps 1/2 (piece 1)"
        "\r\033[Kvt serve: warming up eager steps 2/2 (piece 2) in 1.0 s\n"
        "\r\033[Kvt serve: capturing decode graphs 0/3\n"
        "vt serve: interrupted line ends first\n")
