"""A worker thread whose torch CPU ops run on it alone, not on an OpenMP team, without touching the process's
thread count.

torch splits a large CPU op over an OpenMP team of torch.get_num_threads() threads and returns when the last is
done: beside other busy processes one of them waits for the scheduler, and the team takes every core while it
runs (the daemon's event loop included). torch.set_num_threads would change that for every thread of the process
(and every thread started while it holds); OpenMP's own count, omp_set_num_threads, is the calling thread's, and
torch's OpenMP backend asks it (omp_get_max_threads) at every op. So a thread sets its own count to 1 once,
after torch's per-thread set-up (which would set it back). Results are those of a team: torch's CPU reductions
split the outputs, not one output's sum, over a team's threads (a test checks the error figures bit for bit).
"""

from __future__ import annotations

import ctypes
from concurrent.futures import ThreadPoolExecutor

import torch


def _alone() -> None:
    torch.get_num_threads()  # torch's set-up of this thread's OpenMP count, before it is changed
    try:
        set_threads = ctypes.CDLL(None).omp_set_num_threads  # torch's OpenMP runtime, loaded with its symbols global
    except AttributeError:
        return  # a torch without OpenMP: its thread pool is the process's, and this thread uses it as any other
    set_threads(1)


def executor(name: str) -> ThreadPoolExecutor:
    """One worker thread, named `name`, whose torch ops run on it alone."""
    return ThreadPoolExecutor(max_workers=1, thread_name_prefix=name, initializer=_alone)
