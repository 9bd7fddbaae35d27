"""``python -m shardwise <command>``: the same as the ``shardwise`` console script."""

import sys

from shardwise.cli import main

sys.exit(main())
