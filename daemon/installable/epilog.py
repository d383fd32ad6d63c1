#!/usr/bin/python3 -IS
"""EpilogSlurmctld hook: tell a running slurm-medic at once that a job ended.

slurmctld runs this as SlurmUser after every job with SLURM_JOB_ID set. It sends that id, and
nothing else, to the daemon's unix datagram socket without waiting, and always exits 0 within
half a second: a missing daemon, a full socket or a bad environment never fails or delays a
job. The daemon's poll stays the source of truth; this only makes it look sooner. The daemon
lets only root and the SlurmUser write to its socket and drops datagrams from anyone else.

Standard library only; the socket path may be overridden with SLURM_MEDIC_HOOK_SOCKET.
`slurm-medic install epilog` writes this very file (run by the system's python3, isolated:
nothing of the environment or of site-packages); the `slurm-medic-epilog` console script runs
its `main`, which exits 0 just the same.
"""

from __future__ import annotations

import contextlib
import os
import re
import signal
import socket
import sys

DEFAULT_SOCKET = "/run/slurm-medic/hook.sock"
DEADLINE_S = 0.5


def _give_up(_signum: int, _frame: object) -> None:
    os._exit(0)


def _notify() -> None:
    signal.signal(signal.SIGALRM, _give_up)
    signal.setitimer(signal.ITIMER_REAL, DEADLINE_S)
    job_id = os.environ.get("SLURM_JOB_ID", "")
    if not re.fullmatch(r"[0-9]{1,19}", job_id, flags=re.ASCII):
        return
    path = os.environ.get("SLURM_MEDIC_HOOK_SOCKET") or DEFAULT_SOCKET
    with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as sock:
        sock.sendto(job_id.encode("ascii"), socket.MSG_DONTWAIT, path)


def main() -> int:
    """Send the job id if there is one; 0 whatever happened, so a job never fails here."""
    with contextlib.suppress(BaseException):
        _notify()
    return 0


if __name__ == "__main__":
    sys.exit(main())
