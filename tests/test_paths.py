"""Outputs and checkpoints given as bucket URIs reach the file layer intact (etils.epath, which Orbax
and TFDS use). A fake bucket maps gs://bucket/... onto a local folder through epath's own test hook, so
every read and write below goes through the URI code path."""

import contextlib
import json
import os
import shutil

import jax
import numpy as np
import pytest
from etils import epath
from etils.epath import testing as epath_testing
from flax import nnx

from polyalign.core.paths import as_path, is_uri
from polyalign.model import create_model, load_hf_checkpoint, save_hf_checkpoint
from polyalign.tokens.tokenizer import load_tokenizer
from polyalign.train.metrics import MetricsWriter, read_metrics
from tests.conftest import tiny_model_config


@contextlib.contextmanager
def fake_bucket(root):
    """gs://bucket/... is root/bucket/... for every epath operation."""
    prefix = f"{root}/"

    def local(path):
        text = os.fspath(path)
        return prefix + text[len("gs://"):] if text.startswith("gs://") else text

    def remote(path):
        return "gs://" + path[len(prefix):] if path.startswith(prefix) else path

    def one(original, path, *args, **kwargs):
        return original(local(path), *args, **kwargs)

    def two(original, path, dst, *args, **kwargs):
        return original(local(path), local(dst), *args, **kwargs)

    def glob(original, pattern):
        return [remote(p) for p in original(local(pattern))]

    def walk(original, top, **kwargs):
        for directory, dirs, files in original(local(top), **kwargs):
            yield remote(os.fspath(directory)), dirs, files

    with epath_testing.mock_epath(open=one, exists=one, isdir=one, listdir=one, makedirs=one, mkdir=one,
                                  remove=one, rmtree=one, stat=one, glob=glob, walk=walk,
                                  rename=two, replace=two, copy=two):
        yield


def test_uris_stay_uris_and_local_paths_become_absolute(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    assert str(as_path("gs://bucket/runs/sft")) == "gs://bucket/runs/sft" and is_uri("gs://bucket/x")
    assert str(as_path("runs/sft")) == str(tmp_path / "runs" / "sft") and not is_uri("runs/sft")


def test_a_checkpoint_saved_to_a_bucket_loads_back_and_replaces_atomically(tmp_path):
    model = create_model(tiny_model_config(101), seed=3)
    with fake_bucket(tmp_path):
        saved = save_hf_checkpoint(model, "gs://bucket/runs/sft/model", extra_files={"note.txt": "first"})
        assert str(saved) == "gs://bucket/runs/sft/model"
        loaded = load_hf_checkpoint("gs://bucket/runs/sft/model")
        with pytest.raises(Exception, match="exists and is not empty"):
            save_hf_checkpoint(model, "gs://bucket/runs/sft/model")
        save_hf_checkpoint(create_model(tiny_model_config(101), seed=4), "gs://bucket/runs/sft/model", overwrite=True)
    folder = tmp_path / "bucket" / "runs" / "sft"
    assert sorted(p.name for p in folder.iterdir()) == ["model"]  # no staging or retired copies left
    assert sorted(p.name for p in (folder / "model").iterdir()) == ["config.json", "model.safetensors"]
    for got, want in zip(jax.tree.leaves(nnx.state(loaded, nnx.Param)), jax.tree.leaves(nnx.state(model, nnx.Param))):
        np.testing.assert_array_equal(np.asarray(got), np.asarray(want))


def test_metrics_and_tokenizer_through_a_bucket(tmp_path, demo_tokenizer):
    tokenizer_dir = demo_tokenizer[0].path.parent
    shutil.copytree(tokenizer_dir, tmp_path / "bucket" / "tok")
    with fake_bucket(tmp_path):
        writer = MetricsWriter("gs://bucket/runs/sft", report_to=())
        writer.write({"step": 1, "loss": 2.5})
        writer.write({"step": 2, "loss": 2.0})
        writer.close()
        assert [r["loss"] for r in read_metrics("gs://bucket/runs/sft")] == [2.5, 2.0]
        remote = load_tokenizer("gs://bucket/tok")
    text = "Hello 你好, 世界!"
    assert remote.encode(text) == demo_tokenizer[0].encode(text)
    assert (json.loads((tmp_path / "bucket/runs/sft/metrics.jsonl").read_text().splitlines()[0])
            == {"step": 1, "loss": 2.5})


def test_orbax_checkpoints_are_given_the_uri(tmp_path, monkeypatch):
    from orbax.checkpoint._src.path import gcs_utils

    from polyalign.train.checkpoint import Checkpointer

    # Orbax asks the Cloud Storage API whether a real bucket has a hierarchical namespace; the fake has none.
    monkeypatch.setattr(gcs_utils, "is_hierarchical_namespace_enabled", lambda path: False)
    with fake_bucket(tmp_path):
        checkpointer = Checkpointer("gs://bucket/runs/sft/checkpoints", every=10, keep=2)
        try:
            assert str(checkpointer.manager.directory) == "gs://bucket/runs/sft/checkpoints"
            assert isinstance(checkpointer.directory, epath.Path) and checkpointer.latest_step() is None
        finally:
            checkpointer.close()
    assert (tmp_path / "bucket/runs/sft/checkpoints").is_dir()  # created through epath


def test_a_built_run_read_from_a_bucket_finds_its_dataset_and_tokenizer(built_run, demo_tokenizer, tmp_path):
    """A build copied to a bucket: the manifest's tokenizer path is the builder's, so the run's own
    tokenizer/ is used; the dataset metadata is read through TFDS from the URI."""
    from polyalign.inputs.build import dataset_dir
    from polyalign.inputs.built import build_tokenizer_path, read_manifest

    run, manifest = built_run
    copy = tmp_path / "bucket" / "runs" / "demo"
    shutil.copytree(run / "build", copy / "build")
    shutil.copytree(demo_tokenizer[0].path.parent, copy / "tokenizer")
    moved = {**manifest, "tokenizer": "/builder/home/runs/demo/tokenizer"}
    with fake_bucket(tmp_path):
        assert read_manifest("gs://bucket/runs/demo")["vocab_size"] == manifest["vocab_size"]
        assert str(build_tokenizer_path("gs://bucket/runs/demo", moved)) == "gs://bucket/runs/demo/tokenizer"
        assert str(dataset_dir("gs://bucket/runs/demo")) == "gs://bucket/runs/demo/build/sft_examples/1.0.0"
    assert str(build_tokenizer_path(run, manifest)) == manifest["tokenizer"]


def test_a_runs_length_history_names_each_length_and_where_it_began():
    from polyalign.core.paths import length_history

    def segments(*spans):
        return [{"start_step": a, "end_step": b, "steps": n} for a, b, n in spans]

    assert length_history(segments((0, 20, 20)), 20) is None
    assert length_history(segments((0, 7, 20), (7, 20, 20)), 20) is None  # stopped and resumed alike
    # during the resumed invocation (its own segment not yet written) and after it
    assert length_history(segments((0, 20, 20)), 30) == "30 (train.steps 20 up to step 20, then 30)"
    assert length_history(segments((0, 20, 20), (20, 30, 30)), 30) == "30 (train.steps 20 up to step 20, then 30)"
    assert length_history(segments((0, 10, 20), (10, 25, 30), (25, 40, 40)), 40) == \
        "40 (train.steps 20 up to step 10, 30 up to step 25, then 40)"
    assert length_history([{"start_step": 0, "end_step": 5, "steps": None}], 8) is None  # an older summary
