#!/usr/bin/env bash
# Set up shardwise in a virtual environment, .venv at the repository root, and install
# it there (editable, with the test extra). Nothing is installed outside .venv.
#
#   bash scripts/setup.sh && .venv/bin/python -m shardwise train
#   bash scripts/setup.sh && .venv/bin/python -m pytest -q
#
# - .venv is created with `${PYTHON:-python3} -m venv .venv` when it does not exist; an
#   existing .venv is used as it is (running the script again only updates the install).
# - torch: a torch >= 2.11 that .venv/bin/python can import is kept. Otherwise the CPU
#   build torch==2.13.0+cpu is installed (a plain `pip install torch` on Linux would pull
#   a multi-GB CUDA build): from what pip is configured with (a local wheel folder or
#   index), else from https://download.pytorch.org/whl/cpu.
# - To keep a CUDA torch installed in the system Python (a GPU host), create the venv
#   yourself first so that it sees the system's packages, then run this script:
#       python3 -m venv --system-site-packages .venv && bash scripts/setup.sh
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
VPY=.venv/bin/python

pip_install() {  # quiet, without pip's note on each configured file:// index that lacks a package
    "$VPY" -m pip install -q "$@" 2>&1 | { grep -v "is ignored: it is neither a file nor a directory" || true; }
}

if [ ! -e "$VPY" ]; then
    echo "setup: creating .venv with $("$PY" -c 'import sys; print(sys.executable, sys.version.split()[0])')"
    if ! "$PY" -m venv .venv; then
        rm -rf .venv
        echo "setup: '$PY -m venv .venv' failed; on Debian/Ubuntu install the venv module" \
             "(apt install python3-venv), or set PYTHON to another python3" >&2
        exit 1
    fi
fi
if ! "$VPY" -c 'import sys; assert sys.version_info >= (3, 10), sys.version' >/dev/null; then
    echo "setup: .venv/bin/python does not run or is older than Python 3.10;" \
         "delete .venv (rm -rf .venv) and run this script again" >&2
    exit 1
fi

if "$VPY" - <<'PYEOF'
import sys
try:
    import torch
except ImportError:
    sys.exit(1)
major, minor = (int(x) for x in torch.__version__.split("+")[0].split(".")[:2])
if (major, minor) < (2, 11):
    print(f"setup: torch {torch.__version__} is older than 2.11")
    sys.exit(1)
print(f"setup: keeping torch {torch.__version__} ({torch.__file__.rsplit('/', 2)[0]})")
PYEOF
then
    :
else
    echo "setup: installing torch==2.13.0+cpu into .venv"
    if ! log=$(pip_install "torch==2.13.0+cpu"); then
        echo "setup: not available from pip's configured sources; trying https://download.pytorch.org/whl/cpu"
        if ! pip_install "torch==2.13.0+cpu" --extra-index-url https://download.pytorch.org/whl/cpu; then
            echo "$log" >&2
            exit 1
        fi
    fi
fi

echo "setup: installing shardwise (editable, with the test extra) into .venv"
pip_install -e ".[test]"
# torchtitan's model code and FSDP recipe for tests/clients/test_torchtitan.py, without its requirements
# (wandb, datasets, torchdata, ...: see the test extra in pyproject.toml); never replaces torch
pip_install --no-deps "torchtitan==0.3.0"
