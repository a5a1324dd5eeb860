"""The launcher: SLURM variables to the POLYALIGN_* start variables, and a 2-process CPU training run."""

import pytest

from polyalign.launch import LaunchError, expand_nodelist, local_environments, slurm_environment
from polyalign.train.metrics import read_metrics
from tests.test_training import _cli, _train_args, _wait


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


@pytest.mark.slow
def test_launcher_runs_two_cpu_processes_like_one_with_four_devices(built_run, tmp_path):
    run, _ = built_run
    _wait([_cli(_train_args(run, tmp_path / "one", "parallel.data=4"), {}, devices=4)])
    launched = _cli(["launch", "--nproc", "2", "--cpu-devices", "2", "--", "polyalign",
                     *_train_args(run, tmp_path / "two", "parallel.data=4")], {}, devices=1)
    _wait([launched])
    one, two = read_metrics(tmp_path / "one"), read_metrics(tmp_path / "two")
    assert [r["step"] for r in two] == list(range(1, 7))
    assert max(abs(a["loss"] - b["loss"]) for a, b in zip(one, two)) <= 1e-5
