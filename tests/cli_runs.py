"""Training runs for tests: the CLI in subprocesses (one process of K CPU devices, or two processes
joined by jax.distributed on 127.0.0.1) and in-process SFT configs, all on the tests' tiny model
(tests/fixtures/tiny_model.yaml) and the session's demo build. Not a test module."""

import subprocess
import sys

from polyalign.mesh.launch import free_port, start_variables
from polyalign.train.methods import load_config
from tests.conftest import REPO, TINY_MODEL, cpu_devices_env

SFT_CONFIG = REPO / "configs" / "sft_demo.yaml"
# A few steps of 8 sequences, validation on 32 examples after step 6, a checkpoint every 3 steps.
TINY_RUN = ("train.global_batch=8", "train.eval_every=6", "train.checkpoint_every=3", "data.eval_limit=32",
            "data.eval_batch=16", f"model.preset={TINY_MODEL}")
# Validation on 37 examples in batches of 12 (8 on two processes): the last batch is partial and padded.
UNEVEN_EVAL = ("data.eval_limit=37", "data.eval_batch=12")
LONGER = ("train.steps=12",)
# Six steps on four data shards with adaptive bucket weights (their state moves and is agreed every
# step) and the uneven validation: the one-process, four-device run that the launcher and mesh-change
# tests compare against (conftest.py: adaptive_four_device_run).
ADAPTIVE_FOUR_DEVICES = ("parallel.data=4", "weighting=adaptive", "adaptive.step_size=1.0", *UNEVEN_EVAL)


def sft_config(run, steps, *extra):
    return load_config(SFT_CONFIG, [f"data.dir={run}", f"train.steps={steps}", *TINY_RUN, *extra])


def train_args(run, out, *extra):
    return ["train", "sft", "--config", str(SFT_CONFIG), "--out", str(out), "--no-progress", f"data.dir={run}",
            "train.steps=6", *TINY_RUN, *extra]


def start_cli(args, env_extra, devices):
    """`polyalign ARGS` in a process of `devices` CPU devices, under timeout(1), output captured."""
    env = cpu_devices_env(devices, **env_extra)
    return subprocess.Popen(["timeout", "-k", "10", "300", sys.executable, "-m", "polyalign.cli", *args],
                            env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


def wait_ok(processes):
    outputs = [p.communicate()[0] for p in processes]
    for p, output in zip(processes, outputs):
        assert p.returncode == 0, output[-3000:]
    return outputs


def start_two_processes(run, out, *extra):
    port = free_port()
    args = train_args(run, out, "parallel.data=4", *extra)
    return [start_cli(args, start_variables(port, 2, i), devices=2) for i in range(2)]


def checkpoint_begun(out, step: int) -> bool:
    """Whether checkpoint `step` has begun (its temporary folder, or the committed one, exists)."""
    folder = out / "checkpoints"
    return folder.is_dir() and any(p.name.split(".")[0] == str(step) for p in folder.iterdir())
