import math

import pytest
import torch

from canopy.objective import canopy_loss, k3_kl, step_advantages

RECIPE = dict(clip_low=0.2, clip_high=0.2, kl_coef=1e-4, aggregation="token-mean")  # algorithm.* of conf/train.yaml


def loss_of(*args, **values):
    """`canopy_loss` with the recipe's clip, KL and aggregation but for `values`."""
    return canopy_loss(*args, **{**RECIPE, **values})


def ones(n):
    return torch.ones(n, dtype=torch.bool)


def group_advantages(rewards: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
    """Eq. 3 for one group: `step_advantages` of a single group whose invalid entries are its quarantined ones."""
    return step_advantages(rewards[None], ~valid[None])[0]


# ---------------------------------------------------------------- advantages (Eq. 3, Appendix B, Appendix G)


@pytest.mark.parametrize("n", [2, 8, 32])
def test_lone_success_gets_sqrt_n_minus_1(n):
    rewards = torch.zeros(n)
    rewards[3 % n] = 1.0
    adv = group_advantages(rewards, ones(n))
    assert adv[3 % n].item() == pytest.approx(math.sqrt(n - 1), rel=1e-6)
    failures = torch.cat([adv[: 3 % n], adv[3 % n + 1 :]])
    assert torch.allclose(failures, torch.full_like(failures, -1 / math.sqrt(n - 1)))
    assert adv.sum().item() == pytest.approx(0.0, abs=1e-5)


@pytest.mark.parametrize("n,k", [(8, 2), (16, 5), (32, 31)])
def test_k_successes_match_appendix_b(n, k):
    rewards = torch.tensor([1.0] * k + [0.0] * (n - k))
    adv = group_advantages(rewards, ones(n))
    assert adv[0].item() == pytest.approx(math.sqrt((n - k) / k), rel=1e-6)
    assert adv[-1].item() == pytest.approx(-math.sqrt(k / (n - k)), rel=1e-6)


def test_population_std_not_sample_std():
    rewards = torch.tensor([0.0, 1.0, 2.0, 3.0])
    adv = group_advantages(rewards, ones(4))
    population_std = math.sqrt(((torch.tensor([0.0, 1, 2, 3]) - 1.5) ** 2).mean().item())  # sqrt(1.25)
    assert adv[0].item() == pytest.approx(-1.5 / population_std)


def test_quarantined_entries_excluded_before_scoring():
    rewards = torch.tensor([1.0, 0.0, 0.0, 0.0, 0.0])
    valid = torch.tensor([True, True, True, False, False])
    adv = group_advantages(rewards, valid)
    # the group is the 3 survivors: lone success among 3 -> sqrt(2); quarantined get exactly 0
    assert adv[0].item() == pytest.approx(math.sqrt(2))
    assert adv[1].item() == pytest.approx(-1 / math.sqrt(2))
    assert adv[3].item() == 0.0 and adv[4].item() == 0.0
    # scoring the quarantined as 0 instead would change the statistics
    assert not torch.allclose(adv, group_advantages(rewards, ones(5)))


@pytest.mark.parametrize(
    "rewards,valid",
    [
        ([0.0] * 8, [True] * 8),  # all fail
        ([1.0] * 8, [True] * 8),  # all succeed
        ([0.3] * 4, [True] * 4),  # dense, all equal
        ([1.0, 0.0, 0.0], [True, False, False]),  # one survivor
        ([1.0, 0.0], [False, False]),  # nothing survives
    ],
)
def test_degenerate_groups_give_zeros_not_nan(rewards, valid):
    adv = group_advantages(torch.tensor(rewards), torch.tensor(valid))
    assert torch.equal(adv, torch.zeros(len(rewards)))


# ---------------------------------------------------------------- loss (Eqs. 6-8)


def test_k3_is_nonnegative_and_zero_at_equality():
    lp = torch.log(torch.tensor([0.1, 0.5, 0.9]))
    ref = torch.log(torch.tensor([0.3, 0.5, 0.2]))
    kl = k3_kl(lp, ref)
    assert (kl >= 0).all()
    assert kl[1].item() == 0.0
    r = 0.3 / 0.1
    assert kl[0].item() == pytest.approx(r - math.log(r) - 1, rel=1e-5)


def test_loss_hand_computed_token_mean():
    lp = torch.log(torch.tensor([[0.5, 0.25, 0.5], [0.5, 0.5, 0.5]]))
    ref = torch.log(torch.tensor([[0.5, 0.5, 0.25], [0.5, 0.5, 0.5]]))
    adv = torch.tensor([2.0, -1.0])
    mask = torch.tensor([[1, 1, 0], [0, 1, 1]])
    loss, metrics = loss_of(lp, lp.detach(), ref, adv, mask, kl_coef=0.5)
    # ratio == 1: surrogate = A; k3 on the masked tokens: [0, (2 - ln2 - 1)], [0, 0]
    k3 = 2 - math.log(2) - 1
    expected = ((-2.0) + (-2.0 + 0.5 * k3) + 1.0 + 1.0) / 4
    assert loss.item() == pytest.approx(expected, rel=1e-6)
    assert metrics["kl"].item() == pytest.approx(k3 / 4, rel=1e-6)


def test_clip_binds_on_both_sides():
    old = torch.zeros(1, 4)
    lp = torch.log(torch.tensor([[1.5, 0.5, 1.1, 0.5]]))  # ratios 1.5, 0.5, 1.1, 0.5
    mask = torch.ones(1, 4)
    _, pos = loss_of(lp, old, lp, torch.tensor([1.0]), mask)
    _, neg = loss_of(lp, old, lp, torch.tensor([-1.0]), mask)
    assert pos["pg_clipfrac"].item() == pytest.approx(0.25)  # ratio 1.5 > 1.2 with A > 0
    assert neg["pg_clipfrac"].item() == pytest.approx(0.5)  # ratios 0.5 < 0.8 with A < 0
    _, asym = loss_of(lp, old, lp, torch.tensor([1.0]), mask, clip_high=0.05)
    assert asym["pg_clipfrac"].item() == pytest.approx(0.5)  # 1.5 and 1.1 > 1.05
    assert pos["ppo_kl"].item() == pytest.approx(-lp.mean().item())


def test_clipped_gradient_is_zero_beyond_the_clip():
    old = torch.zeros(1, 2)
    lp = torch.log(torch.tensor([[1.5, 1.0]])).requires_grad_()
    loss, _ = loss_of(lp, old, lp.detach(), torch.tensor([1.0]), torch.ones(1, 2), kl_coef=0.0)
    loss.backward()
    assert lp.grad[0, 0].item() == 0.0
    assert lp.grad[0, 1].item() == pytest.approx(-0.5)


def test_token_mean_weighs_every_token_equally_and_seq_mean_does_not():
    lp = torch.zeros(2, 4, requires_grad=True)
    mask = torch.tensor([[1, 1, 1, 1], [1, 0, 0, 0]])
    adv = torch.tensor([1.0, 1.0])
    loss, _ = loss_of(lp, lp.detach(), lp.detach(), adv, mask, kl_coef=0.0)
    loss.backward()
    assert torch.allclose(lp.grad[mask.bool()], torch.full((5,), -1 / 5))
    lp.grad = None
    loss, _ = loss_of(lp, lp.detach(), lp.detach(), adv, mask, kl_coef=0.0, aggregation="seq-mean")
    loss.backward()
    assert torch.allclose(lp.grad[0], torch.full((4,), -1 / 8))  # (1/4 per token) / 2 sequences
    assert lp.grad[1, 0].item() == pytest.approx(-1 / 2)


def test_environment_tokens_get_no_gradient():
    lp = torch.zeros(1, 5, requires_grad=True)
    mask = torch.tensor([[0, 1, 1, 0, 1]])
    loss, _ = loss_of(lp, lp.detach(), lp.detach() - 1, torch.tensor([1.0]), mask)
    loss.backward()
    assert (lp.grad[0, [0, 3]] == 0).all() and (lp.grad[0, [1, 2, 4]] != 0).all()


@pytest.mark.parametrize("aggregation", ["token-mean", "seq-mean"])
def test_micro_batch_accumulation_equals_full_batch(aggregation):
    torch.manual_seed(1)
    lp = torch.randn(6, 9, requires_grad=True)
    ref, adv = torch.randn(6, 9), torch.randn(6)
    mask = (torch.rand(6, 9) > 0.4).int()
    mask[:, 0] = 1
    full, _ = loss_of(lp, lp.detach(), ref, adv, mask, aggregation=aggregation, kl_coef=0.1)
    (full_grad,) = torch.autograd.grad(full, lp)
    n_tokens, n_seq = int(mask.sum()), int((mask.sum(-1) > 0).sum())
    total = 0.0
    for rows in (slice(0, 2), slice(2, 5), slice(5, 6)):
        part, _ = loss_of(
            lp[rows],
            lp[rows].detach(),
            ref[rows],
            adv[rows],
            mask[rows],
            aggregation=aggregation,
            kl_coef=0.1,
            num_action_tokens=n_tokens,
            num_sequences=n_seq,
        )
        total = total + part
    (acc_grad,) = torch.autograd.grad(total, lp)
    assert torch.allclose(full, total, atol=1e-6)
    assert torch.allclose(full_grad, acc_grad, atol=1e-7)


def test_unknown_aggregation_is_rejected():
    with pytest.raises(ValueError, match="token-mean"):
        loss_of(
            torch.zeros(1, 2), torch.zeros(1, 2), torch.zeros(1, 2), torch.zeros(1), torch.ones(1, 2), aggregation="sum"
        )


def test_step_advantages_is_eq3_per_group_after_quarantine():
    """A step's groups at once: each row equals Eq. 3 on that group's surviving episodes alone."""
    g = torch.Generator().manual_seed(0)
    rewards = torch.rand(6, 8, generator=g).round()  # sparse
    rewards[4] = torch.rand(8, generator=g)  # a dense group
    rewards[5] = 1.0  # an all-success group: no signal
    quarantined = torch.rand(6, 8, generator=g) < 0.2
    quarantined[3, :7] = True  # one survivor: no signal
    advantages = step_advantages(rewards, quarantined)
    for row in range(6):
        kept = rewards[row][~quarantined[row]].double()
        expected = torch.zeros(8, dtype=torch.float64)
        if kept.numel() >= 2 and kept.std(unbiased=False) > 0:
            expected[~quarantined[row]] = (kept - kept.mean()) / kept.std(unbiased=False)
        assert torch.allclose(advantages[row].double(), expected, atol=1e-6), row
    assert advantages[3].abs().sum() == 0 and advantages[5].abs().sum() == 0
    assert (advantages[quarantined] == 0).all()


def test_step_advantages_quarantine_as_failure_keeps_the_episode_with_reward_zero():
    rewards = torch.tensor([[1.0, 0.0, 1.0, 0.0]])
    quarantined = torch.tensor([[False, False, False, True]])
    as_failure = step_advantages(rewards, quarantined, quarantine_as_failure=True)
    assert torch.allclose(as_failure, torch.tensor([[1.0, -1.0, 1.0, -1.0]]))
    dropped = step_advantages(rewards, quarantined)
    assert torch.allclose(dropped[0, :3], group_advantages(rewards[0, :3], torch.ones(3, dtype=torch.bool)))
    assert dropped[0, 3] == 0


def test_no_std_advantages_are_centred_rewards_with_the_same_quarantine_padding_and_degenerate_groups():
    """ablation=no_std: r - mean of the group's survivors, by hand; quarantined and padded entries and degenerate
    groups get 0 exactly as with the std."""
    rewards = torch.tensor(
        [
            [1.0, 0.0, 0.0, 0.0],  # a lone success among 4: 1 - 1/4, the failures -1/4
            [1.0, 1.0, 0.0, 0.0],  # the third is quarantined: mean 2/3 over the survivors
            [0.5, 0.0, 0.0, 0.0],  # a group of 2 (dense), padded to 4: mean 0.25
            [0.3, 0.3, 0.3, 0.3],  # all equal: no signal
            [1.0, 0.0, 0.0, 0.0],  # one survivor: no signal
        ]
    )
    quarantined = torch.zeros(5, 4, dtype=torch.bool)
    quarantined[1, 2] = True
    quarantined[4, 1:] = True
    present = torch.ones(5, 4, dtype=torch.bool)
    present[2, 2:] = False
    centred = step_advantages(rewards, quarantined, present=present, divide_by_std=False)
    expected = torch.tensor(
        [
            [0.75, -0.25, -0.25, -0.25],
            [1 / 3, 1 / 3, 0.0, -2 / 3],
            [0.25, -0.25, 0.0, 0.0],
            [0.0, 0.0, 0.0, 0.0],
            [0.0, 0.0, 0.0, 0.0],
        ]
    )
    assert torch.allclose(centred, expected, atol=1e-7)
    assert centred[3].abs().sum() == 0  # exactly zero, not rounding noise
    standardized = step_advantages(rewards, quarantined, present=present)
    assert standardized[0, 0].item() == pytest.approx(math.sqrt(3))  # the recipe divides by the std: not the same
    as_failure = step_advantages(rewards[1:2], quarantined[1:2], quarantine_as_failure=True, divide_by_std=False)
    assert torch.allclose(as_failure, torch.tensor([[0.5, 0.5, -0.5, -0.5]]))  # scored 0, kept in the mean
