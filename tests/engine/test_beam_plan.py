"""The beam module's decisions as a plan, by member index: which members keep their place,
which spare is forked into a beam continued twice, which park, what ended, and when the group
is done (checked against hand-worked scores)."""

from __future__ import annotations

from engine.sched.beams import Hypothesis, Member, final, plan_step

EOS = 0


def test_a_beam_continued_twice_forks_into_a_spare_and_the_rest_park():
    members = [
        Member([5], -1.0, [(6, -0.125), (EOS, -0.25), (7, -0.375)], True),
        Member([8], -2.0, [(9, -0.5), (EOS, -0.0625)], True),
        Member([5], -1.0, None, False),  # parked earlier: a spare
    ]
    step = plan_step(members, width=2, ends=frozenset({EOS}), min_tokens=0)
    assert step is not None
    # by score: 5,6 -1.125; 5,EOS -1.25 (ends); 5,7 -1.375; then width 2 is full
    assert step.append == [(0, 6, -1.125), (2, 7, -1.375)]  # 0 keeps, spare 2 copies it
    assert step.forks == [(2, 0)]
    assert step.park == [1, 2]  # every non-keeper parks first; the fork revives spare 2
    assert step.ended == [Hypothesis([5, EOS], -1.25, True)]


def test_min_tokens_holds_an_end_and_a_member_without_candidates_waits():
    members = [Member([5], -1.0, [(EOS, -0.1), (6, -0.2)], True)]
    step = plan_step(members, width=1, ends=frozenset({EOS}), min_tokens=2)
    assert step is not None and step.ended == [] and step.append == [(0, 6, -1.2)]
    waiting = [Member([5], -1.0, [(6, -0.2)], True), Member([7], -1.0, None, True)]
    assert plan_step(waiting, width=2, ends=frozenset(), min_tokens=0) is None


def test_final_waits_while_a_live_beam_can_win_and_ranks_by_normalized_score():
    ended = [Hypothesis([1, 2], -2.0, True)]
    live = [Member([3, 4, 5], -1.5, None, True)]
    assert final(ended, live, 1, 1.0, at_limit=False) is None  # -0.5 per token beats -1.0
    (top,) = final(ended, live, 1, 1.0, at_limit=True)
    assert top == Hypothesis([3, 4, 5], -1.5, False)
    weak = [Member([3, 4, 5], -9.0, None, True)]
    assert final(ended, weak, 1, 1.0, at_limit=False) == ended  # done: it cannot catch up
