"""`python -m vt ...` is the same as the `vt` console script."""
import sys

from vt.cli.main import main

sys.exit(main())
