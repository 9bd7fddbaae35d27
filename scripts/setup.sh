#!/usr/bin/env bash
# Install shardwise into the current Python environment.
# An existing torch >= 2.11 is kept; with no torch, the CPU build torch==2.13.0 is
# installed (a bare `pip install torch` would pull a multi-GB CUDA build).
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
if ! "$PY" - <<'PYEOF'
import sys
try:
    import torch
except ImportError:
    sys.exit(1)
major, minor = (int(x) for x in torch.__version__.split(".")[:2])
sys.exit(0 if (major, minor) >= (2, 11) else 1)
PYEOF
then
    "$PY" -m pip install -q "torch==2.13.0"
fi
"$PY" -m pip install -q -e ".[test]"
