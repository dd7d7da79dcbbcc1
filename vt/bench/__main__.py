import sys

from vt.bench.cli import main

sys.exit(main())
