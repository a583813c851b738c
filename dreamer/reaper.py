"""Nothing of a run outlives its trainer: not its worker processes, not its named semaphores.

Two mechanisms, because each covers what the other cannot:

- Every child of the trainer (env workers, the inference server) calls `bind(trainer)` first: the
  kernel sends it SIGKILL when its parent dies (PR_SET_PDEATHSIG), however the parent dies and
  whoever adopts the child afterwards (pid 1, a subreaper such as `tini -s` or a systemd user
  session). The parent is the trainer, or for env workers the trainer's fork server (multiprocessing's
  forkserver, `dreamer.workers`), which exits when the trainer has died (its end of the server's pipe
  closes). The signal fires when the *thread* that started the child exits, so the trainer starts
  children only from threads that live as long as the run (the main thread, the worker pool's own
  thread). A child whose parent died before the request took effect sees a different parent and
  exits. SIGKILL also ends a stopped child. `trainer_gone()` is the same test for a child's waiting loops.

- multiprocessing's spawn context makes named POSIX semaphores (`/dev/shm/sem.mp-*`), which only
  their finalizers or multiprocessing's resource tracker unlink. `kill -9` of the trainer's process
  group kills the tracker too, and the names stay until the machine reboots. `guard()` therefore names
  the run's semaphores after the trainer's pid (multiprocessing's `semprefix`, the one place a private
  attribute of it is touched) and starts a reaper: a process in a session of its own, so a signal to the
  trainer's group does not reach it. It waits for the trainer to end (a pidfd, and the end of a pipe
  only the trainer writes to), then SIGKILLs the children the trainer registered that are still alive
  (matched by start time, never a reused pid: a second line of defence for a child whose death signal
  was lost, e.g. started from a thread that ended) and unlinks the semaphores carrying the trainer's pid.
  After a clean exit there is nothing left to do, and it exits as well. It runs this file with the
  standard library only (`python -I -S`), so it starts in milliseconds and imports nothing of the run.
"""

from __future__ import annotations

import ctypes
import glob
import multiprocessing
import os
import select
import signal
import subprocess
import sys

PR_SET_PDEATHSIG = 1
SHM = "/dev/shm"

_parent: int | None = None  # in a child: its parent (the trainer, or the trainer's fork server)
_reaper: tuple[int, subprocess.Popen] | None = None  # in the trainer: (its pid, the reaper)


def semaphore_prefix(trainer: int) -> str:
    """The name prefix of the semaphores of the run whose trainer has pid `trainer`."""
    return f"/mp-dreamer{trainer}"


def _name_semaphores(trainer: int) -> None:
    multiprocessing.current_process()._config["semprefix"] = semaphore_prefix(trainer)


def bind(trainer: int) -> None:
    """In a child of the trainer, before anything else: die with the trainer (module docstring)."""
    global _parent
    if sys.platform.startswith("linux"):
        ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
    parent = os.getppid()
    if parent != trainer and _parent_of(parent) != trainer:  # it died before the request took effect:
        os._exit(0)                                           # no signal will come
    _parent = parent
    _name_semaphores(trainer)


def stat_fields(pid: int) -> list[str] | None:
    """The fields of /proc/PID/stat after the command's name (state first: field 3 of proc(5) is index 0),
    or None when there is no such process (or no /proc)."""
    try:
        with open(f"/proc/{pid}/stat") as stat:
            return stat.read().rsplit(")", 1)[1].split()
    except (OSError, IndexError):
        return None


def _parent_of(pid: int) -> int | None:
    fields = stat_fields(pid)
    return int(fields[1]) if fields else None


def trainer_gone() -> bool:
    """In a child bound to its trainer: whether the trainer has died (the child was adopted)."""
    return _parent is not None and os.getppid() != _parent


def guard() -> None:
    """In the trainer, before its first multiprocessing semaphore: names them and starts the reaper (once)."""
    global _reaper
    if _reaper is not None and _reaper[0] == os.getpid():
        return
    _name_semaphores(os.getpid())
    reaper = subprocess.Popen(
        [sys.executable, "-I", "-S", os.path.abspath(__file__), str(os.getpid())],
        stdin=subprocess.PIPE, stdout=subprocess.DEVNULL, start_new_session=True)
    _reaper = (os.getpid(), reaper)


def register(pid: int) -> None:
    """In the trainer: the reaper kills child `pid` if it is still alive when the trainer has died."""
    if _reaper is None or _reaper[0] != os.getpid():
        return
    try:  # a few bytes: one atomic write that never waits on a reader this fast
        os.write(_reaper[1].stdin.fileno(), f"{pid}\n".encode())
    except OSError:  # the reaper is gone; the children still die with the trainer (bind)
        pass


def descendants(pid: int) -> list[int]:
    """The processes under `pid` (its children, theirs, ...), from /proc; [] where there is none."""
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc") if os.path.isdir("/proc") else []:
        if entry.isdigit():
            parent = _parent_of(int(entry))
            if parent is not None:
                children.setdefault(parent, []).append(int(entry))
    found, todo = [], [pid]
    while todo:
        for child in children.get(todo.pop(), []):
            found.append(child)
            todo.append(child)
    return found


def kill_same(pids: dict[int, str]) -> None:
    """SIGKILLs each process of {pid: start time} that is still the one recorded (never a reused pid)."""
    for pid, started in pids.items():
        if started_at(pid) == started:
            try:
                os.kill(pid, signal.SIGKILL)
            except OSError:
                pass


def started_at(pid: int) -> str | None:
    """The start time of process `pid` (ticks since boot), or None when there is no such process."""
    fields = stat_fields(pid)
    return fields[19] if fields else None


def _reap(trainer: int) -> None:
    """The reaper process: waits for the trainer to end, then removes what is left of its run."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    children: dict[int, str] = {}
    watched = [sys.stdin.fileno()]
    try:
        watched.append(os.pidfd_open(trainer))
    except (AttributeError, OSError):  # no pidfd (an old kernel): the pipe's end alone tells
        pass
    pending = b""
    while True:
        ready = select.select(watched, [], [])[0]
        if watched[0] not in ready:  # the pidfd: the trainer has ended
            break
        data = os.read(watched[0], 4096)
        if not data:  # the trainer's end of the pipe closed: it has ended
            break
        *lines, pending = (pending + data).split(b"\n")
        for line in lines:
            started = started_at(int(line))
            if started is not None:
                children[int(line)] = started
    kill_same(children)
    # The run's semaphores, and the CUDA driver's files of the trainer's CUDA IPC (it shares the weight
    # staging buffers with a GPU inference server): `cuda.shm.<device>.<pid in hex>.<n>`, which the driver
    # leaves behind when the consumer still held a shared buffer as the trainer ended (seen on the H200
    # machine after every GPU run with the server in its own process). Their process is gone now.
    leftovers = glob.glob(os.path.join(SHM, "sem." + semaphore_prefix(trainer).lstrip("/") + "-*"))
    leftovers += glob.glob(os.path.join(SHM, f"cuda.shm.*.{trainer:x}.*"))
    for path in leftovers:
        try:
            os.unlink(path)
        except OSError:
            pass


if __name__ == "__main__":
    _reap(int(sys.argv[1]))
