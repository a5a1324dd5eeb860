import itertools
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
DEMO_DATA = REPO / "polyalign" / "demo_data"
FIXTURES = REPO / "tests" / "fixtures"
SHARED_DATA = REPO.parent / "shared" / "data"
SCHEME = REPO / "buckets" / "polyalign.yaml"


# One persistent JAX compilation cache for the whole test session: the tiny models are compiled again
# and again by tests that build their own trainers, by the pytest-xdist workers and by the subprocesses
# (multi-process, CLI and bench tests), and identical programs then compile once. The controller makes
# it before the workers start, so they and every subprocess inherit it through the environment; a
# cache the user already set (an empty value: none) is left alone.
CACHE_ENV = "JAX_COMPILATION_CACHE_DIR"
OWN_CACHE = "POLYALIGN_TEST_OWNS_JAX_CACHE"


# Tests compile hundreds of small programs and run each for milliseconds, so compiling is most of their
# time: XLA's backend optimisation buys nothing there (tests/test_engine.py and test_losses.py: 89 -> 65
# s), XLA:CPU's MLIR fusion emitters cost more to compile than the loop emitters they replace, and
# splitting each program's code generation over threads costs more than it saves when every core
# already runs a test (test_model.py and test_lora.py: 225 -> 165 -> 136 CPU-s; bench/RESULTS.md).
# Every test process and subprocess inherits these; the quick-demo test runs its demo without them
# (user_env), as users do.
TEST_XLA_FLAGS = ("--xla_backend_optimization_level=0 --xla_cpu_use_fusion_emitters=false "
                  "--xla_cpu_parallel_codegen_split_count=1")


def known_xla_flags(flags: str) -> str:
    """`flags` less those the installed XLA does not know. XLA ends a process at an unknown flag (jaxlib
    0.11 dropped --xla_cpu_use_fusion_emitters, whose emitters it no longer has), so the controller tries
    them once in a child process, dropping each flag that child names, before any test starts."""
    kept = flags.split()
    while kept:
        probe = subprocess.run([sys.executable, "-c", "import jax; jax.devices()"], capture_output=True, text=True,
                               env={**os.environ, "JAX_PLATFORMS": "cpu",
                                    "XLA_FLAGS": f"{os.environ.get('XLA_FLAGS', '')} {' '.join(kept)}".strip()})
        named = re.search(r"Unknown flags? in XLA_FLAGS: (.*)", probe.stderr)  # "flags" when several
        unknown = set(named.group(1).split()) & set(kept) if named else set()
        if probe.returncode == 0 or not unknown:  # kept flags work, or jax fails for another reason: tests say
            return " ".join(kept)
        kept = [flag for flag in kept if flag not in unknown]
    return ""


def pytest_configure(config):
    # pytest-xdist's load scheduling first hands each worker a quarter of its share as one block of
    # consecutive tests: with the slow tests first (below), every slow test landed on worker 0, one after
    # another, while worker 1 ran the quick ones and then waited. Handing out tests one or two at a time
    # spreads them (unless --maxschedchunk is given).
    if getattr(config.option, "maxschedchunk", "no xdist") is None:
        config.option.maxschedchunk = 1
    # One BLAS and OpenMP thread a test process: pytest-xdist already runs a test on every core, and
    # OpenBLAS's own threads then spin against the other workers' (a TruncatedSVD of turn dynamics ran 17x
    # slower beside one busy process: 0.66 s against 0.04 s; bench/RESULTS.md). Set before the workers and
    # subprocesses start, which inherit it; a value the user set is kept.
    for name in ("OPENBLAS_NUM_THREADS", "OMP_NUM_THREADS"):
        os.environ.setdefault(name, "1")
    if "--xla_backend_optimization_level" not in os.environ.get("XLA_FLAGS", ""):
        os.environ["XLA_FLAGS"] = f"{os.environ.get('XLA_FLAGS', '')} {known_xla_flags(TEST_XLA_FLAGS)}".strip()
    if CACHE_ENV in os.environ or os.environ.get("PYTEST_XDIST_WORKER"):
        return
    os.environ[CACHE_ENV] = tempfile.mkdtemp(prefix="polyalign-jax-cache-")
    os.environ[OWN_CACHE] = "1"
    # Every program is worth keeping: the suite's compiles are many and each is small.
    os.environ["JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS"] = "0"
    os.environ["JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES"] = "0"


def pytest_unconfigure(config):
    if os.environ.get(OWN_CACHE) and not os.environ.get("PYTEST_XDIST_WORKER"):
        shutil.rmtree(os.environ.pop(CACHE_ENV), ignore_errors=True)
        os.environ.pop(OWN_CACHE)


def pytest_collection_modifyitems(config, items):
    """The slow end-to-end tests first: under pytest-xdist the longest tests then start at once and the
    short ones fill in around them, instead of one long test starting last and running alone."""
    items.sort(key=lambda item: item.get_closest_marker("slow") is None)


@pytest.fixture(autouse=True)
def _no_kept_human_side():
    """Each test starts with no evaluation's human side kept (evaluate/run.py _human_side): a side kept by an
    earlier test on the same worker would make a test's numbers depend on the order tests run in, were
    either to change something the side's key does not hold (a module constant)."""
    yield
    if (evaluation := sys.modules.get("polyalign.evaluate.run")) is not None:
        evaluation._human_sides.clear()


def write_config(path: Path, sources: list[dict], **options) -> Path:
    """A data config next to its inputs, using the project's bucket scheme."""
    import yaml

    config = {"scheme": str(SCHEME), "sources": sources, **options}
    path.write_text(yaml.safe_dump(config, allow_unicode=True), encoding="utf-8")
    return path


def read_jsonl(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines() if line.strip()]


def first_records(run: Path, data: Path, counts: dict[str, int]) -> Path:
    """A RUN/data folder `data` holding the first `counts[split]` records of each split of `run`'s, with its
    prepare manifest: a build of it is a build of those records."""
    data.mkdir(parents=True)
    (data / "manifest.json").write_bytes((run / "data" / "manifest.json").read_bytes())
    for split, count in counts.items():
        with (run / "data" / f"{split}.jsonl").open(encoding="utf-8") as rows:
            (data / f"{split}.jsonl").write_text("".join(itertools.islice(rows, count)), encoding="utf-8")
    return data


def made_once(tmp_path_factory, name: str, make: Callable[[Path], None]) -> Path:
    """A folder that `make` fills once per test session for every pytest-xdist worker: the first worker
    to take its lock makes it, the others wait for it and read it (each worker would otherwise prepare
    and build the demo data again)."""
    from filelock import FileLock

    base = tmp_path_factory.getbasetemp()
    if os.environ.get("PYTEST_XDIST_WORKER"):
        base = base.parent  # the session's folder, above each worker's own
    folder, made = base / name, base / f"{name}.made"
    with FileLock(base / f"{name}.lock"):
        if not made.exists():
            shutil.rmtree(folder, ignore_errors=True)
            folder.mkdir()
            make(folder)
            made.touch()
    return folder


def _read_json(path: Path):
    return json.loads(path.read_text(encoding="utf-8"))


@pytest.fixture(scope="session")
def demo_run(tmp_path_factory):
    """prepare + stats on the bundled demo data, once per session: (RUN, its manifest, its stats)."""
    from polyalign.data.prepare import prepare
    from polyalign.reports.stats import compute_stats

    def make(run):
        prepare(REPO / "configs" / "data" / "demo.yaml", run, progress=False)
        compute_stats(run, progress=False)

    run = made_once(tmp_path_factory, "demo_run", make)
    return run, _read_json(run / "data" / "manifest.json"), _read_json(run / "stats" / "stats.json")


@pytest.fixture(scope="session")
def demo_tokenizer(demo_run, tmp_path_factory):
    """polyalign's SentencePiece tokenizer trained on the demo train split (8,000 pieces), and its report."""
    from polyalign.tokens.tokenizer import load_tokenizer
    from polyalign.tokens.tokenizer_training import REPORT, train_from_records

    run, _, _ = demo_run
    directory = made_once(tmp_path_factory, "tokenizer",
                          lambda out: train_from_records(run / "data" / "train.jsonl", out, 8000))
    return load_tokenizer(directory), _read_json(directory / REPORT)


def write_bpe_tokenizer(texts, vocab_size: int, folder: Path, special_tokens: dict) -> Path:
    """FOLDER/tokenizer.json, a byte-level BPE (the `tokenizers` library) trained on `texts` with the
    special tokens of every built-in chat template, and FOLDER/tokenizer_config.json naming
    `special_tokens`, as a checkpoint holds them."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    from polyalign.tokens.chat import TEMPLATE_SPECIAL_TOKENS

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=list(TEMPLATE_SPECIAL_TOKENS),
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator(texts, trainer)
    tok.save(str(folder / "tokenizer.json"))
    (folder / "tokenizer_config.json").write_text(json.dumps(special_tokens))
    return folder


@pytest.fixture(scope="session")
def json_tokenizer(demo_run, tmp_path_factory):
    """A byte-level BPE tokenizer.json trained on the demo train split (3,000 pieces), loaded the way a
    checkpoint's would be."""
    from polyalign.data.records import read_records
    from polyalign.tokens.tokenizer import load_tokenizer
    from polyalign.tokens.tokenizer_training import record_texts

    run, _, _ = demo_run

    def make(folder):
        write_bpe_tokenizer(record_texts(read_records(run / "data" / "train.jsonl")), 3000, folder,
                            {"bos_token": "<bos>", "eos_token": {"content": "<eos>"}})

    return load_tokenizer(made_once(tmp_path_factory, "json_tokenizer", make))


@pytest.fixture(scope="session")
def built_run(demo_run, demo_tokenizer, tmp_path_factory):
    """A run directory with the demo data and a build (polyalign template, 64-token examples)."""
    from polyalign.inputs.build import build
    from polyalign.inputs.built import BuildOptions, read_manifest

    source, _, _ = demo_run

    def make(run):
        (run / "data").symlink_to(source / "data", target_is_directory=True)
        build(run, BuildOptions(tokenizer=str(demo_tokenizer[0].path.parent), max_length=64), progress=False)

    run = made_once(tmp_path_factory, "built_run", make)
    return run, read_manifest(run)


@pytest.fixture(scope="session")
def adaptive_four_device_run(built_run, tmp_path_factory):
    """`polyalign train sft` in one process of four CPU devices with tests/cli_runs.ADAPTIVE_FOUR_DEVICES,
    once per session: the reference of the launcher and mesh-change tests (each ran its own)."""
    from tests.cli_runs import ADAPTIVE_FOUR_DEVICES, start_cli, train_args, wait_ok  # cli_runs imports conftest

    run, _ = built_run

    def make(folder):
        wait_ok([start_cli(train_args(run, folder / "run", *ADAPTIVE_FOUR_DEVICES), {}, devices=4)])

    return made_once(tmp_path_factory, "adaptive_four_device_run", make) / "run"


TINY_MODEL = FIXTURES / "tiny_model.yaml"


def tiny_model_config(vocab_size: int, **overrides):
    """A 2-layer Llama-structured model small enough for many compiles in one test session (the
    architecture of tests/fixtures/tiny_model.yaml, which CLI runs take as model.preset)."""
    from polyalign.model.presets import preset

    return preset(str(TINY_MODEL), vocab_size=vocab_size, **overrides)


def cpu_devices_env(devices: int, **extra: str) -> dict[str, str]:
    """The environment of a subprocess whose CPU is split into `devices` XLA devices, the session's
    other XLA flags kept."""
    from polyalign.mesh.launch import with_cpu_devices

    return {**os.environ, "XLA_FLAGS": with_cpu_devices(os.environ.get("XLA_FLAGS"), devices), **extra}


def user_env(**extra: str) -> dict[str, str]:
    """The environment of a subprocess that runs as users run polyalign: XLA without TEST_XLA_FLAGS."""
    flags = " ".join(flag for flag in os.environ.get("XLA_FLAGS", "").split() if flag not in TEST_XLA_FLAGS.split())
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
    return {**env, **({"XLA_FLAGS": flags} if flags else {}), **extra}
