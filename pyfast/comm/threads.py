"""gloo's transport thread on a core it shares with the rank's compute.

gloo runs one I/O thread per process group ("gloo_tcp_loop", an epoll loop over the group's
sockets). A message's data leaves only once the sender's I/O thread has read the receiver's
"ready" notice, and arriving data is read by the receiver's I/O thread. On CPU ranks pinned
one per core (how `pyfast bench pipeline` runs them, as taskset or a launcher would) that
thread shares the core with the main thread, which costs twice:
- It spins. The loop handles a socket under a try_lock of the pair's mutex and, when the main
  thread holds it (inside isend / irecv), goes back to epoll at once, which reports the same
  readable socket again. Woken by data while the main thread is mid-call, it can preempt that
  thread and spin until the scheduler's tick (4 ms at HZ=250): in traces of the tiny model
  (8 x Linear(256), 2 pinned ranks, 2-core Xeon, torch 2.13) posting a receive took 1.5-3.9 ms,
  and the loop thread used 8-15 ms of CPU in a 36 ms interleaved-1F1B step (torch's own
  schedules, same process: 6-8 ms of 24-28).
- A send whose receive is already posted still goes the slow way (a notice, then the data from
  the I/O thread) when the loop has not run since the notice arrived.
So a pipeline's own groups get their loop thread the SCHED_BATCH policy (no privilege needed):
a batch thread never preempts a running one when it wakes (the kernel skips wakeup preemption for
it), so it no longer takes the core from the main thread mid-call, and it still competes at its
full weight (nice 0 by default) once the main thread waits, also against another rank's compute
on the same core. Measured side by side on that machine (tiny model, torch 2.13, kernel 6.18,
2 runs each, `pyfast bench pipeline`'s harness): against the thread at nice 19 with a
sched_yield before each send (the previous scheme) 1F1B 10.8-11.0 -> 9.1-9.3 ms a step at 2
ranks and 18.9-19.9 -> 17.8-18.7 at 4; GPipe 9.3 -> 8.3 and 17.4 -> 15.3; interleaved-1F1B
21.3 -> 15.5 and 30.2 -> 27.4. At nice 19 a thread whose main thread waits starves behind a
co-located rank's compute (at 4 ranks on 2 cores a send waited 0.3-0.9 ms), and the yield before
each send handed the core to that rank (264 us a call); a batch thread needs neither (with or
without the yield: 18.1 / 18.2 ms). Nice 0 and 19 with SCHED_BATCH measured within the noise.
Linux only (the thread's name, /proc, SCHED_BATCH); elsewhere nothing is changed (a Pipeline's
`io_threads` is empty).
"""
from __future__ import annotations

import contextlib
import os

import torch.distributed as dist

LOOP_NAME = "gloo_tcp_loop"


def loop_threads() -> set[int]:
    """Thread ids of this process's gloo I/O loops (empty where /proc is not readable)."""
    try:
        tids = os.listdir("/proc/self/task")
    except OSError:
        return set()
    out = set()
    for t in tids:
        try:
            with open(f"/proc/self/task/{t}/comm") as f:
                if f.read().strip() == LOOP_NAME:
                    out.add(int(t))
        except OSError:  # the thread ended meanwhile
            continue
    return out


def nice_problem(nice) -> str | None:
    """What is wrong with an io_nice, or None: it is None or an int in 0..19 (lowering a
    thread's priority needs no privilege; raising it does)."""
    if nice is not None and (not isinstance(nice, int) or isinstance(nice, bool)
                             or not 0 <= nice <= 19):
        return (f"io_nice must be None or an int in 0..19 (a nice value for gloo's I/O "
                f"thread), got {nice!r}")
    return None


def lowered(make, nice: int):
    """(group, tids): make() a gloo group (collective, as dist.new_group) and give the I/O loop
    threads it started the SCHED_BATCH policy at nice `nice`. A barrier on the group makes gloo
    connect now even under TORCH_GLOO_LAZY_INIT, so that its thread exists to be found (every
    rank calls it)."""
    before = loop_threads()
    group = make()
    dist.barrier(group=group)
    found = sorted(loop_threads() - before)
    for tid in found:
        # each on its own: a policy that refuses one (a seccomp filter) still leaves the other;
        # the nice value after the policy, whose change may reset it
        with contextlib.suppress(OSError, AttributeError):  # the thread ended, or refused
            os.sched_setscheduler(tid, os.SCHED_BATCH, os.sched_param(0))
        with contextlib.suppress(OSError):
            os.setpriority(os.PRIO_PROCESS, tid, nice)
    return group, found
