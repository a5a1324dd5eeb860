"""Losses as pure functions of arrays."""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp


def weighted_mean(values: jax.Array, weights: jax.Array) -> jax.Array:
    """sum_i w_i v_i / sum_i w_i, 0 when the weights sum to 0."""
    total = weights.sum()
    return jnp.where(total > 0, (weights * values).sum() / jnp.where(total > 0, total, 1.0), 0.0)


# --- preference losses (METHOD section 8) ------------------------------------------------------------

def dpo_logits(policy_chosen_logps, policy_rejected_logps, ref_chosen_logps, ref_rejected_logps) -> jax.Array:
    """(pi_c - rho_c) - (pi_r - rho_r): how much more the policy prefers chosen than the reference does."""
    return (policy_chosen_logps - ref_chosen_logps) - (policy_rejected_logps - ref_rejected_logps)


def dpo_loss(policy_chosen_logps, policy_rejected_logps, ref_chosen_logps, ref_rejected_logps, beta: float = 0.1,
             label_smoothing: float = 0.0) -> jax.Array:
    """Per-pair sigmoid DPO loss -log sigmoid(beta * logits); with label smoothing eps the
    conservative form (cDPO): (1 - eps) * that + eps * -log sigmoid(-beta * logits)."""
    z = beta * dpo_logits(policy_chosen_logps, policy_rejected_logps, ref_chosen_logps, ref_rejected_logps)
    return -(1.0 - label_smoothing) * jax.nn.log_sigmoid(z) - label_smoothing * jax.nn.log_sigmoid(-z)


def ipo_loss(policy_chosen_logps, policy_rejected_logps, ref_chosen_logps, ref_rejected_logps,
             beta: float = 0.1) -> jax.Array:
    """Per-pair IPO loss (logits - 1 / (2 beta))^2."""
    logits = dpo_logits(policy_chosen_logps, policy_rejected_logps, ref_chosen_logps, ref_rejected_logps)
    return (logits - 1.0 / (2.0 * beta)) ** 2


def robust_dpo_loss(policy_chosen_logps, policy_rejected_logps, ref_chosen_logps, ref_rejected_logps,
                    beta: float = 0.1, label_smoothing: float = 0.1) -> jax.Array:
    """Robust DPO (Chowdhury et al. 2024) for preference labels flipped with probability eps: the
    unbiased estimate ((1 - eps) l(z) - eps l(-z)) / (1 - 2 eps), l(z) = -log sigmoid(beta z)."""
    z = beta * dpo_logits(policy_chosen_logps, policy_rejected_logps, ref_chosen_logps, ref_rejected_logps)
    eps = label_smoothing
    return (-(1.0 - eps) * jax.nn.log_sigmoid(z) + eps * jax.nn.log_sigmoid(-z)) / (1.0 - 2.0 * eps)


def length_normalised_dpo_loss(policy_chosen_logps, policy_rejected_logps, ref_chosen_logps, ref_rejected_logps,
                               chosen_token_counts, rejected_token_counts, beta: float = 0.1,
                               label_smoothing: float = 0.0) -> jax.Array:
    """DPO on per-token log-probs (each side's log-ratio divided by its response length), so a longer
    response earns no margin for being longer."""
    nc, nr = jnp.maximum(chosen_token_counts, 1.0), jnp.maximum(rejected_token_counts, 1.0)
    return dpo_loss(policy_chosen_logps / nc, policy_rejected_logps / nr, ref_chosen_logps / nc,
                    ref_rejected_logps / nr, beta, label_smoothing)


def simpo_loss(policy_chosen_logps, policy_rejected_logps, chosen_token_counts, rejected_token_counts,
               beta: float = 2.0, gamma: float = 0.5, label_smoothing: float = 0.0) -> jax.Array:
    """SimPO (Meng et al. 2024), reference-free: -log sigmoid(beta (pi_c / |y_c| - pi_r / |y_r|) - gamma),
    with cDPO-style label smoothing as TRL's CPO trainer has it (gamma enters as gamma / beta inside)."""
    nc, nr = jnp.maximum(chosen_token_counts, 1.0), jnp.maximum(rejected_token_counts, 1.0)
    z = beta * (policy_chosen_logps / nc - policy_rejected_logps / nr - gamma / beta)
    return -(1.0 - label_smoothing) * jax.nn.log_sigmoid(z) - label_smoothing * jax.nn.log_sigmoid(-z)


def orpo_loss(policy_chosen_logps, policy_rejected_logps, chosen_token_counts, rejected_token_counts,
              beta: float = 0.1) -> jax.Array:
    """ORPO (Hong et al. 2024), reference-free: the chosen response's per-token NLL minus beta log
    sigmoid of the log odds ratio between the sides' per-token probabilities."""
    # per-token log-probs kept below 0, where log(1 - p) is finite: an empty slot of a packed row (0 / 0)
    # or a response the policy is certain of would otherwise give -inf and a NaN gradient
    mean_c = jnp.minimum(policy_chosen_logps / jnp.maximum(chosen_token_counts, 1.0), -1e-6)
    mean_r = jnp.minimum(policy_rejected_logps / jnp.maximum(rejected_token_counts, 1.0), -1e-6)
    log_odds = (mean_c - mean_r) - (jnp.log1p(-jnp.exp(mean_c)) - jnp.log1p(-jnp.exp(mean_r)))
    return -mean_c - beta * jax.nn.log_sigmoid(log_odds)


def kto_losses(policy_chosen_logps, policy_rejected_logps, ref_chosen_logps, ref_rejected_logps,
               beta: float = 0.1, kl: float | jax.Array = 0.0, desirable_weight: float = 1.0,
               undesirable_weight: float = 1.0) -> tuple[jax.Array, jax.Array]:
    """KTO (Ethayarajh et al. 2024), unpaired: each human response is a desirable example, each of the
    model's own samples an undesirable one, scored on its own against the reference point `kl`:
    w_d (1 - sigmoid(beta (r_c - kl))) and w_u (1 - sigmoid(beta (kl - r_r))), r = pi - rho."""
    chosen = desirable_weight * (1.0 - jax.nn.sigmoid(beta * ((policy_chosen_logps - ref_chosen_logps) - kl)))
    rejected = undesirable_weight * (1.0 - jax.nn.sigmoid(beta * (kl - (policy_rejected_logps - ref_rejected_logps))))
    return chosen, rejected


# --- each preference method's loss of one pair, in the one signature the method table names -----------

class PairLogps(NamedTuple):
    """Per pair: the policy's and the reference's summed response log-probs, and the response lengths."""

    chosen: jax.Array
    rejected: jax.Array
    ref_chosen: jax.Array
    ref_rejected: jax.Array
    chosen_tokens: jax.Array
    rejected_tokens: jax.Array


def dpo_pair_loss(p: PairLogps, c) -> jax.Array:
    return dpo_loss(p.chosen, p.rejected, p.ref_chosen, p.ref_rejected, c.beta, c.label_smoothing)


def ipo_pair_loss(p: PairLogps, c) -> jax.Array:
    return ipo_loss(p.chosen, p.rejected, p.ref_chosen, p.ref_rejected, c.beta)


def robust_dpo_pair_loss(p: PairLogps, c) -> jax.Array:
    return robust_dpo_loss(p.chosen, p.rejected, p.ref_chosen, p.ref_rejected, c.beta, c.label_smoothing)


def ln_dpo_pair_loss(p: PairLogps, c) -> jax.Array:
    return length_normalised_dpo_loss(p.chosen, p.rejected, p.ref_chosen, p.ref_rejected, p.chosen_tokens,
                                      p.rejected_tokens, c.beta, c.label_smoothing)


def simpo_pair_loss(p: PairLogps, c) -> jax.Array:
    return simpo_loss(p.chosen, p.rejected, p.chosen_tokens, p.rejected_tokens, c.beta, c.simpo_gamma,
                      c.label_smoothing)


def orpo_pair_loss(p: PairLogps, c) -> jax.Array:
    return orpo_loss(p.chosen, p.rejected, p.chosen_tokens, p.rejected_tokens, c.beta)


def kto_pair_loss(p: PairLogps, c) -> jax.Array:
    """The mean of the pair's desirable and undesirable example. The reference point is 0, not a batch KL
    estimate, which would tie pairs of different micro-batches together and break the exact global-batch
    update."""
    desirable, undesirable = kto_losses(p.chosen, p.rejected, p.ref_chosen, p.ref_rejected, c.beta, 0.0,
                                        c.kto_desirable_weight, c.kto_undesirable_weight)
    return (desirable + undesirable) / 2.0


def preference_rewards(policy_chosen_logps, policy_rejected_logps, ref_chosen_logps, ref_rejected_logps,
                       beta: float = 0.1) -> dict[str, jax.Array]:
    """Implicit rewards beta * (pi - rho) per pair, their margin and whether chosen wins."""
    chosen = beta * (policy_chosen_logps - ref_chosen_logps)
    rejected = beta * (policy_rejected_logps - ref_rejected_logps)
    return {"chosen": chosen, "rejected": rejected, "margin": chosen - rejected,
            "accuracy": (chosen > rejected).astype(jnp.float32)}


def distance_regulariser(policy_chosen_logps, policy_rejected_logps, critic_chosen, critic_rejected,
                         beta: float = 0.1) -> jax.Array:
    """Per pair R = p c_cho + (1 - p) c_rej with p = sigmoid(beta (pi_c - pi_r)): the critic distance
    of the response the policy leans towards (policy only, no reference)."""
    p = jax.nn.sigmoid(beta * (policy_chosen_logps - policy_rejected_logps))
    return p * critic_chosen + (1.0 - p) * critic_rejected


def distance_reach(policy_chosen_logps, policy_rejected_logps, beta: float = 0.1) -> jax.Array:
    """Per pair 4 p (1 - p), p as in distance_regulariser: how much of R's gradient survives, 1 where the
    policy rates both responses alike, near 0 where its log-prob gap saturates p (R then moves nothing,
    whatever lambda_dist is)."""
    p = jax.nn.sigmoid(beta * (policy_chosen_logps - policy_rejected_logps))
    return 4.0 * p * (1.0 - p)


def sft_anchor(policy_chosen_logps, chosen_token_counts) -> jax.Array:
    """Per pair, the length-normalised NLL of the human (chosen) response."""
    return -policy_chosen_logps / jnp.maximum(chosen_token_counts, 1.0)


def hdpo_loss(policy_chosen_logps, policy_rejected_logps, ref_chosen_logps, ref_rejected_logps, pair_weights,
              critic_chosen, critic_rejected, chosen_token_counts, beta: float = 0.1, lambda_dist: float = 0.1,
              gamma_ftx: float = 0.05, label_smoothing: float = 0.0) -> tuple[jax.Array, dict[str, jax.Array]]:
    """HDPO over one batch: sum_i w_i l_i / sum_i w_i + lambda_dist mean_i R_i + gamma_ftx mean_i anchor_i.

    The trainer computes the same three terms with their sums taken over the whole global batch; this
    function is the reference for one batch.
    """
    per_pair = dpo_loss(policy_chosen_logps, policy_rejected_logps, ref_chosen_logps, ref_rejected_logps,
                        beta, label_smoothing)
    dpo = weighted_mean(per_pair, pair_weights)
    dist_reg = distance_regulariser(policy_chosen_logps, policy_rejected_logps, critic_chosen, critic_rejected,
                                    beta).mean()
    anchor = sft_anchor(policy_chosen_logps, chosen_token_counts).mean()
    total = dpo + lambda_dist * dist_reg + gamma_ftx * anchor
    rewards = preference_rewards(policy_chosen_logps, policy_rejected_logps, ref_chosen_logps, ref_rejected_logps,
                                 beta)
    components = {"loss": total, "dpo": dpo, "dist_reg": dist_reg, "sft_anchor": anchor,
                  "dist_gap": (critic_rejected - critic_chosen).mean(),
                  "dist_reach": distance_reach(policy_chosen_logps, policy_rejected_logps, beta).mean(),
                  **{f"rewards/{k}": v.mean() for k, v in rewards.items()}}
    return total, components
