"""`python -m vt ...` is the same as the `vt` console script."""
import sys

from vt.cli import main

sys.exit(main())
