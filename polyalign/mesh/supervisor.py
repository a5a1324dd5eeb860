"""A parent process over each process of a multi-process training job, and the line a process says when a
peer of its job is gone.

JAX's distributed client ends a process the moment the job's coordinator (process 0) stops answering: a
C++ check failure, SIGABRT, status 134, and no Python code run, so neither the peer monitor nor the
training loop can say what happened or where to resume. Started as one of several processes
(POLYALIGN_NUM_PROCESSES > 1), `polyalign train` therefore runs itself as a child under a small parent
that imports no JAX: the parent passes signals on, ends with the child's status, and turns that abort
into the lost-peer line (the last committed checkpoint, the command that resumes) and status
PEER_LOST_EXIT, as the other ways of losing a peer end. The child tells the parent who it is in the job
and where its checkpoints are through a small JSON file (`tell_parent`). The parent also does what the
child cannot: it ends a child stuck in JAX's join when asked to stop or when the launcher saw a peer fail,
and stops it when `polyalign launch` itself is gone.
"""

from __future__ import annotations

import contextlib
import ctypes
import json
import os
import shlex
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path

from polyalign.core.paths import committed_steps
from polyalign.core.temporary import process_temporary
from polyalign.mesh.launch import LAUNCH_COMMAND_ENV, NOTICES_ENV, launcher_notices

PEER_LOST_EXIT = 4  # the status of a process that stopped because a peer of its job is gone
STATE_ENV = "POLYALIGN_PARENT_STATE"  # set in the child: the file it tells the parent through
FORWARDED = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGUSR1)
_PR_SET_PDEATHSIG = 1  # prctl option: a signal the kernel sends this process when its parent ends


def wanted(argv: Sequence[str], env: Mapping[str, str]) -> bool:
    """Whether this `polyalign` run goes under a parent: a training command (the only one that joins a
    job) started as one of several processes, on Linux (where the child can be made to end with its parent),
    and not already the child."""
    processes = env.get("POLYALIGN_NUM_PROCESSES", "").strip()
    return (sys.platform == "linux" and STATE_ENV not in env and bool(argv) and argv[0] == "train"
            and processes.isdigit() and int(processes) > 1 and env.get("POLYALIGN_NO_PARENT", "") in ("", "0"))


def tell_parent(**facts) -> None:
    """In the child, adds `facts` (JSON values) to what the parent reads when it ends; nothing otherwise."""
    path = os.environ.get(STATE_ENV)
    if not path:
        return
    with contextlib.suppress(OSError, ValueError):  # the parent's file is a courtesy, never a reason to stop
        known = json.loads(Path(path).read_text() or "{}")
        temporary = f"{path}.{os.getpid()}"
        Path(temporary).write_text(json.dumps({**known, **facts}))
        os.replace(temporary, path)  # whole or not at all: the parent may read it at any moment


def signal_when_parent_ends(sig: int) -> Callable[[], None]:
    """A `preexec_fn` for a child process: the kernel sends it `sig` when the process that started it
    ends, however it ends (PR_SET_PDEATHSIG; Linux only, elsewhere nothing)."""
    def arm() -> None:
        if sys.platform == "linux":
            ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, sig, 0, 0, 0)
    return arm


def run_as_parent(argv: Sequence[str], command: Sequence[str] | None = None) -> int:
    """Runs `command` (this `polyalign` with `argv`) as a child and returns what this process's status should
    be. The child has a process group of its own, so a terminal's Ctrl-C reaches it once, through here; SIGTERM,
    SIGINT, SIGHUP and SIGUSR1 are passed on. Until the child has joined its job, the parent also ends it
    itself (stopped_while_joining): JAX's join is C++ that no Python signal handler interrupts."""
    command = list(command or [sys.executable, "-P", "-m", "polyalign.cli", *argv])
    state = process_temporary("polyalign-parent-", suffix=".json")
    previous, asked = {}, []
    try:
        # killed with the parent: a parent killed outright (SIGKILL from a scheduler or `polyalign launch`)
        # can pass nothing on, and must not leave a child holding the devices
        child = subprocess.Popen(command, env={**os.environ, STATE_ENV: state}, process_group=0,
                                 preexec_fn=signal_when_parent_ends(signal.SIGKILL))

        def forward(signum, frame):
            if child.poll() is None:
                child.send_signal(signum)
                asked.append((signum, time.monotonic()))

        previous = {sig: signal.signal(sig, forward) for sig in FORWARDED}
        joined = False
        # Started by `polyalign launch`: a launcher killed outright (SIGKILL, out of memory) forwards nothing,
        # and its processes would train on with no one to read them; this one is handed to another parent
        # then, and stops as a scheduler's SIGTERM stops it (a checkpoint after the current step).
        launcher = os.getppid() if os.environ.get(NOTICES_ENV) else None
        while True:
            try:
                code = child.wait(timeout=0.5)
                break
            except subprocess.TimeoutExpired:
                pass
            if launcher is not None and os.getppid() != launcher:
                launcher = None
                forward(signal.SIGTERM, None)
            joined = joined or "process" in _read_state(state)
            stop = None if joined else stopped_while_joining(argv, asked, os.environ)
            if stop is not None:
                child.kill()
                child.wait()
                print(stop[0], file=sys.stderr, flush=True)
                return stop[1]
        if code == -signal.SIGABRT:
            line = lost_coordinator_line(_read_state(state), argv)
            if line is not None:
                print(line, file=sys.stderr, flush=True)
                return PEER_LOST_EXIT
        return code
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
        with contextlib.suppress(OSError):
            os.unlink(state)


JOIN_STOP_GRACE = 2.0  # seconds a child asked to stop before it joined gets to stop by itself


def stopped_while_joining(argv: Sequence[str], asked: Sequence[tuple[int, float]],
                          env: Mapping[str, str]) -> tuple[str, int] | None:
    """Whether a child that has not joined its job yet is to be ended now, and if so the line and status: a
    process of the job `polyalign launch` saw fail (its notice) will never join, so the child would wait out
    the join timeout; a SIGTERM or Ctrl-C it has not acted on within JOIN_STOP_GRACE seconds is waiting in
    JAX's join. Nothing was trained before the join, so nothing is lost."""
    me = f"process {env['POLYALIGN_PROCESS_ID']}" if env.get("POLYALIGN_PROCESS_ID") else "this process"
    gone = launcher_notices(env.get(NOTICES_ENV))
    if gone:
        who = "; ".join(f"process {peer} {how}" for peer, how in sorted(gone.items()))
        return (f"polyalign: {me} stops: {who} before the job's processes had all joined (nothing was trained; "
                "its own lines say why)", PEER_LOST_EXIT)
    if asked and time.monotonic() - asked[0][1] > JOIN_STOP_GRACE:
        sig, how = ((signal.SIGTERM, "stopped by SIGTERM") if asked[0][0] != signal.SIGINT else
                    (signal.SIGINT, "interrupted"))
        return (f"polyalign {' '.join(argv[:2])}: {how} while waiting for the job's other processes to join",
                128 + sig)
    return None


def _read_state(path: str) -> dict:
    try:
        state = json.loads(Path(path).read_text() or "{}")
    except (OSError, ValueError):
        return {}
    return state if isinstance(state, dict) else {}


def lost_coordinator_line(state: dict, argv: Sequence[str]) -> str | None:
    """The lost-peer line for a child that JAX's client aborted, when that is what happened: the child had
    joined a job of several processes as one other than the coordinator, and the coordinator's address no
    longer answers. None for any other abort (its own log says what it was)."""
    process, processes, coordinator = state.get("process"), state.get("processes"), state.get("coordinator")
    if not (isinstance(process, int) and isinstance(processes, int) and process > 0 and processes > 1
            and isinstance(coordinator, str) and not answers(coordinator)):
        return None
    checkpoints = state.get("checkpoints")
    steps = committed_steps(checkpoints) if isinstance(checkpoints, str) else []
    cause = ("JAX's distributed client ended this process when the coordinator stopped answering at "
             f"{coordinator}: its log is above")
    return lost_peer_line(process, processes, [0], cause, steps, checkpoints, resume_command(argv))


def answers(address: str, timeout: float = 2.0) -> bool:
    """Whether something accepts a connection at host:port."""
    host, _, port = address.rpartition(":")
    try:
        with socket.create_connection((host.strip("[]"), int(port)), timeout=timeout):
            return True
    except (OSError, ValueError):
        return False


def resume_command(argv: Sequence[str]) -> str:
    """The command to run again: `polyalign launch`'s own line when it started the job, else this command."""
    launched = os.environ.get(LAUNCH_COMMAND_ENV)
    if launched:
        return f"running the same launch command: {launched}"
    return (f"running the same command on every process: {shlex.join(['polyalign', *argv])} (a host lost for good: "
            "on the processes left, their POLYALIGN_NUM_PROCESSES and ids set to them; a checkpoint resumes on any "
            "number)")


def lost_peer_line(process: int, processes: int, lost: Sequence[int], cause: str, steps: Sequence[int],
                   checkpoints: str | os.PathLike | None, rerun: str) -> str:
    """The one line a process prints when a peer is gone: who, the last committed checkpoint, and how to resume."""
    who = (f"process {', '.join(map(str, lost))}" if lost else "a peer process") + f" of {processes}"
    where = (f"the last committed checkpoint is step {steps[-1]} ({str(checkpoints).rstrip('/')}/{steps[-1]})"
             if steps and checkpoints is not None else "no checkpoint was committed yet (the run starts over)")
    first = cause.strip().splitlines()[0][:120] if cause.strip() else "no reason given"
    return f"polyalign: process {process} stops: {who} is gone ({first}); {where}; resume by {rerun}"
