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


def test_setup_copies_the_checkout_and_installs_the_tpu_extra():
    lines = dry("setup.sh")
    assert lines[0].startswith(f"git -C {REPO} archive --format=tar.gz -o ") and lines[0].endswith(" HEAD")
    assert lines[1].startswith("gcloud compute tpus tpu-vm scp ") and "pa-demo:\\~/polyalign.tar.gz --worker=all" in lines[1]
    assert lines[2].startswith("gcloud compute tpus tpu-vm ssh pa-demo --worker=all --zone=us-west4-a --project=my-proj")
    assert "pip\\ install\\ -q\\ -e\\ ~/polyalign\\[tpu\\]" in lines[2]


def test_launch_runs_the_command_on_every_worker_with_a_log_each():
    lines = dry("launch.sh", "--workers", "4", "--", "polyalign", "train", "sft", "--config", "configs/sft_demo.yaml",
                "--out", "runs/sft", "data.dir=runs/demo")
    assert lines[0] == "mkdir -p logs/pa-demo"
    assert len(lines) == 5
    for i, line in enumerate(lines[1:]):
        assert line.startswith(f"gcloud compute tpus tpu-vm ssh pa-demo --worker={i} --zone=us-west4-a --project=my-proj "
                               "--command cd\\ ~/polyalign\\ \\&\\&\\ ~/venv/bin/polyalign\\ train\\ sft")
        assert line.endswith(f"> logs/pa-demo/worker-{i}.log 2>&1 &")
    # each argument arrives whole on the worker: split as the local shell, then as the remote one would
    awkward = dry("launch.sh", "--workers", "1", "--", "polyalign", "evaluate", "--out", "my runs/a;rm -rf ~")
    local = shlex.split(awkward[1].rsplit(" > ", 1)[0])
    remote = shlex.split(local[local.index("--command") + 1])
    assert remote == ["cd", "~/polyalign", "&&", "~/venv/bin/polyalign", "evaluate", "--out", "my runs/a;rm -rf ~"]
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
