"""The host: what a timed kernel choice is keyed by (``kernel_plan``) and what every benchmark
prints with its result. The same command gives different ratios on different CPUs (AVX-512 vs AVX2
only, MKL's preferred weight layouts), so a number without its host is not a claim."""

from __future__ import annotations

import os
import platform

_ISA = ("avx2", "avx512f", "avx512_bf16", "avx512_vnni", "amx_tile", "amx_bf16", "fma", "neon", "sve")


def cpu_model_and_flags():
    model, flags = platform.processor() or platform.machine(), set()
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as f:
            for line in f:
                key, _, value = line.partition(":")
                key = key.strip()
                if key in ("model name", "Hardware") and model in ("", platform.machine(), platform.processor()):
                    model = value.strip()
                elif key in ("flags", "Features") and not flags:
                    flags = set(value.split())
    except OSError:
        pass
    return model, [isa for isa in _ISA if isa in flags]


def last_level_cache_bytes() -> int:
    """This host's largest CPU cache (Linux sysfs), or 32 MiB where it cannot be read."""
    sizes = []
    for index in range(8):
        try:
            with open(f"/sys/devices/system/cpu/cpu0/cache/index{index}/size", encoding="ascii") as f:
                text = f.read().strip()
        except OSError:
            break
        scale = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}.get(text[-1:], 1)
        sizes.append(int(text.rstrip("KMG")) * scale)
    return max(sizes, default=32 << 20)


def bind_threads_to_share(local: int, size: int) -> str:
    """Bind every thread of this process to local rank ``local``'s share of the ``size`` local
    ranks' cores (as ``msrun --bind_core=True`` does), for ranks sharing one host whose runtimes keep
    busy helper threads; returns what it did. Nothing is changed when this process may run on fewer
    cores than there are local ranks (bound already); cores left after an even split stay unused."""
    cpus = sorted(os.sched_getaffinity(0))
    share = len(cpus) // size
    if share == 0:
        return f"bound to cores {cpus} already"
    mine = set(cpus[local * share : (local + 1) * share])
    for task in os.listdir("/proc/self/task"):  # threads made later inherit the main thread's cores
        try:
            os.sched_setaffinity(int(task), mine)
        except OSError:  # a thread that has just exited
            pass
    return f"each local rank's bound to {share} core{'s' if share > 1 else ''}"


def describe_host(threads=None) -> str:
    """One line: CPU model, the ISA extensions that decide kernel speed, cores, and the threads used."""
    model, isa = cpu_model_and_flags()
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    line = f"host: {model}; ISA {'+'.join(isa) or 'unknown'}; {cores} cores available"
    if threads is not None:
        line += f"; {threads} threads"
    return line
