"""Shared by the training tests and tests/train_worker.py (which runs them under other device counts)."""

from pathlib import Path

import jax
import numpy as np
from flax import traverse_util
from safetensors.numpy import save_file

from polyalign.inputs import pipeline
from polyalign.inputs.built import read_manifest
from polyalign.mesh import parallel
from polyalign.model import create_model
from polyalign.train.sft import SftObjective
from polyalign.train.trainer import LoopConfig, OptimizerConfig, Trainer
from tests.conftest import tiny_model_config


def first_batch(run: Path, global_batch: int, micro_batches: int, seed: int = 0):
    manifest = read_manifest(run)
    layout = pipeline.Layout(global_batch, micro_batches, jax.process_index(), jax.process_count())
    source = pipeline.open_split(run, "train")
    dataset = pipeline.train_batches(source, layout, 1, manifest["options"]["max_length"], manifest["pad_id"], seed)
    return next(pipeline.iterate(dataset)), manifest


def adapted_model(vocab_size: int, rank: int = 4, targets=("q", "k", "v", "o", "gate", "up", "down")):
    """The tiny model with adapters whose B is drawn too (a fresh B is zero, which would leave A
    without a gradient): every adapter parameter then has one to check."""
    import jax.numpy as jnp
    from flax import nnx

    from polyalign.model.architecture import LoraConfig
    from polyalign.model.lora import add_adapters

    model = add_adapters(create_model(tiny_model_config(vocab_size), seed=0),
                         LoraConfig(rank=rank, alpha=8.0, targets=tuple(targets)), seed=1)
    graphdef, adapters, rest = nnx.split(model, nnx.LoRAParam, ...)
    leaves, treedef = jax.tree.flatten(adapters)
    keys = jax.random.split(jax.random.key(7), len(leaves))
    drawn = [x + 0.05 * jax.random.normal(k, x.shape, jnp.float32) for x, k in zip(leaves, keys)]
    return nnx.merge(graphdef, jax.tree.unflatten(treedef, drawn), rest)


def gradients_of_first_batch(run: Path, out: Path, micro_batches: int, global_batch: int,
                             parallel_sizes=(-1, 1, 1), lora_rank: int = 0) -> dict:
    """The accumulated gradient and loss of the first global batch, saved to `out` (safetensors); of
    the adapters only with `lora_rank`."""
    batch, manifest = first_batch(Path(run), global_batch, micro_batches)
    if lora_rank:
        model = adapted_model(manifest["vocab_size"], lora_rank)
    else:
        model = create_model(tiny_model_config(manifest["vocab_size"]), seed=0)
    mesh = parallel.make_mesh(parallel.ParallelConfig(*parallel_sizes))
    trainer = Trainer(model, SftObjective(len(manifest["buckets"])), OptimizerConfig(),
                      LoopConfig(steps=1, global_batch=global_batch, micro_batches=micro_batches), mesh)
    grads, loss, sums = trainer.gradients(batch)
    flat = traverse_util.flatten_dict(jax.device_get(nnx_pure(grads)), sep=".")
    arrays = {name: np.asarray(value, np.float32) for name, value in flat.items()}
    arrays["loss"] = np.asarray(loss, np.float32).reshape(1)
    save_file(arrays, str(out))
    return arrays


def nnx_pure(state):
    from flax import nnx

    return nnx.to_pure_dict(state)


def sharded_generation_matches(out: Path, parallel_sizes) -> None:
    """Greedy generation with the Gemma 2 fixture on a sharded mesh equals unsharded generation, for the
    static sampler and for the engine (sampled requests too); writes what matched to `out`."""
    import json

    from polyalign.generate.engine import Engine, EngineConfig, Request
    from polyalign.generate.sampling import Sampler, SamplingConfig
    from polyalign.model import load_hf_checkpoint
    from tests.conftest import FIXTURES

    model = load_hf_checkpoint(FIXTURES / "hf" / "gemma2")
    rng = np.random.default_rng(0)
    prompts = [rng.integers(3, 256, n).astype(np.int32) for n in (5, 17, 11)]
    config = SamplingConfig(max_new_tokens=12)
    mesh = parallel.make_mesh(parallel.ParallelConfig(*parallel_sizes))
    plain = Sampler(model, [], 0, config).generate(prompts)
    sharded = Sampler(model, [], 0, config, mesh=mesh)
    # The engine: greedy and sampled requests, more of them than slots, on the mesh and on one device.
    engine_config = EngineConfig(slots=4, page_size=4, max_sequence=64, prefill_chunk=8, steps_per_sync=4)
    from polyalign.generate import engine as engine_module

    requests = [Request(p, SamplingConfig(12, temperature=t), seed=i) for i, p in enumerate(prompts * 3)
                for t in (0.0, 1.0)]
    # penalised ones beside them: their [slots, vocab] histories are sharded over the slots too
    requests += [Request(p, SamplingConfig(12, temperature=t, repetition_penalty=1.3, frequency_penalty=0.5,
                                           min_p=0.05), seed=i) for i, p in enumerate(prompts) for t in (0.0, 1.0)]
    engine_plain = Engine(model, [], engine_config).generate(requests)
    compiled = engine_module._decode._cache_size()
    engine_sharded = Engine(model, [], engine_config, mesh=mesh).generate(requests)
    Path(out).write_text(json.dumps({"equal": sharded.generate(prompts) == plain, "rows": len(plain),
                                     "engine_equal": engine_sharded == engine_plain,
                                     # the histories come back as they went: one decoding program, not two
                                     "decode_programs": engine_module._decode._cache_size() - compiled,
                                     "engine_greedy_equals_sampler": [c[0].tokens for c in engine_plain[:6:2]]
                                     == [tokens for tokens, _ in plain]}))
