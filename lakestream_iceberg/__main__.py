"""``python -m lakestream_iceberg``: the ``lakestream`` command line."""

import sys

from lakestream_iceberg.tools.cli import main

sys.exit(main())
