"""The megatron-core 0.19 wheel, unpacked: Megatron-LM's ``megatron/training`` from what pip installs.

megatron-core 0.19 needs Python 3.12, so pip will not install it next to 0.16.1 on 3.11;
its wheel (pure Python but for a dataset helper the tests do not load) carries both
``megatron/core`` and ``megatron/training``. ``megatron_core_019()`` downloads it once per
virtual environment (``pip download``, the wheel only) and unpacks it under the environment;
``scripts/megatron_lm_check.py``'s ``put_on_path`` then puts it first on ``sys.path``
in the process that runs it (Python 3.11 getting ``typing.override`` from
``typing_extensions``). Its training code also imports ``six`` and ``triton`` (the test extra).
"""

from __future__ import annotations

import fcntl
import shutil
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

RELEASE = "0.19.2"


def megatron_core_019() -> Path:
    """The unpacked wheel's folder (holding ``megatron/``), fetched with pip the first time."""
    target = Path(sys.prefix) / f"megatron-core-{RELEASE}"
    if (target / "megatron" / "training" / "training.py").is_file():
        return target
    # one fetch at a time: two xdist workers (or two runs) would each replace the folder the other reads
    with open(Path(sys.prefix) / f"megatron-core-{RELEASE}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if (target / "megatron" / "training" / "training.py").is_file():  # fetched while this one waited
            return target
        _fetch(target)
    return target


def _fetch(target: Path) -> None:
    with tempfile.TemporaryDirectory() as tmp:
        run = subprocess.run(
            [sys.executable, "-m", "pip", "download", "-q", "--no-deps", f"megatron-core=={RELEASE}",
             "--python-version", "3.12", "--only-binary=:all:", "-d", tmp],
            capture_output=True, text=True, timeout=600,
        )
        wheels = list(Path(tmp).glob("megatron_core-*.whl"))
        if run.returncode != 0 or not wheels:
            raise RuntimeError(f"pip could not download megatron-core=={RELEASE}: {run.stdout[-2000:]}"
                               f"{run.stderr[-2000:]}")
        unpacked = Path(tmp) / "unpacked"
        zipfile.ZipFile(wheels[0]).extractall(unpacked)
        # byte code now, once, on every core: where PYTHONDONTWRITEBYTECODE is set (CI) nothing is written at import,
        # and each rank of every Megatron-LM run would compile megatron/core and megatron/training from source
        subprocess.run([sys.executable, "-m", "compileall", "-q", "-j", "0", str(unpacked)], capture_output=True,
                       timeout=600)
        shutil.rmtree(target, ignore_errors=True)
        shutil.move(str(unpacked), str(target))
