#!/usr/bin/env bash
# Set up shardwise in a virtual environment, .venv at the repository root, and install
# it there (editable). Nothing is installed outside .venv.
#
#   bash scripts/setup.sh && .venv/bin/python -m shardwise train        # what the main job needs
#   bash scripts/setup.sh test && .venv/bin/python -m pytest -q -n 2    # and the test extra
#
# - The argument names the extras to install as well (pyproject.toml's optional-dependencies,
#   comma-separated: test, hf, data, fp8, megatron, tensorboard, wandb); none: the main job's
#   dependencies only (torch, numpy, safetensors, tqdm, matplotlib). The test extra is large
#   (transformers, megatron-core, torchao, tokenizers, pyarrow, tensorboard: about 1.6 GB).
# - .venv is created with `${PYTHON:-python3} -m venv .venv` when it does not exist; an
#   existing .venv is used as it is (running the script again only updates the install).
# - torch: a torch >= 2.11 that .venv/bin/python can import is kept. Otherwise the CPU
#   build torch==2.13.0+cpu is installed (a plain `pip install torch` on Linux would pull
#   a multi-GB CUDA build): from what pip is configured with (a local wheel folder or
#   index), in the same pip call as shardwise, else from https://download.pytorch.org/whl/cpu.
# - pip runs with --no-compile, and one `compileall -j 0` over .venv and the repository byte-compiles
#   everything afterwards on every core (pip compiles one file at a time). Byte code must exist before
#   the first import: with PYTHONDONTWRITEBYTECODE set (as on CI) nothing is written at import, and every
#   process would compile torch, sympy and transformers from source again (the suite took 3x as long).
# - To keep a CUDA torch installed in the system Python (a GPU host), create the venv
#   yourself first so that it sees the system's packages, then run this script:
#       python3 -m venv --system-site-packages .venv && bash scripts/setup.sh
# - pip's own progress is shown; while pip is silent (unpacking and installing large wheels)
#   a line every 5 s says it is still working.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
VPY=.venv/bin/python
EXTRAS=${1:-}
case "$EXTRAS" in
    *[!a-z0-9,_-]*) echo "setup: '$EXTRAS' is not a comma-separated list of extras (e.g. test, or hf,data)" >&2
                    exit 2 ;;
esac

pip_install() {  # pip's progress, without its note on each configured file:// index that lacks a package;
    # while pip prints nothing for 5 s, one line every 5 s says how long it has been working
    local stamp started ticker status
    stamp=$(mktemp)
    started=$(date +%s)
    date +%s > "$stamp"
    (
        set +e  # a stamp read while it is rewritten (empty) must not end the ticker
        while sleep 1; do
            now=$(date +%s)
            last=$(cat "$stamp" 2>/dev/null)
            case "$last" in ''|*[!0-9]*) continue ;; esac
            if [ $((now - last)) -ge 5 ]; then
                echo "setup: pip is still working ($((now - started)) s: downloading, unpacking or installing)"
                echo "$now" > "$stamp"
            fi
        done
    ) &
    ticker=$!
    set +e
    "$VPY" -m pip install "$@" 2>&1 | while IFS= read -r line; do
        case "$line" in *"is ignored: it is neither a file nor a directory"*) continue ;; esac
        printf '%s\n' "$line"
        printf '%(%s)T\n' -1 > "$stamp"  # now, without a process per line
    done
    status=${PIPESTATUS[0]}
    set -e
    kill "$ticker" 2>/dev/null || true
    wait "$ticker" 2>/dev/null || true
    rm -f "$stamp"
    return "$status"
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

echo "setup: checking for a torch >= 2.11 in .venv (importing torch takes a few seconds)"
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
    TORCH=()
else
    TORCH=("torch==2.13.0+cpu")
fi

# One pip call for torch and shardwise with its extras (one resolution, one install step); --no-compile: the
# byte code is made once at the end, on every core (below)
if [ -n "$EXTRAS" ]; then
    echo "setup: installing shardwise (editable, with the extras: $EXTRAS)${TORCH:+ and torch==2.13.0+cpu} into .venv"
    PROJECT=(-e ".[$EXTRAS]")
else
    echo "setup: installing shardwise (editable; the main job's dependencies)${TORCH:+ and torch==2.13.0+cpu}" \
         "into .venv; bash scripts/setup.sh test adds the test extra"
    PROJECT=(-e .)
fi
if ! pip_install --no-compile "${TORCH[@]}" "${PROJECT[@]}"; then
    [ ${#TORCH[@]} -gt 0 ] || exit 1
    echo "setup: torch==2.13.0+cpu is not available from pip's configured sources;" \
         "installing it from https://download.pytorch.org/whl/cpu"
    pip_install --no-compile "torch==2.13.0+cpu" --extra-index-url https://download.pytorch.org/whl/cpu
    pip_install --no-compile "${PROJECT[@]}"
fi
case ",$EXTRAS," in *,test,*)
    # torchtitan's model code and FSDP recipe for tests/clients/test_torchtitan.py, without its requirements
    # (wandb, datasets, torchdata, ...: see the test extra in pyproject.toml); never replaces torch
    echo "setup: installing torchtitan==0.3.0 (without its requirements) for the tests"
    pip_install --no-compile --no-deps "torchtitan==0.3.0" ;;
esac
# Byte code for every module, in parallel (about 15 s on 2 cores for the test extra). Compile errors are
# expected and harmless: a few modules of torch's test helpers are written for newer Pythons.
echo "setup: byte-compiling .venv and the repository"
"$VPY" -m compileall -q -j 0 "$("$VPY" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')" \
    shardwise tests scripts > /dev/null 2>&1 || true
echo "setup: done"
