"""``python -m shardwise.bench``: the same as ``shardwise bench``."""

import sys

from shardwise.bench.cli import main

sys.exit(main())
