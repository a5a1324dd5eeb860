"""The TPU scripts in dry-run mode: the exact gcloud commands they would run (no gcloud here)."""

import shlex
import subprocess

import pytest

from tests.conftest import REPO

SCRIPTS = REPO / "tpu_scripts"
WHERE = ["--name", "pa-demo", "--zone", "us-west4-a", "--project", "my-proj"]


def dry(script, *args):
    result = subprocess.run(["bash", str(SCRIPTS / script), *WHERE, "--dry-run", *args], capture_output=True,
                            text=True, timeout=30)
    assert result.returncode == 0, result.stderr
    return result.stdout.splitlines()


@pytest.mark.parametrize("script", ["create.sh", "setup.sh", "launch.sh", "status.sh", "logs.sh", "stop.sh",
                                    "delete.sh"])
def test_every_script_has_help_and_needs_a_name(script):
    result = subprocess.run(["bash", str(SCRIPTS / script), "--help"], capture_output=True, text=True)
    assert result.returncode == 0 and result.stdout.startswith(f"usage: {script}")
    assert "--dry-run" in result.stdout
    missing = subprocess.run(["bash", str(SCRIPTS / script), "--zone", "z", "--project", "p", "--dry-run"],
                             capture_output=True, text=True)
    assert missing.returncode == 2 and "--name is required" in missing.stderr


def test_create():
    assert dry("create.sh") == [
        "gcloud compute tpus queued-resources create pa-demo --node-id=pa-demo --zone=us-west4-a --project=my-proj "
        "--accelerator-type=v5litepod-16 --runtime-version=v2-alpha-tpuv5-lite --spot"]
    on_demand = dry("create.sh", "--on-demand", "--accelerator-type", "v5p-8", "--runtime-version", "v2-alpha-tpuv5")
    assert on_demand == ["gcloud compute tpus queued-resources create pa-demo --node-id=pa-demo --zone=us-west4-a "
                         "--project=my-proj --accelerator-type=v5p-8 --runtime-version=v2-alpha-tpuv5"]


def test_setup_copies_the_checkout_and_runs_the_worker_setup_everywhere():
    lines = dry("setup.sh")
    assert lines[0].startswith(f"git -C {REPO} archive --format=tar.gz -o ") and lines[0].endswith(" HEAD")
    assert (lines[1].startswith("gcloud compute tpus tpu-vm scp ")
            and "pa-demo:\\~/polyalign.tar.gz --worker=all" in lines[1])
    assert lines[2].startswith("gcloud compute tpus tpu-vm ssh pa-demo --worker=all --zone=us-west4-a "
                               "--project=my-proj")
    remote = shlex.split(shlex.split(lines[2])[-1])
    assert remote[-2:] == ["bash", "~/polyalign/tpu_scripts/worker_setup.sh"]
    worker = (SCRIPTS / "worker_setup.sh").read_text()
    assert 'pip" install -q -e "$CHECKOUT[tpu]"' in worker and '"$UV" python install' in worker


def _fake_python(tmp_path, version):
    fake = tmp_path / f"python{version}"
    fake.write_text(f"#!/bin/sh\necho {version}\n")
    fake.chmod(0o755)
    return fake


@pytest.mark.parametrize("version", ["3.10", "2.7"])
def test_worker_setup_refuses_a_python_below_3_11_in_one_line(tmp_path, version):
    import os

    result = subprocess.run(["bash", str(SCRIPTS / "worker_setup.sh"), "--venv", str(tmp_path / "venv")],
                            capture_output=True, text=True, timeout=30,
                            env={**os.environ, "POLYALIGN_PYTHON": str(_fake_python(tmp_path, version))})
    assert result.returncode == 2 and not result.stdout
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and f"is Python {version}; polyalign needs >= 3.11" in lines[0], result.stderr
    assert not (tmp_path / "venv").exists()  # checked before anything is installed


def test_worker_setup_accepts_this_python_and_checks_only(tmp_path):
    import os
    import sys

    result = subprocess.run(["bash", str(SCRIPTS / "worker_setup.sh"), "--check-only"], capture_output=True, text=True,
                            timeout=30, env={**os.environ, "POLYALIGN_PYTHON": sys.executable})
    assert result.returncode == 0, result.stderr
    assert f"Python {sys.version_info.major}.{sys.version_info.minor} ({sys.executable})" in result.stdout


def test_launch_runs_the_command_on_every_worker_with_a_log_each():
    lines = dry("launch.sh", "--workers", "4", "--", "polyalign", "train", "sft", "--config", "configs/sft_demo.yaml",
                "--out", "runs/sft", "data.dir=runs/demo")
    assert lines[0] == "mkdir -p logs/pa-demo"
    assert len(lines) == 5
    for i, line in enumerate(lines[1:]):
        assert line.startswith(f"gcloud compute tpus tpu-vm ssh pa-demo --worker={i} --zone=us-west4-a "
                               "--project=my-proj --command cd\\ ~/polyalign\\ \\&\\&\\ POLYALIGN_NUM_PROCESSES=4\\ "
                               "~/venv/bin/polyalign\\ train\\ sft")
        assert line.endswith(f"> logs/pa-demo/worker-{i}.log 2>&1 &")
    # each argument arrives whole on the worker: split as the local shell, then as the remote one would
    awkward = dry("launch.sh", "--workers", "1", "--", "polyalign", "evaluate", "--out", "my runs/a;rm -rf ~")
    local = shlex.split(awkward[1].rsplit(" > ", 1)[0])
    remote = shlex.split(local[local.index("--command") + 1])
    assert remote == ["cd", "~/polyalign", "&&", "POLYALIGN_NUM_PROCESSES=1", "~/venv/bin/polyalign", "evaluate",
                      "--out", "my runs/a;rm -rf ~"]
    result = subprocess.run(["bash", str(SCRIPTS / "launch.sh"), *WHERE, "--dry-run", "--", "polyalign"],
                            capture_output=True, text=True)
    assert result.returncode == 2 and "--workers is required" in result.stderr


def test_status_logs_stop_delete():
    assert dry("status.sh") == [
        "gcloud compute tpus queued-resources describe pa-demo --zone=us-west4-a --project=my-proj "
        "--format=value\\(state.state\\)",
        "gcloud compute tpus tpu-vm describe pa-demo --zone=us-west4-a --project=my-proj "
        "--format=value\\(state\\,health\\)"]
    assert dry("logs.sh", "--lines", "5", "--follow") == ["tail -n 5 -f logs/pa-demo/worker-*.log"]
    assert dry("stop.sh")[0].startswith("gcloud compute tpus tpu-vm ssh pa-demo --worker=all")
    assert "pkill\\ -TERM" in dry("stop.sh")[0]
    assert dry("delete.sh") == ["gcloud compute tpus queued-resources delete pa-demo --zone=us-west4-a "
                                "--project=my-proj --force --quiet"]
