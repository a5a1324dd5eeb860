"""The parent over each process of a multi-process training job (polyalign/mesh/supervisor.py): it names a
coordinator JAX's client aborted the process for, and is otherwise invisible (status, signals, its child
ending with it)."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import tempfile
import textwrap
import time
from pathlib import Path

import pytest

from polyalign.core.temporary import process_temporary
from polyalign.mesh import supervisor
from polyalign.mesh.launch import free_port

pytestmark = pytest.mark.skipif(sys.platform != "linux", reason="the parent runs on Linux only (prctl)")


def _children(pid: int) -> list[int]:
    return [int(p) for p in Path(f"/proc/{pid}/task/{pid}/children").read_text().split()]


def _wait_for(condition, seconds: float = 20.0) -> None:
    deadline = time.monotonic() + seconds
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError("timed out")
        time.sleep(0.05)


def test_a_process_jax_aborts_for_a_lost_coordinator_says_where_to_resume_and_exits_4(tmp_path, monkeypatch):
    """Two real processes joined by jax.distributed; process 0 (the coordinator) is SIGKILLed after
    checkpoint 3 was committed. JAX's client aborts process 1 at once (SIGABRT), before any Python code of
    its own can run; its parent says who is gone, the last committed checkpoint and the command that
    resumes, and ends with the lost-peer status instead of 134."""
    program = tmp_path / "joined.py"
    program.write_text(textwrap.dedent("""
        import os, signal, sys, time
        from pathlib import Path
        from polyalign.mesh import parallel
        from polyalign.mesh.supervisor import tell_parent
        parallel.initialize_distributed()
        import jax
        checkpoints = Path(sys.argv[1]) / f"process{jax.process_index()}"
        for step in ("3", "6.orbax-checkpoint-tmp-1"):  # 3 committed, 6 being written
            (checkpoints / step).mkdir(parents=True)
        tell_parent(checkpoints=str(checkpoints))
        if jax.process_index() == 0:
            time.sleep(1)
            os.kill(os.getpid(), signal.SIGKILL)
        time.sleep(60)
    """))
    port = free_port()
    for name, value in {"JAX_PLATFORMS": "cpu", "POLYALIGN_COORDINATOR": f"127.0.0.1:{port}",
                        "POLYALIGN_NUM_PROCESSES": "2", "PYTHONPATH": str(Path(__file__).parents[1])}.items():
        monkeypatch.setenv(name, value)
    monkeypatch.delenv(supervisor.STATE_ENV, raising=False)
    monkeypatch.delenv("POLYALIGN_LAUNCH_COMMAND", raising=False)
    coordinator = subprocess.Popen([sys.executable, str(program), str(tmp_path)],
                                   env={**os.environ, "POLYALIGN_PROCESS_ID": "0"})
    parent = ("import sys; from polyalign.mesh.supervisor import run_as_parent; "
              f"sys.exit(run_as_parent(['train', 'sft', '--out', 'run 1'], [sys.executable, {str(program)!r}, "
              f"{str(tmp_path)!r}]))")
    started = time.monotonic()
    done = subprocess.run([sys.executable, "-c", parent], env={**os.environ, "POLYALIGN_PROCESS_ID": "1"},
                          capture_output=True, text=True, timeout=60)
    assert coordinator.wait(timeout=30) == -signal.SIGKILL
    assert done.returncode == supervisor.PEER_LOST_EXIT, done.stderr[-3000:]
    assert time.monotonic() - started < 30  # at once, not after a peer or heartbeat timeout
    err = done.stderr
    assert "Terminating process because the JAX distributed service detected fatal errors" in err  # JAX's own log
    line = err.strip().splitlines()[-1]
    assert line == ("polyalign: process 1 stops: process 0 of 2 is gone (JAX's distributed client ended this "
                    f"process when the coordinator stopped answering at 127.0.0.1:{port}: its log is above); the last "
                    f"committed checkpoint is step 3 ({tmp_path}/process1/3); resume by running the same command on "
                    "every process: polyalign train sft --out 'run 1' (a host lost for good: on the processes left, "
                    "their POLYALIGN_NUM_PROCESSES and ids set to them; a checkpoint resumes on any number)")


@pytest.fixture
def listening():
    """An address that accepts connections (a coordinator still up)."""
    with socket.socket() as server:
        server.bind(("127.0.0.1", 0))
        server.listen()
        yield f"127.0.0.1:{server.getsockname()[1]}"


def test_only_an_abort_with_the_coordinator_gone_is_named(tmp_path, listening, monkeypatch):
    """The line is said only for a process other than 0 of a job of several whose coordinator no longer
    answers; any other abort keeps JAX's (or the program's) own words and status."""
    monkeypatch.delenv("POLYALIGN_LAUNCH_COMMAND", raising=False)
    gone = f"127.0.0.1:{free_port()}"
    state = {"process": 2, "processes": 3, "coordinator": gone}
    line = supervisor.lost_coordinator_line(state, ["train", "dpo"])
    assert line.startswith("polyalign: process 2 stops: process 0 of 3 is gone (") and \
        "no checkpoint was committed yet (the run starts over); resume by running the same command on every " \
        "process: polyalign train dpo (" in line
    assert supervisor.lost_coordinator_line({**state, "coordinator": listening}, ["train", "dpo"]) is None
    assert supervisor.lost_coordinator_line({**state, "process": 0}, ["train", "dpo"]) is None
    assert supervisor.lost_coordinator_line({**state, "processes": 1, "process": 0}, ["train", "dpo"]) is None
    assert supervisor.lost_coordinator_line({}, ["train", "dpo"]) is None  # aborted before it joined
    monkeypatch.setenv("POLYALIGN_LAUNCH_COMMAND", "polyalign launch --nproc 3 -- polyalign train dpo")
    assert supervisor.lost_coordinator_line(state, ["train", "dpo"]).endswith(
        "resume by running the same launch command: polyalign launch --nproc 3 -- polyalign train dpo")


@pytest.mark.parametrize("argv, env, expected", [
    (["train", "sft"], {"POLYALIGN_NUM_PROCESSES": "2"}, True),
    (["train", "hdpo", "--out", "x"], {"POLYALIGN_NUM_PROCESSES": " 16 "}, True),
    (["train", "sft"], {"POLYALIGN_NUM_PROCESSES": "1"}, False),
    (["train", "sft"], {}, False),
    (["train", "sft"], {"POLYALIGN_NUM_PROCESSES": "two"}, False),
    (["generate", "--checkpoint", "M"], {"POLYALIGN_NUM_PROCESSES": "2"}, False),  # refuses several processes
    (["launch", "--nproc", "2", "--", "polyalign", "train", "sft"], {"POLYALIGN_NUM_PROCESSES": "2"}, False),
    ([], {"POLYALIGN_NUM_PROCESSES": "2"}, False),
    (["train", "sft"], {"POLYALIGN_NUM_PROCESSES": "2", supervisor.STATE_ENV: "/tmp/x.json"}, False),  # the child
    (["train", "sft"], {"POLYALIGN_NUM_PROCESSES": "2", "POLYALIGN_NO_PARENT": "1"}, False),
])
def test_training_on_several_processes_and_nothing_else_runs_under_a_parent(argv, env, expected):
    assert supervisor.wanted(argv, env) is expected


def _start_waiting_to_join(tmp_path) -> subprocess.Popen:
    """`polyalign train sft` as process 1 of 2 whose coordinator never comes: it waits to join. Its temporary
    files go to tmp_path/tmp."""
    (tmp_path / "tmp").mkdir(exist_ok=True)
    env = {**os.environ, "JAX_PLATFORMS": "cpu", "POLYALIGN_COORDINATOR": f"127.0.0.1:{free_port()}",
           "POLYALIGN_NUM_PROCESSES": "2", "POLYALIGN_PROCESS_ID": "1", "POLYALIGN_JOIN_TIMEOUT": "120",
           "TMPDIR": str(tmp_path / "tmp")}
    env.pop(supervisor.STATE_ENV, None)
    return subprocess.Popen([sys.executable, "-m", "polyalign", "train", "sft", "--out", str(tmp_path / "out")],
                            env=env, cwd=tmp_path, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def _started_child(parent: subprocess.Popen) -> int:
    """The parent's child once it runs polyalign (its process group is set between fork and exec)."""
    def running() -> bool:
        children = _children(parent.pid)
        return bool(children) and Path(f"/proc/{children[0]}/cmdline").read_bytes().split(b"\0")[1:4] == [
            b"-P", b"-m", b"polyalign.cli"]
    _wait_for(running)
    return _children(parent.pid)[0]


def test_the_parent_ends_as_its_child_does_and_passes_signals_on(tmp_path):
    """Started by hand as one of two, `polyalign train` is a parent over a child in a process group of its own
    (a terminal's Ctrl-C reaches the child once, through the parent); a signal sent to the parent reaches the
    child, and the parent ends the way the child did."""
    parent = _start_waiting_to_join(tmp_path)
    child = _started_child(parent)
    assert os.getpgid(child) == child != os.getpgid(parent.pid)
    time.sleep(1)
    parent.send_signal(signal.SIGUSR1)  # the child has no handler for it: the default ends it
    parent.communicate(timeout=30)
    assert parent.returncode == -signal.SIGUSR1
    assert not Path(f"/proc/{child}").exists()


def test_a_child_never_outlives_a_parent_killed_outright(tmp_path, monkeypatch):
    """A parent SIGKILLed (a scheduler, `polyalign launch` after its grace) cannot pass anything on: the
    kernel ends its child with it, which would otherwise hold the accelerator; the state file it leaves is
    removed by the next process on this host."""
    parent = _start_waiting_to_join(tmp_path)
    child = _started_child(parent)
    parent.kill()
    parent.communicate(timeout=30)
    _wait_for(lambda: not Path(f"/proc/{child}").exists() or "Z" in Path(f"/proc/{child}/stat").read_text().split()[2])
    # nor could it remove its state file: the next process on this host does (every such job left one in /tmp)
    left = [p.name for p in (tmp_path / "tmp").iterdir()]
    assert left == [name for name in left if name.startswith(f"polyalign-parent-{parent.pid}@{socket.gethostname()}_")]
    assert len(left) == 1, left
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path / "tmp"))
    made = process_temporary("polyalign-parent-", suffix=".json")
    assert sorted(p.name for p in (tmp_path / "tmp").iterdir()) == [Path(made).name]


def test_a_process_temporary_of_an_ended_process_on_this_host_is_removed_and_no_other(tmp_path, monkeypatch):
    """process_temporary removes the files and folders its prefix names for a process of this host that has
    ended, and keeps a live process's, another host's (a shared /tmp), another prefix's and an older name's."""
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    ended = subprocess.Popen([sys.executable, "-c", "pass"])
    ended.wait()
    host = socket.gethostname()
    gone = [tmp_path / f"polyalign-launch-{ended.pid}@{host}_abc", tmp_path / f"polyalign-launch-{ended.pid}@{host}_x"]
    gone[0].mkdir()
    (gone[0] / "gone-1").write_text("ended with status 1")
    gone[1].write_text("")
    kept = [tmp_path / f"polyalign-launch-{os.getpid()}@{host}_live",
            tmp_path / f"polyalign-launch-{ended.pid}@{host}-2_x",  # another host's, whose name begins as this one's
            tmp_path / f"polyalign-parent-{ended.pid}@{host}_x.json",  # another prefix's
            tmp_path / "polyalign-launch-k3j2x_9"]  # named before names carried a host and a process
    for path in kept:
        path.write_text("")
    made = Path(process_temporary("polyalign-launch-", folder=True))
    assert made.is_dir() and made.name.startswith(f"polyalign-launch-{os.getpid()}@{host}_")
    assert not any(path.exists() for path in gone) and all(path.exists() for path in kept)


def test_a_child_status_is_the_parent_status(tmp_path):
    """A training command that fails the user's way (a missing config) ends the parent with the same status
    and the child's one line, said once."""
    env = {**os.environ, "POLYALIGN_NUM_PROCESSES": "2"}
    env.pop(supervisor.STATE_ENV, None)
    done = subprocess.run([sys.executable, "-m", "polyalign", "train", "sft", "--config", "missing.yaml", "--out", "o"],
                          env=env, cwd=tmp_path, capture_output=True, text=True, timeout=120)
    assert done.returncode == 2, done.stderr
    assert done.stderr.count("missing.yaml") == 1 and "Traceback" not in done.stderr


def test_a_second_sigterm_while_the_first_unwinds_is_the_same_stop():
    """A scheduler that signals every process of a job step reaches a training process directly and through
    its parent: the second SIGTERM must not raise again inside the first one's handling."""
    from polyalign.core.interrupts import Terminated, check_interrupted, interrupts_remembered

    raised = 0
    with interrupts_remembered():
        try:
            os.kill(os.getpid(), signal.SIGTERM)
            time.sleep(1)
        except Terminated:
            raised += 1
            os.kill(os.getpid(), signal.SIGTERM)  # arrives during the first one's handling
            time.sleep(0.2)
        with pytest.raises(Terminated):
            check_interrupted()  # still remembered
    assert raised == 1


def test_a_process_still_joining_stops_at_once_when_the_launcher_saw_a_peer_fail(tmp_path, capfd):
    """Process 0 fails before its coordinator starts (here: exit 2 at once); process 1 waits in JAX's join,
    where no signal handler runs, so the launcher's SIGTERM after its grace did nothing and its SIGKILL came
    20 s later. Process 1's parent reads the launcher's notice and ends it within a second, saying why."""
    from polyalign.mesh.launch import run_local

    script = ('if [ "$POLYALIGN_PROCESS_ID" = 0 ]; then echo "process 0: a problem of its own" >&2; exit 2; fi; '
              f'exec {sys.executable} -m polyalign train sft --out "{tmp_path}/out"')
    started = time.monotonic()
    assert run_local(["sh", "-c", script], nproc=2, cpu_devices=1) == 2
    assert time.monotonic() - started < 8
    err = capfd.readouterr().err
    assert "polyalign launch: process 0 exited with status 2; stopping the other 1" in err
    assert ("polyalign: process 1 stops: process 0 exited with status 2 before the job's processes had all joined "
            "(nothing was trained; its own lines say why)") in err


def test_a_sigterm_reaches_a_process_waiting_to_join(tmp_path):
    """SIGTERM (scancel, a scheduler's stop) to a process waiting for its peers: the join is C++ that the
    child's handler cannot interrupt, so the parent ends it after JOIN_STOP_GRACE, with the usual line and 143."""
    parent = _start_waiting_to_join(tmp_path)
    _started_child(parent)
    # into the join: the child says it waits (a fixed 3 s was not, on a loaded machine, where the child was still
    # importing and its own handler stopped it); the join timeout (120 s) ends the wait should the line not come
    said = []
    while not any("is waiting for the job's other processes to join" in line for line in said):
        line = parent.stderr.readline()
        assert line, said
        said.append(line)
    time.sleep(1)
    asked = time.monotonic()
    parent.send_signal(signal.SIGTERM)
    err = parent.communicate(timeout=30)[1]
    assert time.monotonic() - asked < supervisor.JOIN_STOP_GRACE + 3
    assert parent.returncode == 128 + signal.SIGTERM
    assert err.strip().splitlines()[-1] == ("polyalign train sft: stopped by SIGTERM while waiting for the job's other "
                                            "processes to join")


def test_a_worker_killed_outright_ends_its_parent_the_same_way(tmp_path):
    """The kernel's out-of-memory killer SIGKILLs the process doing the work: its parent ends by SIGKILL too
    (a shell's 137, `was killed by SIGKILL` to the launcher), not with a traceback and status 1."""
    parent = _start_waiting_to_join(tmp_path)
    os.kill(_started_child(parent), signal.SIGKILL)
    err = parent.communicate(timeout=30)[1]
    assert parent.returncode == -signal.SIGKILL and "Traceback" not in err, err


def test_a_launcher_killed_outright_stops_its_processes(tmp_path):
    """`polyalign launch` SIGKILLed (or out of memory) forwards nothing: each training process it started sees
    itself handed to another parent and stops as on a scheduler's SIGTERM, instead of training on with no one
    to read it. Here the launcher is a stand-in holding one process that waits to join (so its stop is the
    join-phase one: ended 2 s after the SIGTERM it cannot act on)."""
    env = {**os.environ, "JAX_PLATFORMS": "cpu", "POLYALIGN_COORDINATOR": f"127.0.0.1:{free_port()}",
           "POLYALIGN_NUM_PROCESSES": "2", "POLYALIGN_PROCESS_ID": "1", "POLYALIGN_LAUNCH_NOTICES": str(tmp_path)}
    env.pop(supervisor.STATE_ENV, None)
    stand_in = ("import subprocess, sys, time\n"
                "p = subprocess.Popen([sys.executable, '-m', 'polyalign', 'train', 'sft', '--out', "
                f"{str(tmp_path / 'out')!r}])\n"
                "print(p.pid, flush=True)\n"
                "time.sleep(120)\n")
    launcher = subprocess.Popen([sys.executable, "-c", stand_in], env=env, stdout=subprocess.PIPE, text=True)
    parent = int(launcher.stdout.readline())
    _wait_for(lambda: _children(parent) and Path(f"/proc/{_children(parent)[0]}/cmdline").read_bytes().split(
        b"\0")[1:4] == [b"-P", b"-m", b"polyalign.cli"])
    child = _children(parent)[0]
    launcher.kill()
    launcher.wait(timeout=30)
    _wait_for(lambda: not any(Path(f"/proc/{pid}").exists() and "Z" not in Path(f"/proc/{pid}/stat").read_text()
                              .split()[2] for pid in (parent, child)), seconds=supervisor.JOIN_STOP_GRACE + 8)


def test_sigterm_after_the_join_reaches_polyalign_not_jax(tmp_path):
    """JAX's preemption service took SIGTERM in C++ from the join on: a stop during compilation or restore was
    swallowed and the job trained on. With the service off, the process's own handler hears it."""
    program = tmp_path / "joined.py"
    program.write_text(textwrap.dedent("""
        import os, signal, time
        heard = []
        signal.signal(signal.SIGTERM, lambda signum, frame: heard.append(signum))
        from polyalign.mesh import parallel
        parallel.initialize_distributed()
        os.kill(os.getpid(), signal.SIGTERM)
        time.sleep(0.5)
        print("heard" if heard else "not heard", flush=True)
        import jax
        jax.distributed.shutdown()
    """))
    env = {**os.environ, "JAX_PLATFORMS": "cpu", "POLYALIGN_COORDINATOR": f"127.0.0.1:{free_port()}",
           "POLYALIGN_NUM_PROCESSES": "2", "PYTHONPATH": str(Path(__file__).parents[1])}
    processes = [subprocess.Popen([sys.executable, str(program)], env={**env, "POLYALIGN_PROCESS_ID": str(i)},
                                  stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True) for i in range(2)]
    assert [p.communicate(timeout=60)[0].strip() for p in processes] == ["heard", "heard"]


def test_a_closing_terminal_stops_training_after_a_checkpoint_as_sigterm_does():
    """SIGHUP (an ssh session or terminal that closes) ended a run at once, losing the steps since its last
    checkpoint: the training loop takes it as it takes SIGTERM and Ctrl-C."""
    from polyalign.train.trainer import _StopSignal

    with _StopSignal() as stop:
        os.kill(os.getpid(), signal.SIGHUP)
        time.sleep(0.2)
        assert stop.requested(mesh=None)
    assert signal.getsignal(signal.SIGHUP) is signal.SIG_DFL


def test_a_reader_gone_from_standard_output_is_no_traceback(tmp_path):
    """A launcher killed outright (or `| head`) leaves a command writing into a closed pipe: it ends with the
    shell's status for SIGPIPE and nothing on standard error, not a BrokenPipeError traceback."""
    process = subprocess.Popen([sys.executable, "-m", "polyalign", "train", "sft", "--print-config"], cwd=tmp_path,
                               stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    process.stdout.close()
    err = process.stderr.read()
    assert process.wait(timeout=60) == 128 + signal.SIGPIPE and "Traceback" not in err, err
