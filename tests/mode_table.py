"""What each executor mode must run, written out independently of vt/config.py's derivation, for
the tests that hold the config (tests/executor/test_config.py) and the command line
(tests/cli/test_mode_reports.py) to it."""

# mode -> (depth, slots per size, guarded, staged H2D, graph steps skip the drain)
EXPECTED_MODES = {
    "sync": (1, 1, False, False, False),
    "drain": (2, 1, False, False, False),
    "ring": (2, 2, True, False, True),
    "staged": (2, 2, True, True, True),
    "unguarded": (2, 1, False, False, True),
}
