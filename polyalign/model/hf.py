"""Hugging Face checkpoints in and out: config.json plus *.safetensors (single file or sharded with an
index), read and written with safetensors' NumPy backend; torch is never needed."""

from __future__ import annotations

import hashlib
import json
import os
import sys
import uuid
from collections.abc import Iterator

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
from etils import epath
from flax import nnx, traverse_util
from jax.sharding import Mesh
from safetensors import SafetensorError, safe_open
from safetensors.numpy import load, save

from polyalign.core.errors import CheckpointError
from polyalign.core.paths import as_path, is_uri
from polyalign.mesh import parallel
from polyalign.model.architecture import (
    ModelConfig,
    ModelConfigError,
    from_hf_config,
    text_config,
    to_hf_config,
)
from polyalign.model.transformer import Transformer, abstract_model
from polyalign.tokens.tokenizer import Tokenizer, load_tokenizer

INDEX_FILE = "model.safetensors.index.json"
SINGLE_FILE = "model.safetensors"
# Buffers some exporters write that carry no weights.
_IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)
# Where the language model's tensors live: a causal LM's own "model.", or inside a multimodal Gemma 3
# (transformers 5 writes model.language_model., the published 4.x files language_model.model.).
_LANGUAGE_MODEL_PREFIXES = ("model.", "model.language_model.", "language_model.model.")
# The image side of a multimodal checkpoint, which a text model leaves alone.
_VISION_PREFIXES = ("vision_tower.", "multi_modal_projector.", "model.vision_tower.", "model.multi_modal_projector.")
_DTYPES = {"float32": np.float32, "bfloat16": ml_dtypes.bfloat16, "float16": np.float16}


def _tensor_names(cfg: ModelConfig) -> Iterator[tuple[str, str, bool]]:
    """(our parameter path, Hugging Face name with {i} for the layer, transpose?) for every tensor.

    torch Linear weights are (out, in); nnx kernels are (in, out), hence the transposes.
    """
    yield "embed_tokens.embedding", "model.embed_tokens.weight", False
    projections = [("self_attn", n) for n in ("q_proj", "k_proj", "v_proj", "o_proj")]
    projections += [("mlp", n) for n in ("gate_proj", "up_proj", "down_proj")]
    for block, name in projections:
        yield f"layers.{block}.{name}.kernel", f"model.layers.{{i}}.{block}.{name}.weight", True
    if cfg.attention_bias:
        for name in ("q_proj", "k_proj", "v_proj"):
            yield f"layers.self_attn.{name}.bias", f"model.layers.{{i}}.self_attn.{name}.bias", False
    norms = ["input_layernorm", "post_attention_layernorm"]
    if cfg.is_gemma:
        norms += ["pre_feedforward_layernorm", "post_feedforward_layernorm"]
    for name in norms:
        yield f"layers.{name}.weight", f"model.layers.{{i}}.{name}.weight", False
    if cfg.qk_norm:
        for name in ("q_norm", "k_norm"):
            yield f"layers.self_attn.{name}.weight", f"model.layers.{{i}}.self_attn.{name}.weight", False
    yield "norm.weight", "model.norm.weight", False
    if not cfg.tie_embeddings:
        yield "lm_head.kernel", "lm_head.weight", True


def _safetensors_files(path: epath.Path) -> list[epath.Path]:
    index = path / INDEX_FILE
    if index.is_file():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
        except (json.JSONDecodeError, KeyError) as err:
            raise CheckpointError(f"{index}: not a safetensors index ({err})") from None
        names = sorted(set(weight_map.values()))
        outside = [n for n in names if not isinstance(n, str) or "/" in n or "\\" in n or n in ("", ".", "..")]
        if outside:
            # a shard is a file name beside the index; a path could read any file the user can
            raise CheckpointError(f"{index}: shard names must be file names in {path}, not paths: "
                                  f"{', '.join(map(str, outside[:3]))}")
        files = [path / name for name in names]
        absent = [f.name for f in files if not f.is_file()]
        if absent:
            raise CheckpointError(f"{index}: lists shards that are not in {path}: {', '.join(absent)}")
        return files
    if (path / SINGLE_FILE).is_file():
        return [path / SINGLE_FILE]
    files = sorted(path.glob("*.safetensors"))
    if not files:
        raise CheckpointError(f"{path}: no *.safetensors files (polyalign reads safetensors checkpoints only)")
    return files


# How many tensors of a checkpoint its fingerprint reads from, and how much of each.
_FINGERPRINT_TENSORS = 64
_FINGERPRINT_BYTES = 4096


def checkpoint_fingerprint(path: str | os.PathLike) -> str:
    """A digest of what a checkpoint folder holds, for telling whether `init` was replaced since a run
    started from it: its config.json, every safetensors file's name, size and header, and 4 KiB from the
    middle of each of up to 64 tensors spread over the header's order. Another training or export changes
    the weights of every tensor it trains (a merged adapter, those of q_proj and v_proj), so the sample sees
    it; hashing every byte would read a 15 GB checkpoint, or download it from a bucket, on every start."""
    folder = as_path(path)
    digest = hashlib.sha256((folder / "config.json").read_bytes() if (folder / "config.json").is_file() else b"")
    for file in _safetensors_files(folder):
        with file.open("rb") as handle:
            size = int.from_bytes(handle.read(8), "little")
            header = handle.read(size)
            digest.update(file.name.encode() + b"\0" + header)
            try:
                spans = [v["data_offsets"] for k, v in json.loads(header).items() if k != "__metadata__"]
            except (json.JSONDecodeError, AttributeError, KeyError, TypeError):
                continue  # not a safetensors file: loading it says so; its bytes so far are in the digest
            step = max(len(spans) // _FINGERPRINT_TENSORS, 1)
            for begin, end in sorted(spans[::step][:_FINGERPRINT_TENSORS]):
                middle = 8 + size + (begin + end) // 2
                handle.seek(max(middle - _FINGERPRINT_BYTES // 2, 8 + size + begin))
                digest.update(handle.read(min(_FINGERPRINT_BYTES, end - begin)))
    return "sha256:" + digest.hexdigest()


def read_hf_config(path: str | os.PathLike) -> dict:
    config_path = as_path(path) / "config.json"
    if not config_path.is_file():
        if not as_path(path).exists():
            raise CheckpointError(f"{path}: no such checkpoint folder")
        raise CheckpointError(f"{path}: no config.json; a Hugging Face checkpoint directory is expected")
    try:
        config = json.loads(config_path.read_text())
    except json.JSONDecodeError as err:
        raise CheckpointError(f"{config_path}: line {err.lineno}: {err.msg}") from None
    model = as_path(path) / "model"
    if isinstance(config, dict) and "model_type" not in config and (model / "config.json").is_file():
        # RUN/config.json is a training run's settings: the natural slip of giving the run for its model
        raise CheckpointError(f"{path} is a training run's folder (its config.json holds the run's settings); "
                              f"its model is {model}")
    return config


def checkpoint_config(path: str | os.PathLike, **policy) -> ModelConfig:
    """The model a checkpoint folder's config.json describes, its weights unread: commands check an
    architecture polyalign does not build, and the vocabulary, before they load anything."""
    try:
        return from_hf_config(read_hf_config(path), where=str(as_path(path) / "config.json"), **policy)
    except ModelConfigError as err:
        raise CheckpointError(str(err)) from None


def check_vocabulary(path: str | os.PathLike, tokenizer_size: int, tokenizer_name: str, fix: str) -> None:
    """Refuses a checkpoint whose embedding has fewer rows than its tokenizer has ids (`tokenizer_size`):
    an id past the last row reads no embedding, so every logit from there on is NaN, and generation
    wrote "!!!!" and preference training skipped NaN steps, each exiting 0. `fix` says what to do."""
    vocab = text_config(read_hf_config(path)).get("vocab_size")
    if isinstance(vocab, int) and tokenizer_size > vocab:
        raise CheckpointError(f"{as_path(path) / 'config.json'}: the model's vocabulary holds {vocab} ids, fewer "
                              f"than the {tokenizer_size} of {tokenizer_name}: ids from {vocab} on have no "
                              f"embedding (every logit would be NaN); {fix}")


def checkpoint_tokenizer(path: str | os.PathLike, model_required: bool = True) -> Tokenizer:
    """A checkpoint folder's own tokenizer, refused where its ids outrun the model's vocabulary. The
    folder's config.json is read first, so that a folder that is no checkpoint (or one of an architecture
    polyalign does not build) is said as such; without `model_required`, a folder without config.json is
    a tokenizer's alone (prompts and show read only the tokenizer), with no model to outrun."""
    if model_required:
        checkpoint_config(path)
    elif not as_path(path).exists():
        raise CheckpointError(f"{path}: no such checkpoint folder")
    tokenizer = load_tokenizer(path)
    if (as_path(path) / "config.json").is_file():
        check_vocabulary(path, tokenizer.vocab_size, str(tokenizer.path),
                         "the folder's tokenizer files are another model's: put the checkpoint's own beside its "
                         "config.json")
    return tokenizer


def _layer_names(cfg: ModelConfig, hf_name: str) -> list[str]:
    """The checkpoint names behind one of our parameters: one per layer for a stacked tensor."""
    return [hf_name.format(i=i) for i in range(cfg.num_layers)] if "{i}" in hf_name else [hf_name]


class _Tensors:
    """Every tensor of a checkpoint's safetensors files by name, read when asked for: local files are
    opened lazily (a parameter group at a time is on the host), a bucket's files are read whole."""

    def __init__(self, files: list[epath.Path]):
        self._loaded: dict[str, np.ndarray] = {}
        self._where = {}  # name -> open safetensors file
        self._shapes: dict[str, tuple[int, ...]] = {}
        for file in files:
            try:
                if is_uri(file):
                    tensors = load(file.read_bytes())
                    self._loaded.update(tensors)
                    self._shapes.update({name: a.shape for name, a in tensors.items()})
                    continue
                handle = safe_open(os.fspath(file), "np")
            except SafetensorError as err:
                raise CheckpointError(f"{file}: not a readable safetensors file ({err}); a truncated download or "
                                      "an interrupted save leaves one like this: copy or save it again") from None
            for name in handle.keys():
                self._where[name] = handle
                self._shapes[name] = tuple(handle.get_slice(name).get_shape())

    def names(self) -> set[str]:
        return set(self._shapes)

    def shape(self, name: str) -> tuple[int, ...]:
        return self._shapes[name]

    def __getitem__(self, name: str) -> np.ndarray:
        if name in self._loaded:
            return self._loaded[name]
        return self._where[name].get_tensor(name)


def load_hf_checkpoint(path: str | os.PathLike, dtype: str = "float32", compute_dtype: str | None = None,
                       mesh: Mesh | None = None, **policy) -> Transformer:
    """Loads a Llama, Qwen2, Qwen3, Gemma 2 or Gemma 3 checkpoint directory into a Transformer (of a
    multimodal Gemma 3, its language model).

    `dtype` is the parameter dtype, `compute_dtype` the matmul/activation dtype (default: `dtype`);
    other keywords (scan_layers, remat, attention_impl) set the execution policy. Every process reads
    the checkpoint one parameter group at a time. With a `mesh`, each parameter goes straight to its
    sharding over the mesh (from its logical axis names), each device receiving only its shard: a model
    larger than one device loads without ever being whole on one. Without, parameters land on the
    default device.
    """
    path = as_path(path)
    if dtype not in _DTYPES:
        raise CheckpointError(f"dtype {dtype!r} is not one of {', '.join(_DTYPES)}")
    cfg = checkpoint_config(path, param_dtype=dtype, dtype=compute_dtype or dtype, **policy)
    tensors = _Tensors(_safetensors_files(path))
    available = tensors.names()
    prefix = next((p for p in _LANGUAGE_MODEL_PREFIXES if f"{p}embed_tokens.weight" in available), "model.")
    names = [(ours, prefix + hf_name.removeprefix("model.") if hf_name.startswith("model.") else hf_name, transpose)
             for ours, hf_name, transpose in _tensor_names(cfg)]

    model = abstract_model(cfg)
    graphdef, state = nnx.split(model)
    targets = traverse_util.flatten_dict(nnx.to_pure_dict(state), sep=".")
    shardings = (traverse_util.flatten_dict(nnx.to_pure_dict(parallel.param_shardings(state, mesh)), sep=".")
                 if mesh is not None else None)
    missing, mismatched, used = [], [], set()
    for ours, hf_name, transpose in names:
        expected_shape = targets[ours].shape[1:] if "{i}" in hf_name else targets[ours].shape
        for name in _layer_names(cfg, hf_name):
            if name not in available:
                missing.append(name)
                continue
            used.add(name)
            shape = tensors.shape(name)[::-1] if transpose else tensors.shape(name)
            if shape != expected_shape:
                mismatched.append(f"{name} {tensors.shape(name)} "
                                  f"(expected {expected_shape[::-1] if transpose else expected_shape})")
    unexpected = sorted(n for n in available - used if not n.endswith(_IGNORED_SUFFIXES)
                        and not (cfg.tie_embeddings and n == "lm_head.weight")
                        and not (prefix != "model." and n.startswith(_VISION_PREFIXES)))
    problems = []
    if missing:
        problems.append(f"missing tensors: {', '.join(_summarise(missing))}")
    if mismatched:
        problems.append(f"wrong shapes: {', '.join(mismatched)}")
    if unexpected:
        problems.append(f"tensors this {cfg.family} model has no place for: {', '.join(_summarise(unexpected))}")
    if problems:
        raise CheckpointError(f"{path}: " + "; ".join(problems))
    values = {}
    for ours, hf_name, transpose in names:
        # One parameter group on the host at a time (all layers of a stacked tensor).
        arrays = [tensors[name].T if transpose else tensors[name] for name in _layer_names(cfg, hf_name)]
        host = (np.stack(arrays) if "{i}" in hf_name else arrays[0]).astype(targets[ours].dtype)
        if shardings is None:
            values[ours] = jnp.asarray(host)
        else:
            values[ours] = jax.make_array_from_callback(host.shape, shardings[ours], lambda index, h=host: h[index])
    nnx.replace_by_pure_dict(state, traverse_util.unflatten_dict(values, sep="."))
    return nnx.merge(graphdef, state)


def _summarise(names: list[str], limit: int = 12) -> list[str]:
    return names[:limit] + ([f"... {len(names) - limit} more"] if len(names) > limit else [])


def hf_state_dict(model: Transformer, dtype: str | None = None) -> dict[str, np.ndarray]:
    """The model's parameters under Hugging Face names and layouts, as host arrays."""
    cfg = model.config
    flat = traverse_util.flatten_dict(nnx.to_pure_dict(nnx.state(model, nnx.Param)), sep=".")
    out = {}
    for ours, hf_name, transpose in _tensor_names(cfg):
        array = np.asarray(flat[ours])
        if dtype is not None:
            array = array.astype(_DTYPES[dtype])
        if "{i}" in hf_name:
            for i in range(cfg.num_layers):
                out[hf_name.format(i=i)] = np.ascontiguousarray(array[i].T if transpose else array[i])
        else:
            out[hf_name] = np.ascontiguousarray(array.T if transpose else array)
    return out


def remove_unfinished_saves(path: epath.Path) -> None:
    """Removes what a save of `path` stopped outright (SIGKILL, a preempted host) left beside it, which its own
    cleanup never ran for: staging folders (up to a whole model's shards) and the retired copy of a model being
    replaced. One writer saves a path at a time (a run's output lock), so none of them is still being written."""
    for left in [*path.parent.glob(f".{path.name}.staging-*"), path.parent / f".{path.name}.old"]:
        if left.exists():
            left.rmtree()
            print(f"note: {left} removed: an unfinished save of {path.name} (a process stopped while writing it)",
                  file=sys.stderr, flush=True)


def save_hf_checkpoint(model: Transformer, path: str | os.PathLike, *, dtype: str | None = None,
                       max_shard_bytes: int | None = None, overwrite: bool = False,
                       extra_files: dict[str, str | bytes] | None = None) -> epath.Path:
    """Writes config.json and safetensors that transformers' from_pretrained loads.

    The directory is written next to its destination and renamed into place, so an interrupted save
    never leaves a half-written checkpoint where a good one was. An existing checkpoint is replaced
    only with `overwrite=True`. `extra_files` (name -> content) adds e.g. tokenizer files.
    """
    path = as_path(path)
    if path.exists() and any(path.iterdir()) and not overwrite:
        raise CheckpointError(f"{path}: exists and is not empty; pass overwrite=True to replace it")
    dtype = dtype or model.config.param_dtype
    tensors = hf_state_dict(model, dtype)
    path.parent.mkdir(parents=True, exist_ok=True)
    remove_unfinished_saves(path)
    staging = path.parent / f".{path.name}.staging-{uuid.uuid4().hex[:8]}"
    staging.mkdir()
    try:
        (staging / "config.json").write_text(json.dumps(to_hf_config(model.config, dtype), indent=2) + "\n")
        _write_shards(tensors, staging, max_shard_bytes)
        for name, content in (extra_files or {}).items():
            target = staging / name
            target.write_bytes(content) if isinstance(content, bytes) else target.write_text(content)
        if path.exists():
            retired = path.parent / f".{path.name}.old"  # none there: remove_unfinished_saves took a stopped save's
            path.rename(retired)
            staging.rename(path)
            retired.rmtree()
        else:
            staging.rename(path)
    finally:
        if staging.exists():
            staging.rmtree()
    return path


def _write_shards(tensors: dict[str, np.ndarray], directory: epath.Path, max_shard_bytes: int | None) -> None:
    metadata = {"format": "pt"}  # transformers refuses safetensors files without a known format tag
    total = sum(a.nbytes for a in tensors.values())
    if not max_shard_bytes or total <= max_shard_bytes:
        (directory / SINGLE_FILE).write_bytes(save(tensors, metadata=metadata))
        return
    shards: list[dict[str, np.ndarray]] = [{}]
    size = 0
    for name, array in tensors.items():
        if shards[-1] and size + array.nbytes > max_shard_bytes:
            shards.append({})
            size = 0
        shards[-1][name] = array
        size += array.nbytes
    weight_map = {}
    for k, shard in enumerate(shards, start=1):
        file = f"model-{k:05d}-of-{len(shards):05d}.safetensors"
        (directory / file).write_bytes(save(shard, metadata=metadata))
        weight_map.update({name: file for name in shard})
    index = {"metadata": {"total_size": total}, "weight_map": weight_map}
    (directory / INDEX_FILE).write_text(json.dumps(index, indent=2) + "\n")
