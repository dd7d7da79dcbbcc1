import sys

from vt.cli.bench.cli import main

sys.exit(main())
