"""This machine's memory, read from ``/proc``: what the host has available (train's pre-launch check, the job dry
run) and this process's resident peak (the bench, ``benchmarks/checkpoint.py``). Measurements, not estimates:
the memory model is the planner's (``plan/estimate.py``)."""

from __future__ import annotations

__all__ = ["host_available_bytes", "host_peak_bytes", "host_resident_bytes", "reset_host_peak"]


def _proc_bytes(path: str, key: str) -> int | None:
    """A ``key: N kB`` line of a /proc file, in bytes; ``None`` where unknown (not Linux)."""
    try:
        with open(path) as f:
            for line in f:
                if line.startswith(key):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None


def host_available_bytes() -> int | None:
    """The host's available memory (``MemAvailable`` of ``/proc/meminfo``); ``None`` where unknown."""
    return _proc_bytes("/proc/meminfo", "MemAvailable:")


def host_peak_bytes() -> float:
    """This process's peak resident host memory since :func:`reset_host_peak` (NaN where unknown)."""
    value = _proc_bytes("/proc/self/status", "VmHWM:")
    return float("nan") if value is None else float(value)


def host_resident_bytes() -> float:
    """This process's resident host memory now (NaN where unknown)."""
    value = _proc_bytes("/proc/self/status", "VmRSS:")
    return float("nan") if value is None else float(value)


def reset_host_peak() -> None:
    """Start :func:`host_peak_bytes` over from the current resident memory."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
    except OSError:
        pass
