"""Meshes, processes, and the logical axis names that map a model onto a mesh.

The model names every parameter axis and every large activation axis logically ("embed", "mlp",
"batch", ...). A rules table maps each name to a mesh axis (or to nothing, which replicates), so one
model definition runs unsharded on a laptop, over data/fsdp/tensor on a GPU node, or on a TPU pod.
"""

from __future__ import annotations

import contextlib
import functools
import os
import sys
import threading
import time
from collections.abc import Iterator, Sequence

import jax
import numpy as np
from flax import nnx
from flax.core import spmd as flax_spmd
from jax._src import clusters, distributed
from jax.sharding import AxisType, Mesh, NamedSharding, PartitionSpec

from polyalign.core.errors import ParallelError, PolyalignError
from polyalign.core.yaml_config import ConfigError
from polyalign.mesh.launch import NOTICES_ENV, launcher_notices, port_in_use, port_in_use_message
from polyalign.mesh.shape import ParallelConfig
from polyalign.mesh.supervisor import PEER_LOST_EXIT, tell_parent

MESH_AXES = ("data", "fsdp", "tensor")

# Parameter axes. The embedding table has names of its own: sharding its model dimension over fsdp,
# which also splits the batch, makes XLA fully rematerialise the token gather.
LAYERS, VOCAB, EMBED, MLP, Q_HEADS, KV_HEADS, NORM = "layers", "vocab", "embed", "mlp", "q_heads", "kv_heads", "norm"
TABLE_VOCAB, TABLE_EMBED = "table_vocab", "table_embed"
# Activation axes.
BATCH, LENGTH, ACT_EMBED, ACT_HEADS, ACT_KV_HEADS, HEAD_DIM, ACT_MLP, ACT_VOCAB = (
    "batch", "length", "act_embed", "act_heads", "act_kv_heads", "head_dim", "act_mlp", "act_vocab")

# FSDP shards the parameters' model dimension; tensor parallelism splits heads, MLP and vocabulary.
DEFAULT_RULES: tuple[tuple[str, str | tuple[str, ...] | None], ...] = (
    (LAYERS, None),
    (VOCAB, "tensor"),
    (TABLE_VOCAB, "fsdp"),
    (TABLE_EMBED, "tensor"),
    (EMBED, "fsdp"),
    (MLP, "tensor"),
    (Q_HEADS, "tensor"),
    (KV_HEADS, "tensor"),
    (NORM, None),
    (BATCH, ("data", "fsdp")),
    (LENGTH, None),
    (ACT_EMBED, None),
    (ACT_HEADS, "tensor"),
    (ACT_KV_HEADS, "tensor"),
    (HEAD_DIM, None),
    (ACT_MLP, "tensor"),
    (ACT_VOCAB, "tensor"),
)


def logical_spec(names: Sequence[str | None], rules=None) -> PartitionSpec:
    """The PartitionSpec that `rules` (default: the active flax rules, else DEFAULT_RULES) give `names`."""
    rules = rules if rules is not None else (flax_spmd.get_logical_axis_rules() or DEFAULT_RULES)
    return PartitionSpec(*flax_spmd.from_sharding_rules(tuple(names), rules))


def mesh_spec(names: Sequence[str | None], mesh) -> PartitionSpec:
    """The PartitionSpec of logical `names` on `mesh`, keeping only the mesh axes it has."""
    present = set(mesh.axis_names)

    def keep(entry):
        if entry is None:
            return None
        axes = tuple(a for a in (entry if isinstance(entry, tuple) else (entry,)) if a in present)
        return axes if len(axes) > 1 else (axes[0] if axes else None)

    return PartitionSpec(*(keep(e) for e in logical_spec(names)))


def constrain(x: jax.Array, names: Sequence[str | None]) -> jax.Array:
    """Pins an activation's sharding by logical names when a mesh is active; a no-op otherwise."""
    mesh = jax.sharding.get_abstract_mesh()
    if mesh.empty:
        return x
    return jax.lax.with_sharding_constraint(x, mesh_spec(names, mesh))


def param(names: Sequence[str | None]) -> dict:
    """Metadata for an nnx parameter initialiser: its logical axis names."""
    return {"out_sharding": tuple(names)}


def unsharded():
    """Context for creating a model with no mesh: sharding annotations are kept but not applied."""
    return nnx.use_eager_sharding(False)


# --- mesh and processes -----------------------------------------------------------------------------


def mesh_shape(config: ParallelConfig, num_devices: int) -> tuple[int, int, int]:
    sizes = [config.data, config.fsdp, config.tensor]
    free = [i for i, s in enumerate(sizes) if s == -1]
    if len(free) > 1 or any(s == 0 or s < -1 for s in sizes):
        raise ParallelError(f"parallel sizes {sizes}: each must be positive, and at most one may be -1")
    fixed = int(np.prod([s for s in sizes if s != -1]))
    if free:
        if num_devices % fixed:
            raise ParallelError(f"{num_devices} devices do not divide into fsdp x tensor x data = {sizes}")
        sizes[free[0]] = num_devices // fixed
    if int(np.prod(sizes)) != num_devices:
        raise ParallelError(f"mesh data={sizes[0]} x fsdp={sizes[1]} x tensor={sizes[2]} needs "
                            f"{int(np.prod(sizes))} devices; there are {num_devices}")
    return tuple(sizes)


def make_mesh(config: ParallelConfig = ParallelConfig(), devices=None) -> Mesh:
    devices = devices if devices is not None else jax.devices()
    shape = mesh_shape(config, len(devices))
    # Auto axes: the compiler propagates shardings from the annotated parameters and batches.
    return jax.make_mesh(shape, MESH_AXES, axis_types=(AxisType.Auto,) * 3, devices=devices)


def batch_sharding(mesh: Mesh, leading: int = 1) -> NamedSharding:
    """Sharding of a batch array whose batch axis comes after `leading` - 1 unsharded axes."""
    return NamedSharding(mesh, PartitionSpec(*([None] * (leading - 1)), logical_spec((BATCH,))[0]))


def param_shardings(abstract_state, mesh: Mesh, rules=DEFAULT_RULES):
    """NamedShardings for an nnx State from its parameters' logical axis names."""
    with nnx.logical_axis_rules(rules):
        specs = nnx.get_partition_spec(abstract_state)
    return jax.tree.map(lambda spec: NamedSharding(mesh, spec), specs,
                        is_leaf=lambda x: isinstance(x, PartitionSpec))


@functools.lru_cache(maxsize=8)
def _replicate(mesh):
    """An identity whose result every device of `mesh` holds whole: one jitted function per mesh, so that
    each shape compiles once, not once per array per call."""
    return jax.jit(lambda a: a, out_shardings=NamedSharding(mesh, PartitionSpec()))


def to_host(tree):
    """Every array of `tree` as a NumPy array, on every process, one array at a time. An array this
    process holds whole is copied off its devices shard by shard; one spread over processes is first
    replicated, so the devices hold one extra parameter at a time, never a second model."""
    def one(x):
        if not isinstance(x, jax.Array) or x.is_fully_addressable:
            return np.asarray(jax.device_get(x))
        return np.asarray(jax.device_get(_replicate(x.sharding.mesh)(x)))

    return jax.tree.map(one, tree)


def orders_programs() -> bool:
    """Whether each program over the global devices must finish before the next is dispatched: on
    several CPU processes. The CPU client runs a multi-device program's per-device parts on a thread
    pool; with several such programs in flight, one device's part of the earliest can wait behind
    later ones while its peers, on this process and others, wait in a gloo collective for it: both
    processes then wait forever (a stack shows one device thread in gloo::allreduce and its sibling in
    xla::Semaphore::Acquire). TPU and GPU streams order programs themselves."""
    return jax.process_count() > 1 and jax.default_backend() == "cpu"


def ordered(tree):
    """`tree` once every array in it is computed, where programs must be ordered; else as is."""
    if orders_programs():
        jax.block_until_ready(tree)
    return tree


class OrderedJit:
    """jax.jit(fun, **options) whose every call returns only when its result is ready, on several CPU
    processes (see orders_programs); `lower` and the rest are jax.jit's."""

    def __init__(self, fun, **options):
        self.jitted = jax.jit(fun, **options)

    def __call__(self, *args, **kwargs):
        return ordered(self.jitted(*args, **kwargs))

    def __getattr__(self, name):
        return getattr(self.jitted, name)


def ordered_jit(fun=None, **options):
    """jax.jit for programs over global arrays: ordered on several CPU processes (OrderedJit)."""
    if fun is None:
        return lambda f: OrderedJit(f, **options)
    return OrderedJit(fun, **options)


_distributed_started = False


def _detected_cluster():
    """JAX's own cluster detection (jax/_src/clusters): the first environment present that JAX would
    pick without being asked (GCE TPU VMs through the metadata server, GKE through TPU_WORKER_HOSTNAMES
    or TPU_PROCESS_ADDRESSES, SLURM, Open MPI, Kubernetes), or None."""
    for env in clusters.ClusterEnv._cluster_types:
        if getattr(env, "opt_in_only_method", False):
            continue
        try:
            if env.is_env_present():
                return env
        except Exception:  # a half-configured environment is not a cluster to join
            continue
    return None


def _int_env(name: str) -> int | None:
    value = os.environ.get(name)
    if value in (None, ""):
        return None
    try:
        return int(value)
    except ValueError:
        raise ParallelError(f"{name}={value!r} must be an integer") from None


# What a process prints when the coordination service reports a peer gone (polyalign/train/run.py
# sets it to name the last committed checkpoint and the command that resumes): lost ids -> one line.
peer_lost_report = None


def report_peer_lost(lost: list[int], cause: str) -> None:
    """A peer is gone: one line, then exit PEER_LOST_EXIT (instead of a traceback and the distributed
    client's abort with a C++ stack trace)."""
    try:
        line = peer_lost_report(lost, cause) if peer_lost_report is not None else None
    except Exception:  # the report must not stand between a lost peer and the exit
        line = None
    if line is None:
        who = f"process {', '.join(map(str, lost))}" if lost else "a peer process"
        line = f"polyalign: process {jax.process_index()} stops: {who} of {jax.process_count()} is gone ({cause})"
    print(line, file=sys.stderr, flush=True)
    sys.stdout.flush()
    os._exit(PEER_LOST_EXIT)


BEAT_KEY = "polyalign/beat/"


class PeerMonitor:
    """Every process publishes a beat (a counter in the coordination service's key-value store) every
    `interval` seconds and reads the others'. A peer whose beat has not moved for `timeout` seconds is
    gone, and so is the coordinator (process 0) when the store has not answered for that long: either
    way report_peer_lost. This comes before JAX's own heartbeat check (POLYALIGN_HEARTBEAT_TIMEOUT,
    set longer), whose end is an abort."""

    def __init__(self, timeout: float, interval: float = 1.0):
        self.client, self.timeout, self.interval = distributed.global_state.client, timeout, interval
        self.me, self.count = jax.process_index(), jax.process_count()
        self._stop = threading.Event()

    running: PeerMonitor | None = None

    @classmethod
    def waiting_time(cls) -> float:
        """How long the running monitor may take to notice a lost peer (0 when none runs)."""
        return 0.0 if cls.running is None else cls.running.timeout + 3 * cls.running.interval

    def __enter__(self) -> PeerMonitor:
        if self.client is not None and self.count > 1:
            PeerMonitor.running = self
            threading.Thread(target=self._run, name="polyalign-peers", daemon=True).start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        if PeerMonitor.running is self:
            PeerMonitor.running = None

    def _run(self) -> None:
        seen: dict[int, tuple[str | None, float]] = {}
        answered = time.monotonic()
        beat = 0
        notices = os.environ.get(NOTICES_ENV)
        while not self._stop.wait(self.interval):
            now = time.monotonic()
            gone = launcher_notices(notices)
            if gone:
                report_peer_lost(sorted(gone), f"the launcher saw it end: {'; '.join(gone.values())}")
            try:
                beat += 1
                self.client.key_value_set(f"{BEAT_KEY}{self.me}", str(beat), allow_overwrite=True)
                # every peer's beat in one request: a pod of 64 hosts asks the coordinator 64 times a
                # second, not 64 x 63 (a peer that has not published yet is absent, and counts as silent)
                beats = {key.rsplit("/", 1)[-1]: value for key, value in self.client.key_value_dir_get(BEAT_KEY)}
                for peer in range(self.count):
                    value = beats.get(str(peer))
                    if peer != self.me and (peer not in seen or seen[peer][0] != value):
                        seen[peer] = (value, now)
                answered = now
            except Exception as error:
                if self._stop.is_set():
                    return
                if now - answered > self.timeout and self.me != 0:
                    first = str(error).splitlines()[0][:80] if str(error) else type(error).__name__
                    report_peer_lost([0], f"the coordinator has not answered for {now - answered:.0f} s: {first}")
                continue
            lost = sorted(p for p, (_, since) in seen.items() if now - since > self.timeout)
            if lost and not self._stop.is_set():
                report_peer_lost(lost, f"no sign of life for {self.timeout:g} s")


_decisions = 0  # how many refusal_shared blocks this process has passed: every process passes them in order
DECISION_WAIT = 600  # seconds the others wait for process 0's outcome (it takes a lock and reads a folder)


@contextlib.contextmanager
def refusal_shared(what: str) -> Iterator[None]:
    """A block that only process 0 runs for real (taking OUT's lock), whose refusal every process of the
    job raises alike: process 0 publishes its outcome in the coordination service, the others wait for it.
    A second job writing into a running job's folder was refused on process 0 while process 1 went on
    into its first collective and ended with an Orbax traceback."""
    global _decisions
    client = distributed.global_state.client
    if jax.process_count() == 1 or client is None:
        yield
        return
    _decisions += 1
    key = f"polyalign/refusal/{_decisions}-{what}"
    if jax.process_index() == 0:
        try:
            yield
        except PolyalignError as error:
            client.key_value_set(key, f"refused\n{error}")
            raise
        client.key_value_set(key, "ok")
        return
    yield
    said = client.blocking_key_value_get(key, DECISION_WAIT * 1000)
    if said != "ok":
        raise ConfigError(said.partition("\n")[2] + " (process 0 refused it; this process stops with it)")


JOIN_TIMEOUT = 120  # seconds the processes of a job started by POLYALIGN_COORDINATOR have to join
DETECTED_JOIN_TIMEOUT = 300  # JAX's own default, kept for clusters it detects (TPU VMs, SLURM, GKE)
JOIN_WAIT_NOTICE = 15  # seconds of waiting before a process says what it waits for


def _initialize(default_timeout: int, **arguments) -> None:
    """jax.distributed.initialize with JAX's heartbeat timeout at POLYALIGN_HEARTBEAT_TIMEOUT (default
    300 s): PeerMonitor reports a lost peer sooner, with one line. While the processes join, a watch
    says what this one waits for and ends it with one line at POLYALIGN_JOIN_TIMEOUT (default
    `default_timeout`): JAX's own timeout (set later, as a backstop) aborts the process in C++ with a
    stack trace and no word on the cause."""
    arguments["heartbeat_timeout_seconds"] = _int_env("POLYALIGN_HEARTBEAT_TIMEOUT") or 300
    timeout = _int_env("POLYALIGN_JOIN_TIMEOUT")
    if timeout is not None and timeout < 1:
        raise ParallelError(f"POLYALIGN_JOIN_TIMEOUT={timeout} must be at least 1 (seconds)")
    timeout = timeout or default_timeout
    arguments["initialization_timeout"] = timeout + 60
    # JAX's preemption service takes SIGTERM in C++ from the join on, where polyalign's handler never hears
    # it: a scheduler's stop during compilation or restore was swallowed and the job trained on. polyalign
    # agrees on a stop itself, every step, over all processes (train/trainer.py _StopSignal).
    jax.config.update("jax_enable_preemption_service", False)
    joined, decided = threading.Event(), threading.Lock()
    threading.Thread(target=_watch_join, args=(joined, decided, timeout, arguments), daemon=True,
                     name="polyalign-join-watch").start()
    try:
        jax.distributed.initialize(**arguments)
    finally:
        with decided:  # the watch ends the process only while holding it, so a join it sees is final
            joined.set()


def _watch_join(joined: threading.Event, decided: threading.Lock, timeout: int, arguments: dict) -> None:
    """Says, once, what a process still waiting to join after JOIN_WAIT_NOTICE seconds waits for; ends
    it with one line after `timeout` seconds (exit status 2, as any error the user can fix)."""
    processes, me = arguments.get("num_processes"), arguments.get("process_id")
    where = f" at {arguments['coordinator_address']}" if arguments.get("coordinator_address") else ""
    who = f"process {me} of {processes}" if processes is not None and me is not None else "this process"
    start = ("start the same command on every host, each with its own POLYALIGN_PROCESS_ID "
             f"(0 to {processes - 1}), the same POLYALIGN_COORDINATOR and POLYALIGN_NUM_PROCESSES"
             if processes is not None else "start the same command on every host of the job")
    notice = min(JOIN_WAIT_NOTICE, timeout / 2)
    if joined.wait(notice):
        return
    print(f"polyalign: {who} is waiting for the job's other processes to join{where} (up to {timeout} s, "
          f"POLYALIGN_JOIN_TIMEOUT): {start}", file=sys.stderr, flush=True)
    if joined.wait(timeout - notice):
        return
    with decided:
        if joined.is_set():  # the join completed while this thread woke
            return
        print(f"polyalign: error: {who}: the job's processes did not all join{where} within {timeout} s; {start} "
              "(a firewall between the hosts, a coordinator address the others cannot reach, a coordinator that could "
              "not start, e.g. its port in use, and two processes given one POLYALIGN_PROCESS_ID look the same)",
              file=sys.stderr, flush=True)
        os._exit(2)  # the main thread is inside JAX's C++ join, which no exception reaches


def initialize_distributed() -> None:
    """Starts jax.distributed when this is one process of several, and checks that it joined them all.

    POLYALIGN_COORDINATOR=host:port, POLYALIGN_NUM_PROCESSES and POLYALIGN_PROCESS_ID say who is who
    (GPU clusters, `polyalign launch`, CPU processes in tests). Otherwise JAX's own cluster detection
    decides (a GCE TPU VM of several workers, a GKE TPU job, SLURM), and POLYALIGN_NUM_PROCESSES alone
    (tpu_scripts/launch.sh sets it to the slice's worker count) makes a start that finds fewer
    processes an error. POLYALIGN_NUM_DEVICES, when set, is the global device count expected. Call
    before anything touches a device; later calls do nothing.
    """
    global _distributed_started
    if _distributed_started:
        return
    expected = _int_env("POLYALIGN_NUM_PROCESSES")
    coordinator = os.environ.get("POLYALIGN_COORDINATOR")
    if coordinator:
        process_id = _int_env("POLYALIGN_PROCESS_ID")
        if expected is None or process_id is None:
            raise ParallelError("POLYALIGN_COORDINATOR is set, so POLYALIGN_NUM_PROCESSES and "
                                "POLYALIGN_PROCESS_ID must be integers too")
        if expected < 1 or not 0 <= process_id < expected:
            # JAX would wait for a process that can never come, or stop in C++ with no word on the cause
            raise ParallelError(f"POLYALIGN_PROCESS_ID={process_id} with POLYALIGN_NUM_PROCESSES={expected}: "
                                f"each process's id is one of 0 to {expected - 1}, different on every host"
                                if expected >= 1 else
                                f"POLYALIGN_NUM_PROCESSES={expected} must be at least 1")
        port = coordinator.rpartition(":")[2]
        if expected > 1 and process_id == 0 and port.isdigit() and port_in_use(int(port)):
            raise ParallelError(port_in_use_message(int(port), f"POLYALIGN_COORDINATOR={coordinator}"))
        _distributed_started = True
        if expected > 1:
            _initialize(JOIN_TIMEOUT, coordinator_address=coordinator, num_processes=expected,
                        process_id=process_id)
    else:
        _distributed_started = True
        cluster = _detected_cluster()
        detected = cluster.get_process_count() if cluster is not None else None
        if (detected or 0) > 1 or (expected or 0) > 1:
            _initialize(DETECTED_JOIN_TIMEOUT)
    check_processes(expected, _int_env("POLYALIGN_NUM_DEVICES"))
    if jax.process_count() > 1:  # what the parent needs to name a lost coordinator (mesh/supervisor.py)
        tell_parent(process=jax.process_index(), processes=jax.process_count(),
                    coordinator=distributed.global_state.coordinator_address)


def check_processes(expected_processes: int | None, expected_devices: int | None = None) -> None:
    """One line (ParallelError) when this job does not hold the processes and devices it should."""
    processes, devices = jax.process_count(), jax.device_count()
    if expected_processes is not None and processes != expected_processes:
        raise ParallelError(f"this job has {processes} process(es) but {expected_processes} were expected "
                            "(POLYALIGN_NUM_PROCESSES): a host that did not join trains alone; start the "
                            "command on every worker (tpu_scripts/launch.sh does)")
    if expected_devices is not None and devices != expected_devices:
        raise ParallelError(f"this job sees {devices} devices over {processes} process(es) but "
                            f"{expected_devices} were expected (POLYALIGN_NUM_DEVICES)")
    if processes > 1 and devices != processes * jax.local_device_count():
        raise ParallelError(f"{devices} global devices over {processes} processes of "
                            f"{jax.local_device_count()} devices each: the hosts do not hold the same devices")
