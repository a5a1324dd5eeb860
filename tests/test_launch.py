"""The launcher: SLURM variables to the POLYALIGN_* start variables, a 4-process CPU training run, cluster
detection and the peer monitor."""

import os
import re
from pathlib import Path

import pytest

from polyalign.mesh.launch import LaunchError, expand_nodelist, local_environments, slurm_environment
from polyalign.train.metrics import read_metrics
from tests.cli_runs import ADAPTIVE_FOUR_DEVICES, start_cli, train_args, wait_ok


def test_nodelists_expand():
    assert expand_nodelist("gpu[01-03,07],login1") == ["gpu01", "gpu02", "gpu03", "gpu07", "login1"]
    assert expand_nodelist("node7") == ["node7"]
    assert expand_nodelist("a[8-10]") == ["a8", "a9", "a10"]


def test_slurm_variables_map_to_the_start_variables():
    env = {"SLURM_PROCID": "5", "SLURM_NTASKS": "16", "SLURM_JOB_NODELIST": "gpu[12-13]", "SLURM_LOCALID": "5"}
    assert slurm_environment(env, port=23456) == {
        "POLYALIGN_COORDINATOR": "gpu12:23456", "POLYALIGN_NUM_PROCESSES": "16", "POLYALIGN_PROCESS_ID": "5",
        "CUDA_VISIBLE_DEVICES": "5"}
    with pytest.raises(LaunchError, match="run it under srun"):
        slurm_environment({"SLURM_PROCID": "0"})


def test_local_environments():
    envs = local_environments(2, 4000)
    assert [e["POLYALIGN_PROCESS_ID"] for e in envs] == ["0", "1"]
    assert [e["CUDA_VISIBLE_DEVICES"] for e in envs] == ["0", "1"]
    cpu = local_environments(2, 4000, cpu_devices=3)[1]
    assert cpu["XLA_FLAGS"] == "--xla_force_host_platform_device_count=3" and "CUDA_VISIBLE_DEVICES" not in cpu
    # the launcher's own XLA flags are kept; only the device count is set
    user = local_environments(1, 4000, cpu_devices=2, xla_flags="--xla_force_host_platform_device_count=8 "
                                                                 "--xla_dump_to=/tmp/d")[0]
    assert user["XLA_FLAGS"] == "--xla_dump_to=/tmp/d --xla_force_host_platform_device_count=2"


@pytest.mark.slow
def test_launcher_runs_four_cpu_processes_like_one_with_four_devices(built_run, adaptive_four_device_run, tmp_path):
    """Four processes of one device each with adaptive bucket weights (agreed over every process each
    step) and validation on 37 examples in batches of 12 (3 per process, the last batch partial) train
    and validate as one process with four devices."""
    run, _ = built_run
    launched = start_cli(["launch", "--nproc", "4", "--cpu-devices", "1", "--", "polyalign",
                          *train_args(run, tmp_path / "four", *ADAPTIVE_FOUR_DEVICES)], {}, devices=1)
    wait_ok([launched])
    one, four = read_metrics(adaptive_four_device_run), read_metrics(tmp_path / "four")
    assert [r["step"] for r in four] == list(range(1, 7))
    for a, b in zip(one, four):
        assert abs(a["loss"] - b["loss"]) <= 1e-5, (a["step"], a["loss"], b["loss"])
        assert b["adaptive_weights"] == pytest.approx(a["adaptive_weights"], rel=1e-5), a["step"]
    assert four[-1]["adaptive_weights"] != four[0]["adaptive_weights"]  # they moved
    assert abs(one[-1]["val_loss"] - four[-1]["val_loss"]) <= 1e-5
    assert one[-1]["val_by_bucket"].keys() == four[-1]["val_by_bucket"].keys()


@pytest.mark.slow
def test_a_launched_process_that_dies_makes_its_peer_say_where_to_resume_at_once(built_run, tmp_path):
    """One of two launched processes SIGKILLed after checkpoint 3: the survivor, blocked in a collective
    with the dead one, hears it from the launcher's notice within seconds (not the 30 s peer timeout)
    and says who is gone, the last committed checkpoint and the launch command that resumes."""
    import signal
    import time

    from tests.cli_runs import checkpoint_begun

    run, _ = built_run
    out = tmp_path / "lost"
    launched = start_cli(["launch", "--nproc", "2", "--cpu-devices", "1", "--", "polyalign",
                          *train_args(run, out, "train.steps=40", "train.checkpoint_every=3")], {}, devices=1)
    deadline = time.monotonic() + 240
    while time.monotonic() < deadline and not checkpoint_begun(out, 6):  # checkpoint 3 is committed by then
        time.sleep(0.1)
    launcher = int(Path(f"/proc/{launched.pid}/task/{launched.pid}/children").read_text().split()[0])
    workers = Path(f"/proc/{launcher}/task/{launcher}/children").read_text().split()
    os.kill(int(workers[1]), signal.SIGKILL)
    killed = time.monotonic()
    output = launched.communicate(timeout=120)[0]
    assert launched.returncode == 128 + signal.SIGKILL, output[-3000:]
    assert time.monotonic() - killed < 15, output[-3000:]  # the peer timeout would be 30 s
    assert "polyalign launch: process 1 was killed by SIGKILL; stopping the other 1" in output
    line = next(line for line in output.splitlines() if line.startswith("polyalign: process 0 stops:"))
    assert line.startswith("polyalign: process 0 stops: process 1 of 2 is gone (the launcher saw it end: was killed "
                           "by SIGKILL); the last committed checkpoint is step "), line
    assert "resume by running the same launch command: polyalign launch --nproc 2 --cpu-devices 1 -- polyalign " \
           "train sft" in line


@pytest.fixture
def fresh_start(monkeypatch):
    """initialize_distributed as on a new process, with jax.distributed.initialize recorded, not run,
    and no start variable of the machine running the tests."""
    import jax

    from polyalign.mesh import parallel

    calls = []
    monkeypatch.setattr(parallel, "_distributed_started", False)
    monkeypatch.setattr(jax.distributed, "initialize", lambda **kwargs: calls.append(kwargs))
    for name in ("POLYALIGN_COORDINATOR", "POLYALIGN_NUM_PROCESSES", "POLYALIGN_PROCESS_ID", "POLYALIGN_NUM_DEVICES",
                 "TPU_WORKER_HOSTNAMES", "TPU_PROCESS_ADDRESSES", "TPU_SKIP_MDS_QUERY", "MEGASCALE_NUM_SLICES",
                 "SLURM_JOB_ID", "OMPI_MCA_orte_hnp_uri"):
        monkeypatch.delenv(name, raising=False)
    return calls


def _tpu_vm(monkeypatch, metadata):
    from jax._src.clusters import cloud_tpu_cluster

    monkeypatch.setattr(cloud_tpu_cluster, "running_in_cloud_tpu_vm", True)
    monkeypatch.setattr(cloud_tpu_cluster, "get_metadata",
                        lambda key: (metadata[key], 200) if key in metadata else ("", 404))


def test_a_gce_tpu_vm_of_several_workers_starts_jax_distributed(fresh_start, monkeypatch):
    """The metadata server says worker 2 of 4 (tpu_scripts' `tpu-vm ssh --worker=all` path): no TPU_*
    variable is set, and JAX's own detection still starts the job; a job that did not gather the
    slice's processes stops with one line."""
    from polyalign.core.errors import ParallelError
    from polyalign.mesh import parallel

    _tpu_vm(monkeypatch, {"agent-worker-number": "2", "worker-network-endpoints": "w0,w1,w2,w3", "tpu-env": ""})
    assert parallel._detected_cluster().name == "gcetpu"
    parallel.initialize_distributed()
    # no address, count or id: JAX reads them from the metadata server itself; the join watch keeps JAX's
    # own 300 s for a cluster it detects, JAX's timeout a minute later as a backstop
    assert fresh_start == [{"heartbeat_timeout_seconds": 300, "initialization_timeout": 360}]
    monkeypatch.setattr(parallel, "_distributed_started", False)
    monkeypatch.setenv("POLYALIGN_NUM_PROCESSES", "4")  # launch.sh's worker count; this test has 1 process
    with pytest.raises(ParallelError, match=r"this job has 1 process\(es\) but 4 were expected"):
        parallel.initialize_distributed()


def test_a_gke_tpu_job_starts_jax_distributed_and_one_host_alone_does_not(fresh_start, monkeypatch):
    from polyalign.core.errors import ParallelError
    from polyalign.mesh import parallel

    _tpu_vm(monkeypatch, {"tpu-env": ""})
    monkeypatch.setenv("TPU_SKIP_MDS_QUERY", "1")
    monkeypatch.setenv("TPU_WORKER_HOSTNAMES", "h0,h1")
    monkeypatch.setenv("TPU_WORKER_ID", "1")
    assert parallel._detected_cluster().name == "gketpu"
    parallel.initialize_distributed()
    assert len(fresh_start) == 1
    # a single-host slice: detected, but one process, so nothing to start
    monkeypatch.setattr(parallel, "_distributed_started", False)
    monkeypatch.setenv("TPU_WORKER_HOSTNAMES", "h0")
    parallel.initialize_distributed()
    assert len(fresh_start) == 1
    monkeypatch.setattr(parallel, "_distributed_started", False)
    monkeypatch.setenv("POLYALIGN_NUM_DEVICES", "8")
    with pytest.raises(ParallelError, match="sees 1 devices over 1 process"):
        parallel.initialize_distributed()


class _Store:
    """The coordination service's key-value store as the peer monitor uses it, counting requests; process 2
    of 3 beats for the first few requests only, then falls silent."""

    def __init__(self, silent_after: int):
        self.values, self.requests, self.silent_after = {}, [], silent_after

    def key_value_set(self, key, value, allow_overwrite=False):
        self.requests.append("set")
        self.values[key] = value
        if len(self.requests) <= self.silent_after:  # the peers beat too, until process 2 stops
            self.values["polyalign/beat/1"] = self.values["polyalign/beat/2"] = value
        else:
            self.values["polyalign/beat/1"] = value

    def key_value_dir_get(self, directory):
        self.requests.append("read all")
        return [(k, v) for k, v in self.values.items() if k.startswith(directory)]


def test_the_peer_monitor_asks_once_per_beat_and_names_the_silent_peer(monkeypatch):
    """Two requests a beat however many peers (one write, one read of every beat), and a peer whose beat
    stops is named once its silence passes the timeout."""
    import threading

    from polyalign.mesh import parallel

    store, reported = _Store(silent_after=6), []
    done = threading.Event()
    monkeypatch.setattr(parallel, "report_peer_lost", lambda lost, cause: (reported.append((lost, cause)), done.set()))
    monitor = parallel.PeerMonitor(timeout=0.25, interval=0.02)
    monitor.client, monitor.me, monitor.count = store, 0, 3
    with monitor:
        assert done.wait(10)
    requests = list(store.requests)
    assert len(requests) >= 10 and all(r == ("set" if i % 2 == 0 else "read all") for i, r in enumerate(requests))
    assert reported[0] == ([2], "no sign of life for 0.25 s")


def test_a_lost_coordinator_is_named_where_jax_aborts_the_others(capfd):
    """Process 0 dies (SIGKILL) and JAX's distributed client aborts process 1 (SIGABRT, its own C++ log,
    no word of polyalign's: jaxlib takes no Python callback for it): the launcher says what the abort is and
    that the same command resumes."""
    import sys

    from polyalign.mesh.launch import run_local

    program = ("import os, signal, time\n"
               "if os.environ['POLYALIGN_PROCESS_ID'] == '0':\n"
               "    time.sleep(0.5); os.kill(os.getpid(), signal.SIGKILL)\n"
               "time.sleep(1.5); os.kill(os.getpid(), signal.SIGABRT)\n")
    assert run_local([sys.executable, "-c", program], nproc=2, cpu_devices=1) == 137
    err = capfd.readouterr().err
    assert "polyalign launch: process 0 was killed by SIGKILL; stopping the other 1" in err
    assert ("polyalign launch: process 1 was aborted by JAX's distributed client, as every process is when the "
            "coordinator (process 0) is lost (docs/tpu.md); the committed checkpoints are intact, and this same "
            "command resumes from the last one") in err


def test_a_process_killed_under_the_launcher_is_named_and_the_others_are_stopped(capfd):
    """Process 1 of 3 dies by SIGKILL (a crashed host): the launcher says which and how, stops the two
    others at once instead of leaving them to wait, and exits 137 as a shell would."""
    import sys
    import time

    from polyalign.mesh.launch import run_local

    program = ("import os, signal, time\n"
               "if os.environ['POLYALIGN_PROCESS_ID'] == '1':\n"
               "    time.sleep(0.5); os.kill(os.getpid(), signal.SIGKILL)\n"
               "time.sleep(60)\n")
    started = time.monotonic()
    assert run_local([sys.executable, "-c", program], nproc=3, cpu_devices=1) == 137
    assert time.monotonic() - started < 20
    assert "polyalign launch: process 1 was killed by SIGKILL; stopping the other 2" in capfd.readouterr().err


def _required_arguments(parser) -> list[str]:
    """The least a command's parser takes: each required option and positional with a made-up value."""
    import argparse

    argv = []
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction) or not (action.required or not action.option_strings):
            continue
        if action.nargs in ("*", "?", argparse.REMAINDER):
            continue
        value = str(next(iter(action.choices))) if action.choices else "1"  # a count, a path, a name
        argv += [*action.option_strings[:1], value]
    return argv


def _commands():
    from polyalign.cli import build_parser, subcommands

    return [(path, sub) for path, sub in subcommands(build_parser())
            if not any(isinstance(a, __import__("argparse")._SubParsersAction) for a in sub._actions)]


def test_the_commands_that_load_a_model_once_refuse_to_run_as_one_of_several(tmp_path, monkeypatch, capsys):
    """Launched on several processes, a command that loads the model onto every device of its host and answers
    once would load it again in each and write the same outputs (or bind the same port): one line says to
    run it once, before anything is read or written. `pairs accuracy` under `launch --nproc 2` ran twice and
    failed on its own output lock. The data commands run on every TPU worker's own disk (docs/tpu.md)."""
    from polyalign.cli import RUN_ONCE, main

    monkeypatch.chdir(tmp_path)
    commands = dict(_commands())
    assert set(RUN_ONCE) == {"generate", "serve", "pairs accuracy"} and set(RUN_ONCE) <= set(commands)
    for path in RUN_ONCE:
        argv = [*path.split(), *_required_arguments(commands[path])]
        monkeypatch.setenv("POLYALIGN_NUM_PROCESSES", "2")
        assert main(argv) == 2, argv
        err = capsys.readouterr().err
        assert f"polyalign {path} runs in one process" in err and "POLYALIGN_NUM_PROCESSES=2" in err, (argv, err)
        assert "--nproc 1" in err and "Traceback" not in err
        assert list(tmp_path.iterdir()) == [], argv  # stopped before it read or wrote anything
        monkeypatch.setenv("POLYALIGN_NUM_PROCESSES", "1")  # one process of one: it goes on to the missing files
        assert main(argv) == 2 and "runs in one process" not in capsys.readouterr().err
        assert list(tmp_path.iterdir()) == []  # a command stopped by a missing input leaves nothing behind
    # the data stages, run on each worker's own disk as docs/tpu.md does, are not refused
    monkeypatch.setenv("POLYALIGN_NUM_PROCESSES", "4")
    assert main(["demo", "--out", str(tmp_path / "demo"), "--stages", "bogus"]) == 2
    assert "unknown demo stage 'bogus'" in capsys.readouterr().err


def test_a_launched_polyalign_is_the_installed_one_whatever_folder_it_starts_in(tmp_path, monkeypatch, capfd):
    """Started from a folder holding a clone named polyalign/ (git's default), `python -m polyalign.cli`
    imported that folder as a namespace package (no __version__: every child died). The launcher's
    children run the package this interpreter has installed."""
    import polyalign
    from polyalign.mesh.launch import main_command, run_local

    (tmp_path / "polyalign" / "polyalign").mkdir(parents=True)  # a clone: the package one level down
    monkeypatch.chdir(tmp_path)
    assert run_local(main_command(["polyalign", "--version"]), nproc=2, cpu_devices=1) == 0
    out = capfd.readouterr().out
    assert out.count(polyalign.__version__) == 2, out


def test_an_error_every_launched_process_meets_is_printed_once(tmp_path, monkeypatch, capfd):
    """Each of two launched processes refuses the same way; the user reads the line once, and a line only
    one process prints still comes through."""
    import sys

    from polyalign.mesh.launch import main_command, run_local

    monkeypatch.chdir(tmp_path)
    command = ["polyalign", "generate", "--checkpoint", "M", "--records", "R.jsonl", "--out", "P.jsonl"]
    assert run_local(main_command(command), nproc=2, cpu_devices=1) == 2
    err = capfd.readouterr().err
    assert err.count("polyalign generate: error: polyalign generate runs in one process") == 1, err
    program = ("import os\nfrom polyalign.cli import _say\n"
               "_say('the same line')\n_say('process ' + os.environ['POLYALIGN_PROCESS_ID'])\n")
    assert run_local([sys.executable, "-c", program], nproc=3, cpu_devices=1) == 0
    err = capfd.readouterr().err
    assert err.count("the same line") == 1 and all(err.count(f"process {i}") == 1 for i in range(3)), err


def test_a_slurm_task_becomes_its_command_so_preemption_reaches_the_training_process(tmp_path):
    """Under SLURM the launcher waited on the command in a child; SLURM's SIGTERM on preemption stopped
    the launcher first, which killed the command before it could checkpoint. The task now becomes the
    command: same process, SLURM's start variables mapped, SIGTERM going to the command alone."""
    import os
    import signal
    import subprocess
    import sys
    import time

    ready, saved = tmp_path / "ready", tmp_path / "saved"
    program = ("import os, signal, sys, time\n"
               "def stop(*_):\n"
               "    time.sleep(1.0)  # a checkpoint being written\n"
               f"    open({str(saved)!r}, 'w').write(os.environ['POLYALIGN_PROCESS_ID'] + ' ' + str(os.getpid()))\n"
               "    sys.exit(0)\n"
               "signal.signal(signal.SIGTERM, stop)\n"
               f"open({str(ready)!r}, 'w').write('')\n"
               "time.sleep(60)\n")
    env = {**os.environ, "SLURM_PROCID": "1", "SLURM_NTASKS": "2", "SLURM_JOB_NODELIST": "node[07-08]"}
    task = subprocess.Popen([sys.executable, "-P", "-m", "polyalign.cli", "launch", "--slurm", "--", sys.executable,
                             "-c", program], env=env)
    deadline = time.monotonic() + 60
    while not ready.exists() and time.monotonic() < deadline:
        time.sleep(0.05)
    task.send_signal(signal.SIGTERM)  # as SLURM preempts: to the task's process
    assert task.wait(timeout=30) == 0
    assert saved.read_text() == f"1 {task.pid}"


def test_how_a_process_ended_is_said_in_words():
    from polyalign.mesh.launch import ended

    assert ended(2) == "exited with status 2"
    assert ended(143) == "exited with status 143 (stopped by SIGTERM)"  # polyalign's own exit on SIGTERM
    assert ended(-9) == "was killed by SIGKILL"


@pytest.mark.parametrize("process_id", [0, 1])  # the coordinator's host, and a host that cannot reach it
def test_a_process_whose_peers_never_join_says_what_it_waits_for_and_ends_with_one_line(process_id, tmp_path):
    """One host of two started: it says what it waits for, then ends at POLYALIGN_JOIN_TIMEOUT with one
    line (exit 2), before JAX's own timeout aborts it in C++ with a stack trace."""
    import subprocess
    import sys
    import time

    from polyalign.mesh.launch import free_port

    address = f"127.0.0.1:{free_port()}"
    env = {**os.environ, "POLYALIGN_COORDINATOR": address, "POLYALIGN_NUM_PROCESSES": "2",
           "POLYALIGN_PROCESS_ID": str(process_id), "POLYALIGN_JOIN_TIMEOUT": "6", "JAX_PLATFORMS": "cpu"}
    began = time.monotonic()
    done = subprocess.run([sys.executable, "-c", "from polyalign.mesh.parallel import initialize_distributed; "
                           "initialize_distributed(); print('joined')"], env=env, capture_output=True, text=True,
                          timeout=120, cwd=tmp_path)
    assert done.returncode == 2 and "joined" not in done.stdout, done.stderr[-2000:]
    assert time.monotonic() - began < 60
    ours = [line for line in done.stderr.splitlines() if line.startswith("polyalign:")]
    start = ("start the same command on every host, each with its own POLYALIGN_PROCESS_ID (0 to 1), the same "
             "POLYALIGN_COORDINATOR and POLYALIGN_NUM_PROCESSES")
    assert ours == [
        f"polyalign: process {process_id} of 2 is waiting for the job's other processes to join at {address} "
        f"(up to 6 s, POLYALIGN_JOIN_TIMEOUT): {start}",
        f"polyalign: error: process {process_id} of 2: the job's processes did not all join at {address} within "
        f"6 s; {start} (a firewall between the hosts, a coordinator address the others cannot reach, a coordinator "
        "that could not start, e.g. its port in use, and two processes given one POLYALIGN_PROCESS_ID look the "
        "same)"], done.stderr[-2000:]
    assert "Check failure" not in done.stderr


def test_a_coordinator_port_in_use_is_one_line_before_any_join(fresh_start, monkeypatch):
    """A stale job's server on the coordinator's port: process 0 and the launcher say so in one line (JAX's
    RPC server failed with a traceback, or a segfault, while the other process waited out the join)."""
    import socket

    from polyalign.core.errors import LaunchError, ParallelError
    from polyalign.mesh import parallel
    from polyalign.mesh.launch import run_local

    with socket.socket() as held:
        held.bind(("127.0.0.1", 0))
        held.listen()
        port = held.getsockname()[1]
        monkeypatch.setenv("POLYALIGN_COORDINATOR", f"127.0.0.1:{port}")
        monkeypatch.setenv("POLYALIGN_NUM_PROCESSES", "2")
        monkeypatch.setenv("POLYALIGN_PROCESS_ID", "0")
        with pytest.raises(ParallelError, match=re.escape(
                f"POLYALIGN_COORDINATOR=127.0.0.1:{port}: port {port} is in use on this host (another job's "
                "coordinator, or any server); give the job another port")):
            parallel.initialize_distributed()
        with pytest.raises(LaunchError, match=re.escape(f"--port {port}: port {port} is in use on this host")):
            run_local(["true"], 2, port=port)
    assert not parallel.port_in_use(port)  # closed: free again


@pytest.mark.parametrize("processes, process_id", [("2", "2"), ("2", "-1"), ("4", "7"), ("0", "0")])
def test_a_process_id_outside_the_job_is_refused_before_any_join(fresh_start, monkeypatch, processes, process_id):
    """An id the job cannot hold (a host given the count, or a copied line) stops with one line naming
    both variables; nothing waits for a peer that can never come."""
    from polyalign.core.errors import ParallelError
    from polyalign.mesh import parallel

    monkeypatch.setenv("POLYALIGN_COORDINATOR", "127.0.0.1:1")
    monkeypatch.setenv("POLYALIGN_NUM_PROCESSES", processes)
    monkeypatch.setenv("POLYALIGN_PROCESS_ID", process_id)
    expected = (f"POLYALIGN_PROCESS_ID={process_id} with POLYALIGN_NUM_PROCESSES={processes}: each process's id "
                f"is one of 0 to {int(processes) - 1}, different on every host" if processes != "0"
                else "POLYALIGN_NUM_PROCESSES=0 must be at least 1")
    with pytest.raises(ParallelError) as raised:
        parallel.initialize_distributed()
    assert str(raised.value) == expected
    assert fresh_start == []


def test_a_join_timeout_below_one_second_is_refused(monkeypatch):
    from polyalign.core.errors import ParallelError
    from polyalign.mesh import parallel

    for value in ("0", "-5"):
        monkeypatch.setenv("POLYALIGN_JOIN_TIMEOUT", value)
        with pytest.raises(ParallelError, match=rf"POLYALIGN_JOIN_TIMEOUT={value} must be at least 1 \(seconds\)"):
            parallel._initialize(parallel.JOIN_TIMEOUT, coordinator_address="127.0.0.1:1", num_processes=2,
                                 process_id=0)


def test_lines_written_in_pieces_by_launched_processes_come_out_whole(capfd):
    """Native code writes a line in pieces (gloo's connection line, from every process at the same moment):
    through the launcher each process's line comes out whole, never another's words inside it."""
    import sys

    from polyalign.mesh.launch import run_local

    program = ("import os, time\n"
               "rank = os.environ['POLYALIGN_PROCESS_ID']\n"
               "for piece in ('[Gloo] Rank ', rank, ' is connected to ', '1', ' peer ranks.\\n'):\n"
               "    os.write(1, piece.encode()); time.sleep(0.2)\n"
               "print('done', rank)\n")
    assert run_local([sys.executable, "-c", program], nproc=2, cpu_devices=1) == 0
    lines = capfd.readouterr().out.splitlines()
    gloo = [f"[Gloo] Rank {rank} is connected to 1 peer ranks." for rank in (0, 1)]
    assert sorted(lines) == [*gloo, "done 0", "done 1"], lines
