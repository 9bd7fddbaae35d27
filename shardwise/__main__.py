"""``python -m shardwise <command>``: the same as the ``shardwise`` console script."""

import sys

from shardwise.app.cli import main

sys.exit(main())
