"""The model worker's torch threads follow what other programs take of the CPU."""

import os

from engine.cpu_share import CpuSample, CpuShare, choose_threads, others_cores, read_sample


def test_other_programs_cores_are_the_busy_time_that_is_not_ours():
    a = CpuSample(busy=1000, total=4000, ours=600)
    # 2 cores, 200 ticks of wall time: 300 busy ticks, 100 of them ours -> 1 core of others
    assert others_cores(a, CpuSample(busy=1300, total=4400, ours=700), 2) == 1.0
    assert others_cores(a, CpuSample(busy=1300, total=4400, ours=1300), 2) == 0.0
    assert others_cores(a, a, 2) == 0.0


def test_one_thread_fewer_per_busy_core_with_a_band_against_flapping():
    assert choose_threads(2, 2, 0.9) == 1  # another program on one of 2 cores
    assert choose_threads(2, 2, 0.4) == 2  # not enough to give a thread up
    assert choose_threads(1, 2, 0.4) == 1  # ... nor to take it back (the band)
    assert choose_threads(1, 2, 0.1) == 2
    assert choose_threads(2, 2, 1.9) == 1  # never below 1
    assert choose_threads(4, 4, 1.6) == 2  # 2 cores busy of 4: 2 fewer
    assert choose_threads(2, 4, 0.0) == 4


def test_it_reads_this_machine():
    sample = read_sample([os.getpid()])
    assert sample is not None and sample.total >= sample.busy >= 0 and sample.ours >= 0
    share = CpuShare(2, [os.getpid()])
    assert share.update() == 2  # no interval has passed yet
