"""The adaptive draft depth (speculative/depth.py): the decision function, the running acceptance, and the chooser
driven by simulated step periods (a fake clock) converging on the depth that emits the most tokens per second."""

import pytest

from m3sdk.config import SpecConfig
from m3sdk.speculative.depth import MIN_SAMPLES, Acceptance, DraftDepth, best_depth


def test_best_depth_picks_plain_when_drafting_cannot_pay():
    # drafts seldom accepted, a verify step twice a plain one (a large batch)
    assert best_depth([1.0, 1.3, 1.5, 1.6], [1.0, 2.0, 2.1, 2.2]) == 0


def test_best_depth_picks_the_most_drafts_when_acceptance_is_high_and_steps_cheap():
    assert best_depth([1.0, 1.9, 2.7, 3.4], [1.0, 1.2, 1.25, 1.3]) == 3


def test_best_depth_picks_a_middle_depth_and_skips_unknown_costs():
    assert best_depth([1.0, 1.9, 2.5, 2.9], [1.0, 1.3, 2.4, 3.0]) == 1
    assert best_depth([1.0, 1.9, 2.5, 2.9], [1.0, 0.0, 2.6, 3.0]) == 0  # depth 1 unknown


def test_best_depth_keeps_the_running_depth_within_the_margin():
    tokens, costs = [1.0, 1.9, 2.7, 3.4], [1.0, 1.6, 2.5, 3.3]  # rates 1.0, 1.19, 1.08, 1.03
    assert best_depth(tokens, costs) == 1
    assert best_depth(tokens, costs, keep=3, margin=0.03) == 1  # 13 % behind: switch
    assert best_depth(tokens, costs, keep=1, margin=0.03) == 1
    assert best_depth([1.0, 1.9], [1.0, 1.87], keep=0, margin=0.03) == 0  # 1.6 % behind: stay
    assert best_depth([1.0, 1.9], [1.0, 1.87], keep=0, margin=0.0) == 1


def test_acceptance_starts_at_its_prior_and_follows_the_rows():
    a = Acceptance(3, prior=0.5, prior_rows=4)
    assert a.expected_tokens() == pytest.approx([1, 1.5, 1.75, 1.875])
    a.add([(3, 3)] * 400)  # every draft accepted
    e = a.expected_tokens()
    assert e[3] > 3.9 and e[1] > 1.95
    a.add([(3, 0)] * 2000)  # then none: the old rows decay away
    assert a.expected_tokens()[3] < 1.1
    # rows with fewer drafts leave the deeper positions to the prior
    b = Acceptance(3, prior=0.5, prior_rows=4)
    b.add([(1, 1)] * 100)
    e = b.expected_tokens()
    assert e[1] > 1.95 and e[3] - e[1] == pytest.approx(0.25 + 0.125)


def drive(depth: DraftDepth, batch: int, cost, accepted, steps: int) -> list[int]:
    """Run `steps` steps of `batch` decoding rows on a fake clock: a step of depth k takes cost(k) seconds and each
    of its rows accepts accepted(k) drafts. -> the depth of every step."""
    now, seen = 0.0, []
    k = depth.choose(batch)
    for _ in range(steps):
        nxt = depth.choose(batch)
        depth.launched(now, batch, k, nxt, clean=True)
        if k:
            depth.verified([(k, accepted(k))] * batch)
        now += cost(k, nxt)
        seen.append(k)
        k = nxt
    return seen


def test_small_batch_high_acceptance_settles_on_the_most_drafts():
    depth = DraftDepth(3, [1, 2, 4, 8])
    seen = drive(depth, 1, lambda k, nxt: 0.4 + 0.12 * (nxt > 0) + 0.01 * k, lambda k: k, 80)
    assert seen[0] == 3 and 0 in seen[:20]  # the ends measured first
    assert seen[-40:] == [3] * 40


def test_large_batch_settles_on_plain_steps():
    depth = DraftDepth(3, [1, 8, 32, 64])
    # drafting doubles the step and verify tokens cost in proportion: nothing pays
    seen = drive(depth, 64, lambda k, nxt: 1.0 + 1.0 * (nxt > 0) + 0.5 * k, lambda k: k // 2, 120)
    assert seen[-60:] == [0] * 60
    # the middle depths were priced by interpolation (never better here) and not needed
    assert depth.costs.samples(64, 3) >= MIN_SAMPLES and depth.costs.samples(64, 0) >= MIN_SAMPLES


def test_a_middle_depth_is_tried_and_kept_when_it_wins():
    depth = DraftDepth(3, [16])
    # one draft nearly always accepted, deeper ones never: 1 draft costs little more than plain
    seen = drive(depth, 16, lambda k, nxt: {0: 1.0, 1: 1.3, 2: 2.4, 3: 3.0}[k] + 0.0 * nxt,
                 lambda k: min(k, 1), 150)
    assert seen[-50:] == [1] * 50


def test_buckets_are_measured_apart_and_fixed_depth_ignores_costs():
    depth = DraftDepth(3, [1, 8])
    drive(depth, 8, lambda k, nxt: 1.0 + 2.0 * k, lambda k: 0, 60)
    assert depth.choose(8) == 0 and depth.choose(1) == 3  # batch 1 unmeasured: its exploration starts at k_max
    fixed = DraftDepth(3, [1, 8], adaptive=False)
    drive(fixed, 8, lambda k, nxt: 1.0 + 2.0 * k, lambda k: 0, 20)
    assert fixed.choose(8) == 3 and fixed.chosen == [0, 0, 0, 20]


def test_unclean_and_idle_periods_are_not_costs():
    depth = DraftDepth(2, [4])
    depth.launched(0.0, 4, 2, 2, clean=False)  # a step with a prefill chunk
    depth.launched(1.0, 4, 2, 2, clean=True)
    assert depth.costs.samples(4, 2) == 0
    depth.idle()  # the engine waited for work
    depth.launched(50.0, 4, 2, 2, clean=True)
    assert depth.costs.samples(4, 2) == 0
    depth.launched(51.0, 4, 2, 0, clean=True)  # drafts nothing for the next step: not a steady depth-2 period
    depth.launched(52.0, 4, 0, 0, clean=True)
    assert depth.costs.samples(4, 2) == 1 and depth.costs.samples(4, 0) == 0
    assert depth.after_warm_up().costs is depth.costs


def test_config_takes_adaptive():
    assert SpecConfig.parse({"method": "eagle3", "num_speculative_tokens": 4}).adaptive is True
    assert SpecConfig.parse({"method": "eagle3", "adaptive": False}).adaptive is False
    with pytest.raises(ValueError, match="adaptive"):
        SpecConfig.parse({"method": "eagle3", "adaptive": "yes"})
