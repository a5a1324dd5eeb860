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
from typing import ClassVar

from polyalign.core.paths import as_path
from polyalign.core.ranges import COUNT, FRACTION, NON_NEGATIVE, POSITIVE, PROBABILITY, SEED, Range
from polyalign.core.yaml_config import ConfigError, setting
from polyalign.mesh.shape import ParallelConfig


@dataclass(frozen=True)
class LoraSection:
    """`model.lora`: train low-rank adapters on a frozen base instead of every weight (rank 0: off).
    The adapted update is (alpha / rank) B A; B starts at zero. docs/lora.md says when to choose it."""

    rank: int = setting(0, range=NON_NEGATIVE, help="adapter rank; 0: full fine-tuning; 8-64 are usual")
    alpha: float = setting(32.0, range=POSITIVE, help="the update is scaled by alpha / rank")
    targets: list[str] = field(default_factory=lambda: ["q", "k", "v", "o", "gate", "up", "down"])
    init: str = "kaiming"  # A drawn as PEFT does: kaiming (uniform) or gaussian
    dropout: float = setting(0.0, range=FRACTION,
                             help="on the adapters' input in training steps (PEFT's lora_dropout)")

    def to_model(self):
        """The model's LoraConfig, or None for full fine-tuning."""
        # heavy: polyalign.model imports jax; --help reads this module
        from polyalign.model.architecture import LoraConfig

        if not self.rank:
            return None
        return LoraConfig(rank=self.rank, alpha=self.alpha, targets=tuple(self.targets), init=self.init,
                          dropout=self.dropout)


@dataclass(frozen=True)
class ModelSection:
    preset: str = "tiny"  # architecture for a model trained from scratch (ignored with `init`)
    dtype: str = "auto"  # compute dtype, auto: bfloat16 on GPU/TPU, float32 on CPU; parameters stay float32
    export_dtype: str | None = None  # weights of OUT/model: float32, bfloat16, float16; None: model.dtype
    scan_layers: bool = True
    remat: str = "none"  # none | full | dots
    attention_impl: str | None = None  # xla, cudnn, splash; None picks per backend (docs/model.md); decoding: XLA
    logprob_chunk: int = setting(0, range=NON_NEGATIVE,
                                 help="> 0: log-probs in sequence blocks, never full [B, T, V] logits")
    seed: int = setting(0, range=SEED, help="initialisation of what is trained from scratch (the model, the "
                                            "critic's head, adapters)")
    lora: LoraSection = field(default_factory=LoraSection)
    # nf4 | int8 (with model.lora: QLoRA): the frozen base's layer projections stored in 4.25 or 8.25
    # bits per weight and dequantised when used; null keeps them in model.dtype.
    quantize: str | None = None


@dataclass(frozen=True)
class DataSection:
    dir: str | None = None  # the run directory (RUN): build/ for SFT, critic/ and stats/ for the others
    max_length: int | None = setting(
        None, range=Range(1, optional=True),
        help="tokens per sequence. SFT: the build's (`polyalign build --max-length`); preference pairs: each "
             "side is cut to it; the critic: response tokens it encodes")
    # Pack several examples (SFT) or whole pairs as trees (preference) into each row; exact, and a step
    # then takes train.global_batch rows.
    pack: bool = False
    eval_batch: int = setting(32, range=COUNT,
                              help="sequences per forward-only batch (validation; the critic's encoding)")
    eval_limit: int | None = setting(None, range=Range(1, optional=True),
                                     help="validate on at most this many examples (or pairs), taken from "
                                          "every bucket in turn")


@dataclass(frozen=True)
class OptimizerConfig:
    lr: float = setting(1e-3, range=POSITIVE, help="peak learning rate (AdamW, warmup then cosine decay)")
    warmup_ratio: float = setting(0.1, range=PROBABILITY, help="share of the steps spent warming up")
    min_lr_ratio: float = setting(0.0, range=PROBABILITY, help="the rate at the end, as a share of lr")
    weight_decay: float = setting(0.0, range=NON_NEGATIVE,
                                  help="AdamW's decoupled weight decay (never on norms and biases)")
    b1: float = setting(0.9, range=FRACTION, help="AdamW's decay of the gradient's running mean")
    b2: float = setting(0.999, range=FRACTION, help="AdamW's decay of the squared gradient's running mean")
    eps: float = setting(1e-8, range=POSITIVE, help="AdamW's epsilon, added to the root of the second moment")
    clip: float | None = setting(1.0, range=Range(0, low_open=True, optional=True),
                                 help="global gradient-norm clip; null: none")


TRACKERS = ("tensorboard", "wandb", "trackio")


@dataclass(frozen=True)
class LoopConfig:
    steps: int = setting(100, range=COUNT, help="optimizer steps (train.epochs sets it where given)")
    epochs: int | None = setting(None, range=Range(1, optional=True),
                                 help="where a method knows its epoch size: steps = epochs x that")
    global_batch: int = setting(16, range=COUNT, help="examples (or rows, packed) per optimizer step")
    micro_batches: int = setting(1, range=COUNT, help="gradient accumulation: global_batch split into these")
    seed: int = setting(0, range=SEED, help="data order and the trainer's random stream")
    eval_every: int | None = setting(50, range=Range(1, optional=True), help="steps between validations; "
                                                                            "null: once per epoch")
    checkpoint_every: int = setting(50, range=COUNT)
    keep_checkpoints: int = setting(2, range=COUNT)
    stop_at: int | None = setting(None, range=Range(1, optional=True),
                                  help="stop after this step as if preempted; the schedule is unchanged")
    max_nonfinite: int = setting(10, range=NON_NEGATIVE,
                                 help="steps with a non-finite loss skipped before the run stops")
    log_every: int = setting(1, range=COUNT)
    # Where logged steps go besides OUT/metrics.jsonl: tensorboard, wandb, trackio (the last two are
    # extras; their own offline settings hold), as project `tracker_project`.
    report_to: list[str] = field(default_factory=lambda: ["tensorboard"])
    tracker_project: str = "polyalign"
    peak_tflops: float | None = setting(None, range=Range(0, low_open=True, optional=True),
                                        help="per-device peak TFLOP/s for MFU; null: the device kind's known "
                                             "bf16 peak (none on CPU: no MFU)")
    # [first, last]: a JAX profiler trace of these steps in OUT/profile (TensorBoard's profile tab, Perfetto)
    profile_steps: list[int] | None = None
    hang_timeout: float | None = setting(
        None, range=Range(0, optional=True),
        help="seconds a step, an evaluation or a checkpoint may go without progress before the job prints where "
             "each process is and exits (code 3); the first of each kind may take 4 times as long (compiling); "
             "null: 300 when several processes run, else off; 0: off")
    peer_timeout: float = setting(30.0, range=POSITIVE, help="seconds without a sign of life from another process "
                                                             "before this one reports it lost and exits (code 4)")


WEIGHTINGS = ("bucket", "uniform", "adaptive")
NORMALIZATIONS = ("global", "microbatch")
DISTANCE_FEATURES = ("nonconstant", "all")
REFERENCES = ("precomputed", "in_step")


@dataclass(frozen=True)
class AdaptiveSection:
    """`weighting: adaptive`: bucket weights that follow the buckets' losses (group DRO / DoReMi style)."""

    step_size: float = setting(0.1, range=NON_NEGATIVE,
                               help="eta in q_b <- q_b exp(eta (L_b - mean L)) after every step")
    floor: float = setting(0.1, range=PROBABILITY, help="share of the starting distribution (the build's "
                                                        "weights) mixed into q after each update: no bucket falls "
                                                        "below floor times its Bucket-SFT share")


@dataclass(frozen=True)
class SftConfig:
    # its examples are a build's: a key of `polyalign build` given here is pointed there (yaml_config)
    BUILD_SETTINGS: ClassVar[bool] = True
    method: str = "sft"
    init: str | None = setting(None, help="a Hugging Face checkpoint directory; null trains model.preset from "
                                          "scratch")
    weighting: str = setting("bucket", help="bucket (Bucket-SFT weights from the build), uniform (plain SFT) or "
                                            "adaptive (from the build's weights, then following the buckets' "
                                            "losses; see adaptive.*)")
    weight_normalization: str = setting("global", help="microbatch normalises inside each micro-batch, as the "
                                                       "reference code did; only for comparison")
    # Refused by default: the ids would stand for other tokens, and the export would ship the build's
    # tokenizer on the init's weights.
    allow_tokenizer_mismatch: bool = setting(False, help="train init on a build encoded with another tokenizer")
    adaptive: AdaptiveSection = field(default_factory=AdaptiveSection)
    model: ModelSection = field(default_factory=ModelSection)
    data: DataSection = field(default_factory=DataSection)
    optimizer: OptimizerConfig = field(default_factory=OptimizerConfig)
    train: LoopConfig = field(default_factory=LoopConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)


@dataclass(frozen=True)
class OnPolicySection:
    """How the policy answers the training prompts anew before each round after the first (`rounds`)."""

    max_new_tokens: int = setting(128, range=COUNT, help="tokens each new answer may take")
    temperature: float = setting(0.8, range=NON_NEGATIVE, help="sampling temperature; 0: greedy")
    top_p: float = setting(0.9, range=Range(0, 1, low_open=True), help="nucleus sampling's probability mass")
    refresh_critic: bool = setting(False, help="retrain the critic head on each round's pairs (people vs the "
                                               "current policy) before scoring them; otherwise the first critic "
                                               "scores every round")


@dataclass(frozen=True)
class PreferenceConfig:
    method: str = "hdpo"  # a preference method of the table in train/methods.py (PREFERENCE_METHODS)
    init: str | None = setting(None, help="the SFT checkpoint: the initial policy and the frozen reference")
    pairs: str | None = setting(None, help="scored train pairs (null: RUN/critic/train_pairs.jsonl)")
    val_pairs: str | None = setting(None, help="scored validation pairs (null: RUN/critic/val_pairs.jsonl)")
    profile: str = setting("context", help="the profile system prompt of each prompt: context, oracle (adds the "
                                           "gold length bin; report it as such) or none")
    truncation: str = setting("left", help="how a pair's prompt over its share of data.max_length is cut: left "
                                           "(the paper's reference recipe) from its start, the profile prompt with "
                                           "it; keep_system keeps the system message that opens it and cuts the "
                                           "oldest tokens after it; turns keeps it and drops the oldest whole turns, "
                                           "as generation does; each as `build --truncation` does")
    beta: float = setting(0.1, range=POSITIVE, help="the inverse temperature of the implicit reward")
    lambda_dist: float = setting(0.1, range=NON_NEGATIVE, help="weight of HDPO's critic distance term")
    gamma_ftx: float = setting(0.05, range=NON_NEGATIVE,
                               help="weight of HDPO's SFT anchor (length-normalised NLL of the human response)")
    label_smoothing: float = setting(0.0, range=Range(0, 0.5, high_open=True),
                                     help="cDPO / SimPO smoothing; robust_dpo: the assumed label-flip rate")
    hdpo_terms: bool = setting(False, help="add HDPO's pair weights, critic distance (lambda_dist) and SFT "
                                           "anchor (gamma_ftx) to a method other than hdpo, e.g. method=simpo")
    simpo_gamma: float = setting(0.5, range=NON_NEGATIVE, help="SimPO's target reward margin")
    kto_desirable_weight: float = setting(1.0, range=NON_NEGATIVE, help="KTO: weight of the human responses")
    kto_undesirable_weight: float = setting(1.0, range=NON_NEGATIVE, help="KTO: weight of the model's own samples")
    reference: str = setting("precomputed", help="the reference log-probs: precomputed once before training, "
                                                 "or in_step (with model.lora): the base with the adapters off "
                                                 "in every step, one more forward per step")
    drift_prompts: int = setting(32, range=NON_NEGATIVE,
                                 help="at every evaluation, sample the policy (greedy) on this many validation "
                                      "prompts and log length ratio, support distance and critic score per "
                                      "bucket; 0: off")
    drift_new_tokens: int = setting(64, range=COUNT, help="tokens each drift sample may take")
    rounds: int = setting(1, range=COUNT, help="> 1: on-policy rounds, train.steps steps each, OUT/round-<r>/ "
                                               "per round")
    on_policy: OnPolicySection = field(default_factory=OnPolicySection)
    model: ModelSection = field(default_factory=ModelSection)
    data: DataSection = field(default_factory=lambda: DataSection(max_length=256, eval_batch=8))
    optimizer: OptimizerConfig = field(default_factory=lambda: OptimizerConfig(lr=5e-7, weight_decay=0.0))
    train: LoopConfig = field(default_factory=lambda: LoopConfig(global_batch=8))
    parallel: ParallelConfig = field(default_factory=ParallelConfig)

    def pair_file(self, key: str) -> str:
        """`pairs` or `val_pairs` as set, else the scored pairs in RUN/critic/."""
        if getattr(self, key) is not None:
            return getattr(self, key)
        if self.data.dir is None:
            raise ConfigError(f"set {key}= or data.dir=RUN (whose critic/ holds the scored pairs)"
                              + (val_pairs_hint(self.pairs) if key == "val_pairs" else ""))
        return f"{str(self.data.dir).rstrip('/')}/critic/{'train_pairs' if key == 'pairs' else key}.jsonl"

    def pair_files(self) -> dict[str, str]:
        """{"pairs": ..., "val_pairs": ...} (pair_file)."""
        return {key: self.pair_file(key) for key in ("pairs", "val_pairs")}


def val_pairs_hint(pairs: str | None) -> str:
    """Where held-out pairs come from, naming the file `pairs import --val-fraction` wrote beside `pairs`."""
    hint = (" (held-out pairs: `polyalign pairs import ... --val-fraction 0.1` writes NAME.val.jsonl beside its "
            "--out, or `polyalign pairs` on RUN/data/val.jsonl)")
    beside = str(pairs)[:-len(".jsonl")] + ".val.jsonl" if pairs and str(pairs).endswith(".jsonl") else None
    if beside and as_path(beside).exists():
        hint += f"; {beside} is there: val_pairs={beside}"
    return hint


@dataclass(frozen=True)
class CriticConfig:
    method: str = "critic"
    init: str | None = setting(None, help="the SFT checkpoint: the frozen encoder")
    pairs: str | None = setting(None, help="train pairs (JSONL from `polyalign pairs`)")
    val_pairs: str | None = setting(None, help="held-out pairs for validation and the ranking accuracy")
    references: str | None = setting(None, help="human support statistics (null: RUN/stats/references.json)")
    # (features.references.support_distance says how each choice computes the distance)
    distance_features: str = setting("nonconstant", help="nonconstant: skip features constant in the bucket's "
                                                         "human reference; all: every feature, as the reference "
                                                         "code did")
    distance_counts: str = setting("per_token", help="per_token: counts as per-token rates and the length by its "
                                                     "place in the bucket's own distribution, so length alone is "
                                                     "neither rewarded nor punished; raw: as the reference code")
    pair_batch: int = setting(8, range=COUNT,
                              help="ranking pairs per step (train.global_batch counts regression rows)")
    dropout: float = setting(0.1, range=FRACTION, help="dropout between the critic head's layers")
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
