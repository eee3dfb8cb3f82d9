"""threads=auto (rope_llama/core/threads.py): the cores other work leaves free, at least one; an explicit
count or OMP_NUM_THREADS wins; a bad value is one sentence. The busy count is injected, so every branch
runs on any host; one test measures a real busy core."""

from __future__ import annotations

import subprocess
import sys
import time

import pytest
import torch

from rope_llama.core import threads as threads_module
from rope_llama.core.threads import busy_cores, check_threads, choose_threads, cpu_times, threads_for


@pytest.mark.parametrize(
    "cores, busy, expected",
    [
        (2, 0.0, 2),
        (2, 0.4, 2),
        (2, 0.6, 1),
        (2, 1.0, 1),
        (2, 2.0, 1),
        (2, 7.5, 1),
        (16, 3.2, 13),
        (1, 0.0, 1),
    ],
)
def test_threads_for_leaves_the_busy_cores(cores, busy, expected):
    assert threads_for(cores, busy) == expected


def test_auto_measures_unless_a_count_or_omp_num_threads_is_given():
    assert choose_threads("auto", cores=2, busy=1.0, env={}).threads == 1
    assert choose_threads("auto", cores=2, busy=0.1, env={}).reason == "0.1 of 2 cores busy with other work"
    assert (
        choose_threads("auto", cores=2, busy=2.0, env={"OMP_NUM_THREADS": "2"}).threads == 2
    )  # the study's lanes
    assert choose_threads("auto", cores=4, busy=0.0, env={"OMP_NUM_THREADS": "x"}).threads == 4  # not a count
    assert choose_threads(3, cores=2, busy=2.0, env={"OMP_NUM_THREADS": "1"}).threads == 3  # given wins


@pytest.mark.parametrize("value", [0, -1, 1.5, True, "many", None, "AUTO"])
def test_bad_thread_values_are_one_sentence(value):
    with pytest.raises(ValueError, match=r"^threads must be `auto` or an integer >= 1, got .*\.$"):
        check_threads(value)


def test_cpu_times_sums_only_the_usable_cpus(tmp_path):
    stat = tmp_path / "stat"
    stat.write_text(
        "cpu  30 0 0 70 0 0 0 0 0 0\n"
        "cpu0 10 0 0 40 0 0 0 0 0 0\n"
        "cpu1 20 0 0 30 0 0 0 0 5 0\n"  # guest time (5) is inside user time already
        "cpu2 99 0 0 1 0 0 0 0 0 0\n"
        "intr 1 2 3\n"
    )
    assert cpu_times([0, 1], str(stat)) == (100, 70)
    with pytest.raises(ValueError):
        cpu_times([7], str(stat))


def test_busy_cores_from_two_samples_and_the_load_average_without_proc(monkeypatch):
    samples = iter([(1000, 600), (1100, 650)])  # 100 jiffies, 50 idle: half of the cores busy
    monkeypatch.setattr(threads_module, "usable_cores", lambda: [0, 1])
    monkeypatch.setattr(threads_module, "cpu_times", lambda cpus: next(samples))
    assert busy_cores(seconds=0) == pytest.approx(1.0)

    def no_proc(cpus):
        raise OSError("no /proc")

    monkeypatch.setattr(threads_module, "cpu_times", no_proc)
    monkeypatch.setattr(threads_module.os, "getloadavg", lambda: (1.5, 0.0, 0.0))
    assert busy_cores(seconds=0) == 1.5


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc/stat")
def test_a_spinning_process_counts_as_a_busy_core():
    spin = subprocess.Popen([sys.executable, "-c", "print('ready', flush=True)\nwhile True: pass"],
                            stdout=subprocess.PIPE, text=True)  # fmt: skip
    try:
        spin.stdout.readline()
        time.sleep(0.1)
        assert busy_cores(seconds=0.5) >= 0.7  # one whole core, less scheduling noise
    finally:
        spin.kill()
        spin.wait()


def test_apply_sets_torch_threads(monkeypatch):
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    before = torch.get_num_threads()
    try:
        assert threads_module.apply_threads(1).threads == 1 and torch.get_num_threads() == 1
    finally:
        torch.set_num_threads(before)
