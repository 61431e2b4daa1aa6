"""Background CPU priority for a zygote that waits: serving first, the next restore after.

A zygote (agent/node/agent.py's pool) is started ahead of need: a Python process importing
torch, allocating and faulting in its restore buffer, seconds of CPU on a CPU node.  Started
beside replicas that serve, it takes their cores: in the live trace replay (bench/trace_replay.py
at load 0.3, records of one run) two warm replicas answered 8-11 requests/s in the seconds
after two restores, when by the timing both zygotes were being refilled (the refill was not
logged), against 38-53 requests/s later, and the front door refused the difference; with
refills at this priority the next run refused 5 requests where that one refused 93.
So a waiting zygote runs at
``nice`` :data:`ZYGOTE_NICE`: the kernel's CFS gives a nice-10 thread a weight of 110 against
1024 at nice 0 (``sched_prio_to_weight`` in kernel/sched/core.c), about a tenth of a contended
core, and all of an idle one.  When a zygote is taken for a restore, which is on a request's
path, every thread of it goes back to nice 0 first (:func:`to_normal`).

Going back to nice 0 needs ``CAP_SYS_NICE`` or an ``RLIMIT_NICE`` of at least 20
(sched(7), setpriority(2)); where neither holds (:func:`can_restore_normal` is False) zygotes
start at normal priority, since a restore at nice 10 would pay for the refill instead.
Linux keeps nice per thread: setpriority(PRIO_PROCESS, pid) changes one thread, so
:func:`to_normal` walks ``/proc/PID/task``; threads started later inherit their creator's.
"""

from __future__ import annotations

import logging
import os
import resource

log = logging.getLogger(__name__)

ZYGOTE_NICE = 10
RENICE_PASSES = 8   # listings of /proc/PID/task before to_normal gives up (threads keep starting)
_CAP_SYS_NICE = 23   # bit in CapEff (linux/capability.h)


def can_restore_normal() -> bool:
    """Whether this process may set a child's threads back to nice 0 (module docstring):
    ``CAP_SYS_NICE`` in its effective set, or an ``RLIMIT_NICE`` soft limit of at least 20
    (or unlimited).  Being uid 0 is not enough: a container's root commonly lacks
    ``CAP_SYS_NICE`` (Docker's default capability set drops it), and setpriority back to 0
    is then refused with EACCES on every restore."""
    soft = resource.getrlimit(resource.RLIMIT_NICE)[0]
    if soft == resource.RLIM_INFINITY or soft >= 20:
        return True
    cap_eff = _cap_eff()
    if cap_eff is None:      # no /proc status to read: only uid 0 is a sign
        return os.geteuid() == 0
    return bool(cap_eff >> _CAP_SYS_NICE & 1)


def _cap_eff() -> int | None:
    """This process's effective capability bits (``CapEff`` of /proc/self/status, proc(5));
    None where it cannot be read."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("CapEff:"):
                    return int(line.split()[1], 16)
    except (OSError, ValueError, IndexError):
        pass
    return None


def thread_nices(pid: int) -> dict[int, int]:
    """Each thread of ``pid`` -> its nice value (``/proc/PID/task/TID/stat`` field 19).
    Raises ProcessLookupError when the process is gone."""
    out = {}
    try:
        tids = os.listdir(f"/proc/{pid}/task")
    except FileNotFoundError:
        raise ProcessLookupError(pid) from None
    for tid in tids:
        try:
            with open(f"/proc/{pid}/task/{tid}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
        except FileNotFoundError:    # the thread ended meanwhile
            continue
        out[int(tid)] = int(fields[16])
    return out


def to_normal(pid: int) -> bool:
    """Set every thread of ``pid`` to nice 0; returns whether all were seen at 0.  A thread
    the process starts while this runs inherits nice 10 from its creator after the
    ``/proc/PID/task`` listing, so the listing is read again until a pass finds nothing to
    change, at most :data:`RENICE_PASSES` times (then logged: the restore goes on, slower).
    A process already gone is left to the restore call that follows (it fails with
    ConnectionError, as a dead zygote does); a thread that ended meanwhile is skipped.
    Raises PermissionError where the caller lacks the right (:func:`can_restore_normal`)."""
    for _ in range(RENICE_PASSES):
        try:
            tids = thread_nices(pid)
        except ProcessLookupError:
            return True
        changed = False
        for tid, nice in tids.items():
            if nice == 0:
                continue
            changed = True
            try:
                os.setpriority(os.PRIO_PROCESS, tid, 0)
            except ProcessLookupError:
                continue
        if not changed:
            return True
    log.warning("process %d: threads still at background priority after %d passes over "
                "/proc/%d/task (it keeps starting threads); the restore goes on", pid,
                RENICE_PASSES, pid)
    return False
