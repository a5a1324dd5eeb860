"""`polyalign launch`: one process per accelerator, on one node or across SLURM nodes.

Every process gets POLYALIGN_COORDINATOR, POLYALIGN_NUM_PROCESSES and POLYALIGN_PROCESS_ID, which
`polyalign train ...` turns into jax.distributed.initialize. On one node the launcher starts the
processes itself (one GPU each through CUDA_VISIBLE_DEVICES, or CPU devices for tests); under SLURM
(`srun polyalign launch --slurm -- ...`) each task maps the SLURM variables and runs the command.
"""

from __future__ import annotations

import hashlib
import io
import os
import re
import shlex
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import NoReturn

from polyalign.core.errors import LaunchError
from polyalign.core.interrupts import TERMINATED
from polyalign.core.temporary import process_temporary

DEFAULT_PORT = 12355
# The launcher's folder of notices (gone-<process id>, holding how it ended) and its own command line, in
# every process's environment; polyalign/mesh/parallel.py's PeerMonitor and the lost-peer line read them.
NOTICES_ENV = "POLYALIGN_LAUNCH_NOTICES"
LAUNCH_COMMAND_ENV = "POLYALIGN_LAUNCH_COMMAND"
NOTICE_GRACE = 10.0  # seconds the others get to read a notice and stop by themselves


def expand_nodelist(nodelist: str) -> list[str]:
    """SLURM's compact host list ("gpu[01-03,07],login1") as host names."""
    hosts = []
    for match in re.finditer(r"([^,\[]+)(?:\[([^\]]+)\])?", nodelist):
        prefix, ranges = match.group(1), match.group(2)
        if not ranges:
            hosts.append(prefix)
            continue
        for part in ranges.split(","):
            start, _, end = part.partition("-")
            for number in range(int(start), int(end or start) + 1):
                hosts.append(f"{prefix}{number:0{len(start)}d}")
    return hosts


def slurm_environment(env: Mapping[str, str], port: int = DEFAULT_PORT) -> dict[str, str]:
    """POLYALIGN_* start variables (and the task's GPU) from a SLURM task's environment."""
    try:
        process_id, num_processes = int(env["SLURM_PROCID"]), int(env["SLURM_NTASKS"])
        nodelist = env.get("SLURM_JOB_NODELIST") or env["SLURM_NODELIST"]
    except (KeyError, ValueError):
        raise LaunchError("--slurm needs SLURM_PROCID, SLURM_NTASKS and SLURM_JOB_NODELIST "
                          "(run it under srun)") from None
    out = {"POLYALIGN_COORDINATOR": f"{expand_nodelist(nodelist)[0]}:{port}",
           "POLYALIGN_NUM_PROCESSES": str(num_processes), "POLYALIGN_PROCESS_ID": str(process_id)}
    if "SLURM_LOCALID" in env and "CUDA_VISIBLE_DEVICES" not in env:
        out["CUDA_VISIBLE_DEVICES"] = env["SLURM_LOCALID"]
    return out


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def port_in_use(port: int) -> bool:
    """Whether a server already listens on `port` on this host, where a job's coordinator would bind it on
    every interface: JAX's RPC server then fails to start, with a traceback or a segfault, and its peers
    wait out the join timeout. SO_REUSEADDR, as the coordinator's server sets it, so that a port a
    finished job left in TIME_WAIT is not taken for one in use."""
    with socket.socket() as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind(("0.0.0.0", port))
        except OSError:
            return True
    return False


def port_in_use_message(port: int, where: str) -> str:
    return (f"{where}: port {port} is in use on this host (another job's coordinator, or any server); give the job "
            "another port (`polyalign launch --port`, or the same POLYALIGN_COORDINATOR=host:PORT on every host)")


HOST_DEVICE_COUNT_FLAG = "--xla_force_host_platform_device_count"


def with_cpu_devices(xla_flags: str | None, devices: int) -> str:
    """XLA_FLAGS that split the CPU into `devices` XLA devices, keeping every other flag given (a user's
    own, or a test session's)."""
    kept = [flag for flag in (xla_flags or "").split() if not flag.startswith(HOST_DEVICE_COUNT_FLAG + "=")]
    return " ".join([*kept, f"{HOST_DEVICE_COUNT_FLAG}={devices}"])


def start_variables(port: int, nproc: int, index: int) -> dict[str, str]:
    """What process `index` of `nproc` on this node needs to join the others through 127.0.0.1:`port`."""
    return {"POLYALIGN_COORDINATOR": f"127.0.0.1:{port}", "POLYALIGN_NUM_PROCESSES": str(nproc),
            "POLYALIGN_PROCESS_ID": str(index)}


def local_environments(nproc: int, port: int, cpu_devices: int | None = None,
                       xla_flags: str | None = None) -> list[dict[str, str]]:
    """Per process: the start variables and either one GPU or `cpu_devices` CPU devices (added to
    `xla_flags`, the launcher's own XLA_FLAGS)."""
    envs = []
    for i in range(nproc):
        env = start_variables(port, nproc, i)
        if cpu_devices:
            env["JAX_PLATFORMS"] = "cpu"
            env["XLA_FLAGS"] = with_cpu_devices(xla_flags, cpu_devices)
        else:
            env["CUDA_VISIBLE_DEVICES"] = str(i)
        envs.append(env)
    return envs


def run_local(command: Sequence[str], nproc: int, port: int | None = None, cpu_devices: int | None = None) -> int:
    """Starts `nproc` copies of `command`, forwards SIGTERM/SIGINT to them, and stops the others when
    one fails (a lone survivor would wait on its peers forever). Returns the first failure's code."""
    if not command:
        raise LaunchError("nothing to launch: give the command after --")
    if nproc < 1:
        raise LaunchError(f"--nproc must be at least 1, got {nproc}")
    if cpu_devices is not None and cpu_devices < 1:
        raise LaunchError(f"--cpu-devices must be at least 1, got {cpu_devices}")
    require_program(command[0])
    if port and port_in_use(port):
        raise LaunchError(port_in_use_message(port, f"--port {port}"))
    port = port or free_port()
    # A survivor blocked in a collective with a dead peer cannot run a signal handler, but its peer
    # monitor (a thread) reads this folder every second: a notice there names the process that ended,
    # and the survivor says so with its checkpoint and the command to rerun, which is this launch.
    notices = process_temporary("polyalign-launch-", folder=True)
    shared = {NOTICES_ENV: notices, LAUNCH_COMMAND_ENV: shlex.join(["polyalign", *sys.argv[1:]])}
    # Standard output comes through the launcher a whole line at a time: native code writes a line in pieces
    # (gloo's "[Gloo] Rank 0 is connected to 1 peer ranks ..." from every process at once read as
    # "[Gloo] Rank [Gloo] Rank 10 is connected to  is connected to 11 peer ranks."); Python's own, unbuffered,
    # comes as it is printed. Standard error (progress bars, warnings) is the terminal's, as it was.
    shared["PYTHONUNBUFFERED"] = "1"
    processes = [subprocess.Popen(list(command), env={**os.environ, **shared, **env}, stdout=subprocess.PIPE)
                 for env in local_environments(nproc, port, cpu_devices, os.environ.get("XLA_FLAGS"))]
    relays = [_relay_lines(p.stdout) for p in processes]

    def forward(signum, frame):
        for p in processes:
            if p.poll() is None:
                p.send_signal(signum)

    previous = {sig: signal.signal(sig, forward) for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP)}
    try:
        # After a failure the others read its notice and stop by themselves; one that does not (not
        # training yet, or past hearing it) gets SIGTERM after a grace, then SIGKILL after another.
        code, deadlines, first = 0, [], None
        remaining = list(processes)
        while remaining:
            for p in list(remaining):
                try:
                    result = p.wait(timeout=0.5)
                except subprocess.TimeoutExpired:
                    continue
                remaining.remove(p)
                if result != 0:
                    Path(notices, f"gone-{processes.index(p)}").write_text(ended(result))
                if result == -signal.SIGABRT and first == 0:
                    # the peers cannot say it themselves: JAX's client aborts them when the coordinator is gone
                    print(f"polyalign launch: process {processes.index(p)} was aborted by JAX's distributed client, "
                          "as every process is when the coordinator (process 0) is lost (docs/tpu.md); the "
                          "committed checkpoints are intact, and this same command resumes from the last one",
                          file=sys.stderr, flush=True)
                if result != 0 and code == 0:
                    first = processes.index(p)
                    code = result if result > 0 else 128 - result  # a signal: the shell's 128 + N
                    print(f"polyalign launch: process {processes.index(p)} {ended(result)}; stopping the other "
                          f"{len(remaining)} (each says where it stopped; a line they print alike is shown once)",
                          file=sys.stderr, flush=True)
                    now = time.monotonic()
                    deadlines = [(now + NOTICE_GRACE, signal.SIGTERM), (now + 2 * NOTICE_GRACE, signal.SIGKILL)]
            if deadlines and remaining and time.monotonic() > deadlines[0][0]:
                _, sig = deadlines.pop(0)
                for other in remaining:
                    other.send_signal(sig)
        return code
    finally:
        until = time.monotonic() + 5  # what the processes wrote last; a grandchild holding a pipe is not waited on
        for relay in relays:
            relay.join(timeout=max(until - time.monotonic(), 0))
        for sig, handler in previous.items():
            signal.signal(sig, handler)
        shutil.rmtree(notices, ignore_errors=True)


_OUTPUT_LOCK = threading.Lock()
_LONGEST_HELD = 1 << 20  # a line longer than this (no end in sight) goes out in pieces rather than grow in memory


def _relay_lines(stream) -> threading.Thread:
    """A thread copying `stream` (a process's standard output) to this process's, whole lines at a time (a
    carriage return ends one too, so a line redrawn in place still moves); the rest at the end. A reader
    that went away (`| head`) costs the output, never the process: the pipe is still drained."""
    gone = False

    def write(data: bytes) -> None:
        nonlocal gone
        if gone:
            return
        with _OUTPUT_LOCK:
            try:
                sys.stdout.flush()
                fd = sys.stdout.fileno()
            except (AttributeError, OSError, ValueError, io.UnsupportedOperation):  # no file behind it (captured)
                sys.stdout.write(data.decode("utf-8", errors="replace"))
                sys.stdout.flush()
                return
            try:
                while data:
                    data = data[os.write(fd, data):]
            except OSError:  # a closed pipe (BrokenPipeError) or a full disk: stop writing, keep draining
                gone = True

    def copy() -> None:
        pending = b""
        with stream:
            while chunk := os.read(stream.fileno(), 65536):
                pending += chunk
                last = max(chunk.rfind(b"\n"), chunk.rfind(b"\r"))  # only the new bytes are searched
                end = len(pending) - len(chunk) + last + 1 if last >= 0 else (
                    len(pending) if len(pending) > _LONGEST_HELD else 0)
                if end:
                    write(pending[:end])
                    pending = pending[end:]
        if pending:
            write(pending)

    thread = threading.Thread(target=copy, name="polyalign-launch-output", daemon=True)
    thread.start()
    return thread


def launcher_notices(folder: str | None) -> dict[int, str]:
    """Processes `polyalign launch` saw end with a failure (its notices folder): id -> how it ended."""
    if not folder:
        return {}
    try:
        names = [name for name in os.listdir(folder) if name.startswith("gone-")]
        return {int(name[5:]): Path(folder, name).read_text() for name in names}
    except (OSError, ValueError):  # the launcher is gone too, or a notice is being written
        return {}


def said_by_another_process(line: str) -> bool:
    """Under `polyalign launch`, whether another process of the run has printed this very line: every
    process of a run meets the same bad input, and one line says it once. The first to print it leaves
    a mark in the launcher's notices folder (created exclusively, so two cannot both be first); other
    lines, and processes started without the launcher (SLURM, TPU scripts), print as they are."""
    folder = os.environ.get(NOTICES_ENV)
    if not folder:
        return False
    mark = Path(folder, f"said-{hashlib.sha256(line.encode()).hexdigest()[:20]}")
    try:
        os.close(os.open(mark, os.O_CREAT | os.O_EXCL | os.O_WRONLY))
    except FileExistsError:
        return True
    except OSError:  # the folder is gone (the launcher ended): say it
        return False
    return False


def ended(returncode: int) -> str:
    """How a process ended, in words: `exited with status 3`, `was killed by SIGKILL`."""
    if returncode == TERMINATED:  # polyalign's own exit on a SIGTERM it took (cli.main)
        return f"exited with status {returncode} (stopped by SIGTERM)"
    if returncode >= 0:
        return f"exited with status {returncode}"
    try:
        return f"was killed by {signal.Signals(-returncode).name}"
    except ValueError:
        return f"was killed by signal {-returncode}"


def run_slurm(command: Sequence[str], port: int = DEFAULT_PORT) -> NoReturn:
    """Becomes the command (exec) with the start variables of this SLURM task: SLURM's SIGTERM on
    preemption then reaches the training process itself, which checkpoints after its current step; a
    launcher waiting in between would be stopped by it first and take the command down with it."""
    if not command:
        raise LaunchError("nothing to launch: give the command after --")
    require_program(command[0])
    env = {**os.environ, **slurm_environment(os.environ, port)}
    sys.stdout.flush()
    sys.stderr.flush()
    os.execvpe(command[0], list(command), env)


def require_program(program: str) -> None:
    """The command's program must exist before any process starts: one line, not N tracebacks."""
    if shutil.which(program) is None:
        raise LaunchError(f"{program}: no such program (not a file, or not on PATH)")


def main_command(argv: Sequence[str]) -> list[str]:
    """The command after `--`; a leading `polyalign` runs this interpreter's polyalign. `-P`: the working
    folder is not put first on the module path, where `python -m` puts it, so a folder holding a clone
    named polyalign/ (git's default name) cannot stand in for the installed package."""
    command = list(argv)
    if command and command[0] == "polyalign":
        command = [sys.executable, "-P", "-m", "polyalign.cli", *command[1:]]
    return command


def refuse_several_processes(command: str) -> None:
    """`command` runs in one process, which uses every device of its host: started as one of several
    processes (`polyalign launch --nproc N`, tpu_scripts/launch.sh --workers N), each would write the
    same outputs, so it stops with one line saying how to run it once."""
    processes = os.environ.get("POLYALIGN_NUM_PROCESSES", "").strip()
    if processes.isdigit() and int(processes) > 1:
        raise LaunchError(f"{command} runs in one process, which uses every device of its host; it was started "
                          f"as one of {processes} (POLYALIGN_NUM_PROCESSES={processes}): run it once, on one "
                          "host (`polyalign launch --nproc 1`, tpu_scripts/launch.sh --workers 1)")
