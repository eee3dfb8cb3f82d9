"""How many torch threads an inference process uses: `threads=auto` leaves the cores other work is using.

torch starts one thread per core. Its threads meet at a barrier after every operation, so when another
process holds one of the cores, every operation waits for the descheduled thread: a decode step can run
10x slower with two threads than with one (measured in reports/2026-11-29-threads-under-load.md). `auto`
therefore counts the cores busy with other work just before the run and takes the rest, at least one.

    threads = apply_threads("auto")   # or an integer >= 1; returns the count set, with the reason
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass

import torch

from rope_llama.core.checks import is_integer

AUTO = "auto"
SAMPLE_SECONDS = 0.2  # long enough to see a busy core, short beside any evaluation


def check_threads(value) -> None:
    """`auto` or an integer >= 1, else one sentence."""
    if value == AUTO or (is_integer(value) and value >= 1):
        return
    raise ValueError(f"threads must be `auto` or an integer >= 1, got {value!r}.")


def threads_for(cores: int, busy: float) -> int:
    """The cores left when `busy` of `cores` are taken by other work (rounded to whole cores), at least 1."""
    return max(1, cores - round(busy))


def usable_cores() -> list[int]:
    """The CPUs this process may run on (its affinity mask where the OS has one)."""
    if hasattr(os, "sched_getaffinity"):
        return sorted(os.sched_getaffinity(0))
    return list(range(os.cpu_count() or 1))


def busy_cores(seconds: float = SAMPLE_SECONDS) -> float:
    """Cores' worth of CPU time spent by everything on this process's CPUs over `seconds` (this process
    sleeps meanwhile), from /proc/stat; where that does not exist, the 1-minute load average."""
    cpus = usable_cores()
    try:
        before = cpu_times(cpus)
        time.sleep(seconds)
        after = cpu_times(cpus)
    except (OSError, ValueError):
        return os.getloadavg()[0]
    total = after[0] - before[0]
    busy = total - (after[1] - before[1])
    return len(cpus) * busy / total if total > 0 else 0.0


def cpu_times(cpus: list[int], path: str = "/proc/stat") -> tuple[int, int]:
    """(all, idle) jiffies since boot summed over `cpus`, from /proc/stat's `cpuN` lines (idle includes
    iowait; guest time is already inside user time, so it is not added again)."""
    wanted = {f"cpu{n}" for n in cpus}
    total = idle = 0
    with open(path) as f:
        for line in f:
            name, *values = line.split()
            if name in wanted:
                fields = [int(x) for x in values]
                total, idle = total + sum(fields[:8]), idle + fields[3] + fields[4]
    if not total:
        raise ValueError("no usable CPU in /proc/stat")
    return total, idle


@dataclass(frozen=True)
class ThreadChoice:
    threads: int
    reason: str


def choose_threads(value, cores: int | None = None, busy: float | None = None, env=None) -> ThreadChoice:
    """The thread count for `value` (`auto` or an integer). For auto: an explicit OMP_NUM_THREADS in
    `env` wins (the study sets it for its parallel lanes), else the cores not busy (measured unless given)."""
    check_threads(value)
    if value != AUTO:
        return ThreadChoice(int(value), "threads was given")
    env = os.environ if env is None else env
    if env.get("OMP_NUM_THREADS", "").isdigit() and int(env["OMP_NUM_THREADS"]) >= 1:
        return ThreadChoice(int(env["OMP_NUM_THREADS"]), "OMP_NUM_THREADS is set")
    cores = cores or len(usable_cores())
    busy = busy_cores() if busy is None else busy
    return ThreadChoice(threads_for(cores, busy), f"{busy:.1f} of {cores} cores busy with other work")


def apply_threads(value) -> ThreadChoice:
    """Set torch's intra-op threads for `value`; the C decode step follows torch's count."""
    choice = choose_threads(value)
    torch.set_num_threads(choice.threads)
    return choice
