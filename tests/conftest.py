import json
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
DEMO_DATA = REPO / "polyalign" / "demo_data"
FIXTURES = REPO / "tests" / "fixtures"
SHARED_DATA = REPO.parent / "shared" / "data"
SCHEME = REPO / "buckets" / "polyalign.yaml"


def write_config(path: Path, sources: list[dict], **options) -> Path:
    """A data config next to its inputs, using the project's bucket scheme."""
    import yaml

    config = {"scheme": str(SCHEME), "sources": sources, **options}
    path.write_text(yaml.safe_dump(config, allow_unicode=True), encoding="utf-8")
    return path


def read_jsonl(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines() if line.strip()]


@pytest.fixture(scope="session")
def demo_run(tmp_path_factory):
    """prepare + stats on the bundled demo data, once per session."""
    from polyalign.data.prepare import prepare
    from polyalign.reports.stats import compute_stats

    run = tmp_path_factory.mktemp("demo_run")
    manifest = prepare(REPO / "configs" / "data" / "demo.yaml", run, progress=False)
    stats = compute_stats(run, progress=False)
    return run, manifest, stats


@pytest.fixture(scope="session")
def demo_tokenizer(demo_run, tmp_path_factory):
    """polyalign's SentencePiece tokenizer trained on the demo train split (8,000 pieces)."""
    from polyalign.tokenizer_training import train_from_records

    run, _, _ = demo_run
    tokenizer, report = train_from_records(run / "data" / "train.jsonl", tmp_path_factory.mktemp("tokenizer"), 8000)
    return tokenizer, report


@pytest.fixture(scope="session")
def json_tokenizer(demo_run, tmp_path_factory):
    """A byte-level BPE tokenizer.json (the `tokenizers` library) trained on the demo train split, with
    the special tokens of every built-in chat template, loaded the way a checkpoint's would be."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    from polyalign.chat import TEMPLATE_SPECIAL_TOKENS
    from polyalign.data.records import read_records
    from polyalign.tokenizer import load_tokenizer
    from polyalign.tokenizer_training import record_texts

    run, _, _ = demo_run
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=3000, special_tokens=list(TEMPLATE_SPECIAL_TOKENS),
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator(record_texts(read_records(run / "data" / "train.jsonl")), trainer)
    directory = tmp_path_factory.mktemp("json_tokenizer")
    tok.save(str(directory / "tokenizer.json"))
    (directory / "tokenizer_config.json").write_text(json.dumps({"bos_token": "<bos>", "eos_token": {"content": "<eos>"}}))
    return load_tokenizer(directory)


@pytest.fixture(scope="session")
def built_run(demo_run, demo_tokenizer, tmp_path_factory):
    """A run directory with the demo data and a build (polyalign template, 64-token examples)."""
    from polyalign.inputs.build import BuildOptions, build

    source, _, _ = demo_run
    run = tmp_path_factory.mktemp("built_run")
    (run / "data").symlink_to(source / "data", target_is_directory=True)
    manifest = build(run, BuildOptions(tokenizer=str(demo_tokenizer[0].path.parent), max_length=64), progress=False)
    return run, manifest


def tiny_model_config(vocab_size: int, **overrides):
    """A 2-layer Llama-structured model small enough for many compiles in one test session."""
    from polyalign.model import family_defaults

    sizes = dict(vocab_size=vocab_size, hidden_size=32, intermediate_size=64, num_layers=2, num_heads=4,
                 num_kv_heads=2, head_dim=8)
    return family_defaults("llama", **{**sizes, **overrides})
