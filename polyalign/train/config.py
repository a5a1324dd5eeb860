"""The configuration of every training method, in one schema.

Every method's config has the same sections (`method`, `init`, `model`, `data`, `optimizer`,
`train`, `parallel`) with the same key names, plus the method's own hyper-parameters at the top
level. A key means the same thing for every method; where a method has its own default (HDPO's
learning rate, the critic's sequence length) its config says so in its field's default.

Keys that older releases kept elsewhere (HDPO's flat `dtype`, `max_length`, ...; the critic's
`epochs`, `max_tokens`, ...) still load, with a one-line notice naming the new key.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass, field

from polyalign.mesh.shape import ParallelConfig


@dataclass(frozen=True)
class LoraSection:
    """`model.lora`: train low-rank adapters on a frozen base instead of every weight (rank 0: off).
    The adapted update is (alpha / rank) B A; B starts at zero. docs/lora.md says when to choose it."""

    rank: int = 0  # 0: full fine-tuning; 8-64 are usual
    alpha: float = 32.0
    targets: list[str] = field(default_factory=lambda: ["q", "k", "v", "o", "gate", "up", "down"])
    init: str = "kaiming"  # A drawn as PEFT does: kaiming (uniform) or gaussian
    dropout: float = 0.0  # on the adapters' input in training steps (PEFT's lora_dropout)

    def to_model(self):
        """The model's LoraConfig, or None for full fine-tuning."""
        from polyalign.model.architecture import LoraConfig

        if not self.rank:
            return None
        return LoraConfig(rank=self.rank, alpha=self.alpha, targets=tuple(self.targets), init=self.init,
                          dropout=self.dropout)


@dataclass(frozen=True)
class ModelSection:
    preset: str = "tiny"  # architecture for a model trained from scratch (ignored with `init`)
    dtype: str = "float32"  # compute dtype; parameters stay float32
    export_dtype: str | None = None  # weights of OUT/model: float32, bfloat16, float16; None: model.dtype
    scan_layers: bool = True
    remat: str = "none"  # none | full | dots
    attention_impl: str | None = None  # xla, cudnn, splash; None picks per backend (packed rows use XLA)
    logprob_chunk: int = 0  # > 0: log-probs in sequence blocks, never full [B, T, V] logits
    seed: int = 0  # initialisation of what is trained from scratch (the model, the critic's head, adapters)
    lora: LoraSection = field(default_factory=LoraSection)
    # nf4 | int8 (with model.lora: QLoRA): the frozen base's layer projections stored in 4.25 or 8.25
    # bits per weight and dequantised when used; null keeps them in model.dtype.
    quantize: str | None = None


@dataclass(frozen=True)
class DataSection:
    dir: str | None = None  # the run directory (RUN): build/ for SFT, critic/ and stats/ for the others
    # Tokens per sequence. SFT: the build's (`polyalign build --max-length`); preference pairs: each
    # side is cut to it as METHOD section 8 says; the critic: response tokens it encodes.
    max_length: int | None = None
    # Pack several examples (SFT) or whole pairs as trees (preference) into each row; exact, and a step
    # then takes train.global_batch rows.
    pack: bool = False
    eval_batch: int = 32  # sequences per forward-only batch (validation; the critic's encoding)
    eval_limit: int | None = None  # validate on at most this many examples (or pairs)


@dataclass(frozen=True)
class OptimizerConfig:
    lr: float = 1e-3
    warmup_ratio: float = 0.1
    min_lr_ratio: float = 0.0
    weight_decay: float = 0.0
    b1: float = 0.9
    b2: float = 0.999
    eps: float = 1e-8
    clip: float | None = 1.0


TRACKERS = ("tensorboard", "wandb", "trackio")


@dataclass(frozen=True)
class LoopConfig:
    steps: int = 100
    epochs: int | None = None  # where a method knows its epoch size (the critic): steps = epochs x that
    global_batch: int = 16
    micro_batches: int = 1
    seed: int = 0  # data order and the trainer's random stream
    eval_every: int | None = 50  # None: once per epoch
    checkpoint_every: int = 50
    keep_checkpoints: int = 2
    stop_at: int | None = None  # stop after this step as if preempted; the schedule is unchanged
    max_nonfinite: int = 10
    log_every: int = 1
    # Where logged steps go besides OUT/metrics.jsonl: tensorboard, wandb, trackio (the last two are
    # extras; their own offline settings hold), as project `tracker_project`.
    report_to: list[str] = field(default_factory=lambda: ["tensorboard"])
    tracker_project: str = "polyalign"
    # Per-device peak TFLOP/s for MFU; None: the device kind's known bf16 peak (none on CPU: no MFU).
    peak_tflops: float | None = None
    # [first, last]: a JAX profiler trace of these steps in OUT/profile (TensorBoard's profile tab, Perfetto)
    profile_steps: list[int] | None = None
    # Seconds a step, an evaluation or a checkpoint may go without progress before the job prints where
    # each process is and exits (code 3); the first of each kind may take 4 times as long (compiling).
    # None: 300 when several processes run, else off; 0: off.
    hang_timeout: float | None = None
    # Seconds without a sign of life from another process before this one reports it lost and exits (code 4).
    peer_timeout: float = 30.0


WEIGHTINGS = ("bucket", "uniform", "adaptive")
NORMALIZATIONS = ("global", "microbatch")
PREFERENCE_METHODS = ("hdpo", "dpo", "ipo", "robust_dpo", "ln_dpo", "simpo", "orpo", "kto")
DISTANCE_FEATURES = ("nonconstant", "all")
PROFILES = ("context", "oracle", "none")
REFERENCES = ("precomputed", "in_step")


@dataclass(frozen=True)
class AdaptiveSection:
    """`weighting: adaptive`: bucket weights that follow the buckets' losses (group DRO / DoReMi style)."""

    step_size: float = 0.1  # eta in q_b <- q_b exp(eta (L_b - mean L)) after every step
    floor: float = 0.1  # share of the uniform distribution mixed into q after each update


@dataclass(frozen=True)
class SftConfig:
    method: str = "sft"
    init: str | None = None  # a Hugging Face checkpoint directory; None trains model.preset from scratch
    # bucket (Bucket-SFT weights from the build) | uniform (plain SFT) | adaptive (from the build's
    # weights, then following the buckets' losses; see `adaptive`)
    weighting: str = "bucket"
    # `microbatch` normalises inside each micro-batch, as the reference code did; only for comparison.
    weight_normalization: str = "global"
    # Train `init` on a build encoded with another tokenizer (refused by default: the ids would stand
    # for other tokens, and the export would ship the build's tokenizer on the init's weights).
    allow_tokenizer_mismatch: bool = False
    adaptive: AdaptiveSection = field(default_factory=AdaptiveSection)
    model: ModelSection = field(default_factory=ModelSection)
    data: DataSection = field(default_factory=DataSection)
    optimizer: OptimizerConfig = field(default_factory=OptimizerConfig)
    train: LoopConfig = field(default_factory=LoopConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)


@dataclass(frozen=True)
class OnPolicySection:
    """How the policy answers the training prompts anew before each round after the first (`rounds`)."""

    max_new_tokens: int = 128
    temperature: float = 0.8
    top_p: float = 0.9
    # retrain the critic head on each round's pairs (people vs the current policy) before scoring them;
    # otherwise the first critic scores every round
    refresh_critic: bool = False


@dataclass(frozen=True)
class PreferenceConfig:
    method: str = "hdpo"  # hdpo | dpo | ipo | robust_dpo | ln_dpo | simpo | orpo | kto
    init: str | None = None  # the SFT checkpoint: the initial policy and the frozen reference
    pairs: str | None = None  # scored train pairs (default RUN/critic/train_pairs.jsonl)
    val_pairs: str | None = None  # scored validation pairs (default RUN/critic/val_pairs.jsonl)
    profile: str = "context"
    beta: float = 0.1
    lambda_dist: float = 0.1
    gamma_ftx: float = 0.05
    label_smoothing: float = 0.0  # cDPO / SimPO smoothing; robust_dpo: the assumed label-flip rate (< 0.5)
    # Add HDPO's pair weights, critic distance (lambda_dist) and SFT anchor (gamma_ftx) to a method
    # other than hdpo (which always has them), e.g. method=simpo hdpo_terms=true.
    hdpo_terms: bool = False
    simpo_gamma: float = 0.5  # SimPO's target reward margin
    kto_desirable_weight: float = 1.0  # KTO: weight of the human (desirable) responses
    kto_undesirable_weight: float = 1.0  # KTO: weight of the model's own (undesirable) samples
    # The reference log-probs: `precomputed` once before training (any model), or `in_step`: with
    # model.lora, the base with the adapters off in every step (no pass over the pairs first, one more
    # forward per step).
    reference: str = "precomputed"
    # At every evaluation, sample the policy (greedy, drift_new_tokens) on the first drift_prompts
    # validation prompts and log length ratio, support distance and critic score per bucket; 0: off.
    drift_prompts: int = 32
    drift_new_tokens: int = 64
    # > 1: on-policy rounds (polyalign/train/rounds.py), train.steps steps each, OUT/round-<r>/ per round
    rounds: int = 1
    on_policy: OnPolicySection = field(default_factory=OnPolicySection)
    model: ModelSection = field(default_factory=ModelSection)
    data: DataSection = field(default_factory=lambda: DataSection(max_length=256, eval_batch=8))
    optimizer: OptimizerConfig = field(default_factory=lambda: OptimizerConfig(lr=5e-7, weight_decay=0.0))
    train: LoopConfig = field(default_factory=lambda: LoopConfig(global_batch=8))
    parallel: ParallelConfig = field(default_factory=ParallelConfig)

    def pair_files(self) -> dict[str, str]:
        """{"pairs": ..., "val_pairs": ...}: as set, else the scored pairs in RUN/critic/."""
        from polyalign.core.yaml_config import ConfigError

        files = {}
        for key, name in (("pairs", "train_pairs.jsonl"), ("val_pairs", "val_pairs.jsonl")):
            files[key] = getattr(self, key)
            if files[key] is None:
                if self.data.dir is None:
                    raise ConfigError(f"set {key}= or data.dir=RUN (whose critic/ holds the scored pairs)")
                files[key] = f"{str(self.data.dir).rstrip('/')}/critic/{name}"
        return files


@dataclass(frozen=True)
class CriticConfig:
    method: str = "critic"
    init: str | None = None  # the SFT checkpoint: the frozen encoder
    pairs: str | None = None  # train pairs (JSONL from `polyalign pairs`)
    val_pairs: str | None = None  # held-out pairs for validation and the ranking accuracy
    references: str | None = None  # default RUN/stats/references.json
    # nonconstant: the support distance skips features constant in the bucket's human reference
    # (see references.support_distance); all: every feature, as the reference code did.
    distance_features: str = "nonconstant"
    # per_token: count features as per-token rates and the length by its position in the bucket's own
    # distribution, so length alone is neither rewarded nor punished; raw: METHOD section 5 as the
    # reference code computes it (see references.support_distance).
    distance_counts: str = "per_token"
    pair_batch: int = 8  # ranking pairs per step (train.global_batch counts regression rows)
    dropout: float = 0.1
    model: ModelSection = field(default_factory=lambda: ModelSection(seed=42))
    data: DataSection = field(default_factory=lambda: DataSection(max_length=512, eval_batch=16))
    optimizer: OptimizerConfig = field(default_factory=lambda: OptimizerConfig(
        lr=1e-3, warmup_ratio=0.0, weight_decay=0.0, clip=1.0))
    train: LoopConfig = field(default_factory=lambda: LoopConfig(
        epochs=3, global_batch=16, seed=42, eval_every=None, log_every=10))
    parallel: ParallelConfig = field(default_factory=ParallelConfig)


# Old key -> its place in the shared schema (one old key may fill several). CHANGELOG.md lists them with
# the release that removes them.
REMOVED_IN = "0.2.0"
DEPRECATED_KEYS: dict[type, dict[str, tuple[str, ...]]] = {
    PreferenceConfig: {
        "dtype": ("model.dtype",), "remat": ("model.remat",), "attention_impl": ("model.attention_impl",),
        "logprob_chunk": ("model.logprob_chunk",), "max_length": ("data.max_length",),
    },
    CriticConfig: {
        "max_tokens": ("data.max_length",), "epochs": ("train.epochs",), "regression_batch": ("train.global_batch",),
        "encode_batch": ("data.eval_batch",), "seed": ("model.seed", "train.seed"),
    },
}


def deprecated_targets(config_class: type, key: str, where: str) -> tuple[str, ...] | None:
    """The new keys behind an old one, after a one-line notice on stderr; None for a current key."""
    targets = DEPRECATED_KEYS.get(config_class, {}).get(key)
    if targets is not None:
        print(f"polyalign: {where}: key {key!r} is deprecated and will be removed in polyalign {REMOVED_IN}; "
              f"use {' and '.join(repr(t) for t in targets)}", file=sys.stderr)
    return targets
