"""Leads one child's process group and takes the group down when the parent dies: `python watcher.py PARENT CMD...`.

It asks the kernel for SIGUSR1 when its parent dies (Linux PR_SET_PDEATHSIG), forks the command (which gets
SIGKILL on the watcher's death the same way) and waits for it. When the parent dies (kill -9 of the launcher:
no atexit, no cleanup) it SIGTERMs the whole group, the command's own children included (vLLM's engine core
and workers), and SIGKILLs it after a grace period, so a child that ignores SIGTERM does not survive either.
The watcher ignores SIGTERM itself (a group stop reaches the command directly) and exits as the command did.
A plain script, single-threaded, importing nothing of primejax: it must start fast and cannot deadlock.
"""

import ctypes
import os
import signal
import sys
import time

PR_SET_PDEATHSIG = 1
GRACE_S = 5.0
libc = ctypes.CDLL(None, use_errno=True)
pid = None


def orphaned(*_):
    os.killpg(0, signal.SIGTERM)
    deadline = time.monotonic() + GRACE_S
    while pid is not None and time.monotonic() < deadline:
        try:
            if os.waitpid(pid, os.WNOHANG)[0]:
                break
        except ChildProcessError:
            break
        time.sleep(0.05)
    os.killpg(0, signal.SIGKILL)


def main():
    global pid
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    signal.signal(signal.SIGUSR1, orphaned)
    libc.prctl(PR_SET_PDEATHSIG, signal.SIGUSR1)
    if os.getppid() != int(sys.argv[1]):  # the parent died before the prctl
        orphaned()
    pid = os.fork()
    if pid == 0:
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
        signal.signal(signal.SIGUSR1, signal.SIG_DFL)
        libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL)
        if os.getppid() == 1:
            os._exit(1)
        try:
            os.execvp(sys.argv[2], sys.argv[2:])
        finally:
            os._exit(127)
    try:
        _, status = os.waitpid(pid, 0)
    except ChildProcessError:
        os._exit(1)
    if os.WIFSIGNALED(status):  # die the same way, so the parent sees -SIG as it would without a watcher
        sig = os.WTERMSIG(status)
        if sig != signal.SIGKILL:
            signal.signal(sig, signal.SIG_DFL)
        os.kill(os.getpid(), sig)
    os._exit(os.waitstatus_to_exitcode(status))


if __name__ == "__main__":
    main()
