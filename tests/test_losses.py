"""Preference losses against hand-computed numbers, an independent NumPy implementation and TRL's
formulas (tests/fixtures/losses/trl_dpo.json, evaluated in torch by tools/make_fixtures.py)."""

import json
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from polyalign.model.log_probs import example_nll
from polyalign.train.config import PreferenceConfig
from polyalign.train.losses import dpo_loss, hdpo_loss, ipo_loss, preference_rewards
from polyalign.train.methods import METHODS, PREFERENCE_METHODS
from tests.conftest import FIXTURES

TRL = json.loads((FIXTURES / "losses" / "trl_dpo.json").read_text())


def test_dpo_by_hand():
    # logits = (-10 - -12) - (-15 - -14) = 2 - (-1) = 3; beta 0.1 -> -log sigmoid(0.3)
    loss = dpo_loss(jnp.array([-10.0]), jnp.array([-15.0]), jnp.array([-12.0]), jnp.array([-14.0]), beta=0.1)
    assert float(loss[0]) == pytest.approx(math.log(1 + math.exp(-0.3)), abs=1e-6)  # 0.554355
    assert float(loss[0]) == pytest.approx(0.5543552, abs=1e-6)
    # Equal policy and reference: logits 0, loss log 2, whatever beta.
    assert float(dpo_loss(jnp.array([-3.0]), jnp.array([-4.0]), jnp.array([-3.0]), jnp.array([-4.0]), 0.7)[0]) == \
        pytest.approx(math.log(2), abs=1e-6)
    # cDPO with eps 0.25 at z = 0.3: 0.75 * log(1 + e^-0.3) + 0.25 * log(1 + e^0.3)
    smoothed = dpo_loss(jnp.array([-10.0]), jnp.array([-15.0]), jnp.array([-12.0]), jnp.array([-14.0]), 0.1, 0.25)
    assert float(smoothed[0]) == pytest.approx(0.75 * math.log(1 + math.exp(-0.3)) + 0.25 * math.log(1 + math.exp(0.3)),
                                               abs=1e-6)
    # IPO: (3 - 1 / 0.2)^2 = 4
    assert float(ipo_loss(jnp.array([-10.0]), jnp.array([-15.0]), jnp.array([-12.0]), jnp.array([-14.0]), 0.1)[0]) == \
        pytest.approx(4.0, abs=1e-5)


@pytest.mark.parametrize("case", TRL["cases"],
                         ids=lambda c: f"{c['loss_type']}-{c['beta']}-{c.get('label_smoothing', 0)}")
def test_losses_match_trl_formulas(case):
    logps = {k: jnp.asarray(v, jnp.float32) for k, v in TRL["logps"].items()}
    if case["loss_type"] == "sigmoid":
        ours = dpo_loss(logps["pc"], logps["pr"], logps["rc"], logps["rr"], case["beta"], case["label_smoothing"])
    else:
        ours = ipo_loss(logps["pc"], logps["pr"], logps["rc"], logps["rr"], case["beta"])
    np.testing.assert_allclose(np.asarray(ours), case["losses"], rtol=2e-5, atol=2e-5)


FAMILY = json.loads((FIXTURES / "losses" / "trl_family.json").read_text())


@pytest.mark.parametrize("case", FAMILY["cases"], ids=lambda c: f"{c['loss_type']}-{c['beta']}")
def test_the_preference_family_matches_trl_formulas(case):
    """Robust DPO, SimPO, ORPO and KTO as TRL computes them, and length-normalised DPO, in torch
    (tools/make_fixtures.py), against polyalign.train.losses in float32."""
    from polyalign.train import losses

    v = {k: jnp.asarray(x, jnp.float32) for k, x in FAMILY["logps"].items()}
    kind, beta = case["loss_type"], case["beta"]
    if kind == "robust":
        ours = losses.robust_dpo_loss(v["pc"], v["pr"], v["rc"], v["rr"], beta, case["label_smoothing"])
    elif kind == "simpo":
        ours = losses.simpo_loss(v["pc"], v["pr"], v["nc"], v["nr"], beta, case["simpo_gamma"], case["label_smoothing"])
    elif kind == "orpo":
        ours = losses.orpo_loss(v["pc"], v["pr"], v["nc"], v["nr"], beta)
    elif kind == "ln_dpo":
        ours = losses.length_normalised_dpo_loss(v["pc"], v["pr"], v["rc"], v["rr"], v["nc"], v["nr"], beta)
    else:
        chosen, rejected = losses.kto_losses(v["pc"], v["pr"], v["rc"], v["rr"], beta, case["kl"],
                                             case["desirable_weight"], case["undesirable_weight"])
        np.testing.assert_allclose(np.asarray(chosen), case["chosen_losses"], rtol=2e-5, atol=2e-6)
        ours, case = rejected, {"losses": case["rejected_losses"]}
    np.testing.assert_allclose(np.asarray(ours), case["losses"], rtol=2e-5, atol=2e-6)


def test_the_preference_family_by_hand():
    from polyalign.train import losses

    one = jnp.array
    # SimPO: per-token -1 vs -2, beta 2, gamma 0.5: z = 2 (1 - 0.25) = 1.5 -> log(1 + e^-1.5)
    z = losses.simpo_loss(one([-10.0]), one([-40.0]), one([10.0]), one([20.0]), beta=2.0, gamma=0.5)
    assert float(z[0]) == pytest.approx(math.log1p(math.exp(-1.5)), abs=1e-6)
    # length-normalised DPO with equal lengths is DPO with beta / n
    a = losses.length_normalised_dpo_loss(one([-10.0]), one([-15.0]), one([-12.0]), one([-14.0]), one([4.0]),
                                          one([4.0]), beta=0.4)
    assert float(a[0]) == pytest.approx(float(dpo_loss(one([-10.0]), one([-15.0]), one([-12.0]), one([-14.0]), 0.1)[0]),
                                        abs=1e-6)
    # robust DPO without label noise is DPO
    b = losses.robust_dpo_loss(one([-10.0]), one([-15.0]), one([-12.0]), one([-14.0]), 0.1, 0.0)
    assert float(b[0]) == pytest.approx(0.5543552, abs=1e-6)
    # ORPO with both sides at per-token log-prob log(1/2): odds 1 each, log odds ratio 0 -> NLL + beta log 2
    half = math.log(0.5)
    c = losses.orpo_loss(one([2 * half]), one([3 * half]), one([2.0]), one([3.0]), beta=0.1)
    assert float(c[0]) == pytest.approx(-half + 0.1 * math.log(2), abs=1e-6)
    # KTO at the reference policy: every example loses 1 - sigmoid(0) = 0.5
    d, u = losses.kto_losses(one([-3.0]), one([-4.0]), one([-3.0]), one([-4.0]), beta=0.1)
    assert float(d[0]) == float(u[0]) == pytest.approx(0.5)


@pytest.mark.parametrize("name", PREFERENCE_METHODS)
def test_every_method_in_the_table_names_its_loss_and_whether_it_reads_the_reference(name):
    """The table's claims hold for every preference method: its pair loss exists, is finite and
    differentiable, and depends on the reference log-probs exactly when the entry says it needs them."""
    from polyalign.train import losses

    spec = METHODS[name]
    config = PreferenceConfig(method=name, label_smoothing=0.1)
    rng = np.random.default_rng(0)
    pc, pr, rc, rr = (jnp.asarray(-rng.uniform(5, 30, 6), jnp.float32) for _ in range(4))
    nc, nr = (jnp.asarray(rng.integers(3, 12, 6), jnp.float32) for _ in range(2))
    loss = getattr(losses, spec.pair_loss)
    value = loss(losses.PairLogps(pc, pr, rc, rr, nc, nr), config)
    assert value.shape == (6,) and bool(jnp.isfinite(value).all())
    moved = loss(losses.PairLogps(pc, pr, rc - 3.0, rr + 2.0, nc, nr), config)
    assert bool(jnp.any(jnp.abs(moved - value) > 1e-4)) == spec.needs_reference
    grad = jax.grad(lambda x: loss(losses.PairLogps(x, pr, rc, rr, nc, nr), config).sum())(pc)
    assert bool(jnp.isfinite(grad).all()) and float(jnp.abs(grad).sum()) > 0
    # the entry's loss is the formula of its own name (the by-hand and TRL tests above check those)
    direct = {"dpo_pair_loss": lambda: losses.dpo_loss(pc, pr, rc, rr, config.beta, config.label_smoothing),
              "simpo_pair_loss": lambda: losses.simpo_loss(pc, pr, nc, nr, config.beta, config.simpo_gamma,
                                                           config.label_smoothing)}
    if spec.pair_loss in direct:
        np.testing.assert_allclose(value, direct[spec.pair_loss](), rtol=1e-6)


def numpy_hdpo(pc, pr, rc, rr, w, cc, cr, n, beta, lam, gamma):
    """HDPO written out in NumPy (float64), independently of polyalign.train.losses."""
    z = beta * ((pc - rc) - (pr - rr))
    per_pair = np.log1p(np.exp(-z))
    dpo = (w * per_pair).sum() / w.sum()
    p = 1 / (1 + np.exp(-beta * (pc - pr)))
    reg = (p * cc + (1 - p) * cr).mean()
    anchor = (-pc / n).mean()
    return dpo + lam * reg + gamma * anchor, dpo, reg, anchor


def test_hdpo_matches_numpy():
    rng = np.random.default_rng(7)
    pc, pr, rc, rr = (-rng.uniform(5, 80, 12) for _ in range(4))
    w = rng.uniform(0.5, 3.0, 12)
    cc, cr = rng.uniform(0, 0.5, 12), rng.uniform(0.2, 2.0, 12)
    n = rng.integers(1, 60, 12).astype(float)
    total, parts = hdpo_loss(*(jnp.asarray(x, jnp.float32) for x in (pc, pr, rc, rr, w, cc, cr, n)),
                             beta=0.1, lambda_dist=0.3, gamma_ftx=0.05)
    expected = numpy_hdpo(pc, pr, rc, rr, w, cc, cr, n, 0.1, 0.3, 0.05)
    assert float(total) == pytest.approx(expected[0], rel=1e-5)
    assert float(parts["dpo"]) == pytest.approx(expected[1], rel=1e-5)
    assert float(parts["dist_reg"]) == pytest.approx(expected[2], rel=1e-5)
    assert float(parts["sft_anchor"]) == pytest.approx(expected[3], rel=1e-5)
    assert float(parts["dist_gap"]) == pytest.approx((cr - cc).mean(), rel=1e-5)
    p = 1 / (1 + np.exp(-0.1 * (pc - pr)))  # how much of the distance term's gradient survives: 4 p (1 - p)
    assert float(parts["dist_reach"]) == pytest.approx((4 * p * (1 - p)).mean(), rel=1e-5)


def test_hdpo_by_hand_and_its_reduction_to_dpo():
    one = [jnp.array([v]) for v in (-10.0, -15.0, -12.0, -14.0)]
    # Critic scores: chosen 0.2, rejected 1.0; p = sigmoid(0.1 * 5) = 0.622459; R = 0.2 p + 1.0 (1 - p)
    total, parts = hdpo_loss(*one, jnp.array([2.0]), jnp.array([0.2]), jnp.array([1.0]), jnp.array([5.0]),
                             beta=0.1, lambda_dist=0.1, gamma_ftx=0.05)
    p = 1 / (1 + math.exp(-0.5))
    expected = math.log(1 + math.exp(-0.3)) + 0.1 * (0.2 * p + 1.0 * (1 - p)) + 0.05 * (10.0 / 5.0)
    assert float(total) == pytest.approx(expected, abs=1e-6)
    plain, _ = hdpo_loss(*one, jnp.array([2.0]), jnp.array([0.2]), jnp.array([1.0]), jnp.array([5.0]),
                         lambda_dist=0.0, gamma_ftx=0.0)
    assert float(plain) == pytest.approx(float(dpo_loss(*one)[0]), abs=1e-7)
    # Pair weights: the weighted DPO term is normalised by the sum of weights.
    pcs, prs = jnp.array([-10.0, -10.0]), jnp.array([-15.0, -9.0])
    refs = jnp.array([-12.0, -12.0]), jnp.array([-14.0, -14.0])
    w = jnp.array([3.0, 1.0])
    _, parts = hdpo_loss(pcs, prs, *refs, w, jnp.zeros(2), jnp.zeros(2), jnp.ones(2))
    per = dpo_loss(pcs, prs, *refs)
    assert float(parts["dpo"]) == pytest.approx(float((3 * per[0] + per[1]) / 4), abs=1e-6)


def test_rewards():
    r = preference_rewards(jnp.array([-10.0, -20.0]), jnp.array([-15.0, -10.0]), jnp.array([-12.0, -20.0]),
                           jnp.array([-14.0, -12.0]), beta=0.5)
    np.testing.assert_allclose(np.asarray(r["chosen"]), [1.0, 0.0])
    np.testing.assert_allclose(np.asarray(r["rejected"]), [-0.5, 1.0])
    np.testing.assert_allclose(np.asarray(r["margin"]), [1.5, -1.0])
    np.testing.assert_allclose(np.asarray(r["accuracy"]), [1.0, 0.0])


def test_example_nll_by_hand():
    # Two tokens of vocabulary 2 with logits (0, 0) and (ln 3, 0): NLLs ln 2 and ln(4/3) for target 0.
    logits = jnp.array([[[0.0, 0.0], [math.log(3), 0.0], [5.0, 5.0]]])
    targets = jnp.array([[0, 0, 1]])
    mask = jnp.array([[1.0, 1.0, 0.0]])
    assert float(example_nll(logits, targets, mask)[0]) == pytest.approx((math.log(2) + math.log(4 / 3)) / 2, abs=1e-6)
    assert float(example_nll(logits, targets, jnp.zeros((1, 3)))[0]) == 0.0


@pytest.mark.parametrize("softcap", [None, 30.0])
def test_chunked_log_probs_equal_full_logits_in_value_and_gradient(softcap):
    from polyalign.model.log_probs import chunked_token_log_probs

    keys = jax.random.split(jax.random.key(0), 4)
    batch, length, width, vocab = 3, 37, 16, 101  # 37 positions: the last block of 8 is padded
    hidden = jax.random.normal(keys[0], (batch, length, width))
    weight = jax.random.normal(keys[1], (width, vocab)) * 2.0  # large logits, so the cap bites
    targets = jax.random.randint(keys[2], (batch, length), 0, vocab)
    cotangent = jax.random.normal(keys[3], (batch, length))

    def full(h, w):
        logits = jnp.einsum("btd,dv->btv", h, w)
        if softcap is not None:
            logits = softcap * jnp.tanh(logits / softcap)
        return jax.nn.log_softmax(logits)[jnp.arange(batch)[:, None], jnp.arange(length), targets]

    def chunked(h, w):
        return chunked_token_log_probs(h, w, targets, 8, softcap)

    np.testing.assert_allclose(chunked(hidden, weight), full(hidden, weight), atol=2e-5, rtol=1e-5)
    grads_full = jax.grad(lambda h, w: (full(h, w) * cotangent).sum(), argnums=(0, 1))(hidden, weight)
    grads_chunked = jax.jit(jax.grad(lambda h, w: (chunked(h, w) * cotangent).sum(), argnums=(0, 1)))(hidden, weight)
    for got, want in zip(grads_chunked, grads_full):
        np.testing.assert_allclose(got, want, atol=5e-5, rtol=1e-4)


@pytest.mark.parametrize("family", ["llama", "gemma2"])
def test_model_log_probs_with_and_without_chunks_agree(family):
    import dataclasses

    from flax import nnx

    from polyalign.model import create_model
    from tests.conftest import tiny_model_config

    overrides = {"vocab_size": 97, "tie_embeddings": family == "gemma2"}
    if family == "gemma2":
        overrides.update(final_logit_softcap=5.0, query_pre_attn_scalar=8)
    cfg = tiny_model_config(**overrides) if family == "llama" else dataclasses.replace(
        tiny_model_config(**overrides), family="gemma2", layer_types=("sliding_attention", "full_attention"),
        sliding_window=16, attn_logit_softcap=50.0)
    model = create_model(cfg, seed=1)
    chunked_model = create_model(dataclasses.replace(cfg, logprob_chunk=16), seed=1)
    ids = jax.random.randint(jax.random.key(2), (2, 40), 0, 97)
    targets = jnp.roll(ids, -1, axis=1)

    def loss(m):
        return -m.token_log_probs(ids, targets).mean()

    value, grads = nnx.value_and_grad(loss)(model)
    chunked_value, chunked_grads = nnx.value_and_grad(loss)(chunked_model)
    assert float(chunked_value) == pytest.approx(float(value), rel=1e-6)
    for got, want in zip(jax.tree.leaves(chunked_grads), jax.tree.leaves(grads)):
        np.testing.assert_allclose(got, want, atol=1e-6, rtol=1e-4)
