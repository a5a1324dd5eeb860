"""The launcher: SLURM variables to the POLYALIGN_* start variables, and a 2-process CPU training run."""

import pytest

from polyalign.mesh.launch import LaunchError, expand_nodelist, local_environments, slurm_environment
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
    # no address, count or id: JAX reads them from the metadata server itself
    assert fresh_start == [{"heartbeat_timeout_seconds": 300}]
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
