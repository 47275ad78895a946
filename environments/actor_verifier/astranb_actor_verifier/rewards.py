"""The actor-verifier reward rule, shared by every environment with an answerer and a judge.

One episode: the solver answers, the verifier approves or rejects that first answer, and a
rejected solver answers once more. Rewarding the solver for its final answer only (and the
verifier for its verdict only) has a lazy fixed point: the verifier rejects everything, the
solver's first answer does not matter because its retry earns the same, and the verifier's
rejections are right exactly because the first answers are bad. Nobody gains by changing.

The rule here removes that fixed point:

    solver   = 1               first answer right, and not given up on a retry
               retry_discount  first answer wrong, rejected, retry right
               0               otherwise
    verifier = (1 - team_weight) * judgement + team_weight * solver
               judgement = 1 for approving a right first answer or rejecting a wrong one, else 0
               (a reply that is neither approval nor rejection counts as a reject worth 0)

The discount makes a right first answer worth more than a fix, so the solver gains by answering
right at once, whatever the verifier does. The team share makes the verifier's reward follow what
the pair achieves: rejecting all answers of a solver that is always wrong first earns it
(1 - team_weight) + team_weight * retry_discount (0.75 with the defaults), below the 1 that
approving a solver who is right earns. A right answer rejected costs the verifier its judgement,
and the solver a chance to give the right answer up.
"""

from __future__ import annotations

__all__ = ["episode_rewards"]


def episode_rewards(first_right: bool, verdict: str | None, retry_right: bool | None, *,
                    retry_discount: float = 0.5, team_weight: float = 0.5) -> tuple[float, float]:
    """(solver reward, verifier reward) of one episode.

    Args:
        first_right: the solver's first answer is right.
        verdict: "y" (approved), "n" (rejected) or None (neither: a reject that earns nothing).
        retry_right: whether the retry is right; None when there was no retry.
        retry_discount: the solver's reward for a wrong first answer fixed on the retry.
        team_weight: the share of the verifier's reward that is the solver's reward.
    """
    if retry_right is None:
        solver = 1.0 if first_right else 0.0
    elif first_right:
        solver = 1.0 if retry_right else 0.0   # it gave a right answer up
    else:
        solver = retry_discount if retry_right else 0.0
    judgement = 1.0 if verdict == ("y" if first_right else "n") else 0.0
    return solver, (1.0 - team_weight) * judgement + team_weight * solver
