"""Held-out evaluation arithmetic: avg@k, pass@k, and the result of one evaluation.

Every problem (one held-out sample) is played some number of times; each play earns a reward.

- **avg@k** is the mean, over problems, of the mean reward of the problem's k plays. With the
  same number of plays per problem it is simply the mean reward of all plays.
- **pass@k** is the chance that at least one of k plays solves the problem, averaged over
  problems. With n plays of a problem of which c solved it, the unbiased estimator of Chen et al.
  (2021, "Evaluating Large Language Models Trained on Code") draws k of the n plays without
  replacement: pass@k = 1 - C(n - c, k) / C(n, k). The binomials overflow floats long before n
  is large, so it is computed as the product 1 - prod_{i = n-c+1}^{n} (1 - k / i), which is the
  same ratio written term by term; when n - c < k every draw holds a solved play and it is 1.
  With exactly k plays per problem it is the share of problems solved at least once.

What "solved" means belongs to the environment (`Environment.solved(reward)`, by default
reward >= 1). Nothing here plays episodes or imports anything above the plain data types (the
session and the dataflow play them, then score them here).
"""

from __future__ import annotations

import itertools
import math
import warnings
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from .types import Trajectory

if TYPE_CHECKING:
    from .environments.base import Environment

__all__ = ["pass_at_k", "avg_at_k", "summarize", "RoleEvaluation", "evaluate_trajectories",
           "window_columns", "heldout_samples", "check_evaluation"]


def pass_at_k(n: int, c: int, k: int) -> float:
    """Unbiased pass@k of one problem: n plays, c of them solved it, k drawn.

    Args:
        n: plays of the problem (n >= 1).
        c: how many of them solved it (0 <= c <= n).
        k: plays drawn (1 <= k <= n).

    Returns:
        1 - C(n - c, k) / C(n, k), in [0, 1].

    Raises:
        ValueError: a negative or non-integer count, c > n, or k > n.
    """
    for name, value in (("n", n), ("c", c), ("k", k)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 0:
            raise ValueError(f"pass_at_k: {name} must be an integer >= 0, got {value!r}")
    if k < 1:
        raise ValueError(f"pass_at_k: k must be >= 1 (plays drawn), got {k}")
    if c > n:
        raise ValueError(f"pass_at_k: c={c} solved plays out of n={n}; c can be at most n")
    if k > n:
        raise ValueError(f"pass_at_k: k={k} is more than the n={n} plays there are; play each "
                         f"problem at least k times, or use k <= {n}")
    if n - c < k:
        return 1.0
    return 1.0 - math.prod(1.0 - k / i for i in range(n - c + 1, n + 1))


def avg_at_k(rewards: Sequence[Sequence[float]]) -> float:
    """Mean over problems of the mean reward of the problem's plays.

    Args:
        rewards: per problem, the reward of each of its plays (at least one each).

    Raises:
        ValueError: no problems, or a problem without plays.
    """
    if not rewards:
        raise ValueError("avg_at_k: no problems to average over")
    if any(len(plays) == 0 for plays in rewards):
        raise ValueError("avg_at_k: every problem needs at least one play")
    return sum(sum(plays) / len(plays) for plays in rewards) / len(rewards)


def summarize(rewards: Sequence[Sequence[float]], k: int, *,
              solved: Callable[[float], bool] = lambda reward: reward >= 1.0,
              versions: Sequence[int] = (), failed: int = 0,
              truncated: int = 0) -> dict[str, Any]:
    """avg@k and pass@k of per-problem play rewards, with what produced them.

    A problem some of whose plays failed (the environment raised) counts with the plays that
    finished: its pass@k draws min(k, finished) of them. Problems without a finished play are
    left out of both numbers (and counted as `unscored`).

    Args:
        rewards: per problem, the reward of each finished play.
        k: plays per problem the numbers are for (pass@k draws k of them).
        solved: whether a reward solved its problem.
        versions: weight versions of the tokens that produced the plays.
        failed: plays that failed; truncated: plays cut short (their rewards are included).

    Returns:
        {"avg@k", "pass@k" (NaN when no problem was scored), "n" (problems), "k", "unscored",
        "versions" (sorted distinct), "mixed_versions", "failed", "truncated"}.
    """
    if isinstance(k, bool) or not isinstance(k, int) or k < 1:
        raise ValueError(f"summarize: k must be a positive integer, got {k!r}")
    scored = [list(plays) for plays in rewards if plays]
    if scored:
        avg = avg_at_k(scored)
        passed = [pass_at_k(len(p), sum(bool(solved(r)) for r in p), min(k, len(p)))
                  for p in scored]
        pass_k = sum(passed) / len(passed)
    else:
        avg = pass_k = math.nan
    distinct = tuple(sorted(set(versions)))
    return {"avg@k": avg, "pass@k": pass_k, "n": len(rewards), "k": k,
            "unscored": len(rewards) - len(scored), "versions": distinct,
            "mixed_versions": len(distinct) > 1, "failed": failed, "truncated": truncated}


@dataclass(frozen=True)
class RoleEvaluation:
    """One role's held-out result: what `session.evaluate(split=...)` returns per role."""

    role: str
    """The environment's role."""
    split: str
    """The split the problems came from."""
    avg_at_k: float
    """Mean over problems of the mean reward of the problem's k plays."""
    pass_at_k: float
    """Share of problems solved by at least one of k plays (unbiased estimator)."""
    n: int
    """Problems played."""
    k: int
    """Plays per problem."""
    versions: tuple[int, ...]
    """Distinct weight versions of the role's sampled tokens (more than one: the weights
    changed while the evaluation played)."""
    failed: int = 0
    """Plays that failed (the environment raised); left out of both numbers."""
    truncated: int = 0
    """Plays cut short by the context or the token budget (scored with their reward)."""

    @property
    def mixed_versions(self) -> bool:
        return len(self.versions) > 1

    def __repr__(self) -> str:
        span = ("v?" if not self.versions else f"v{self.versions[0]}" if len(self.versions) == 1
                else f"v{self.versions[0]}-{self.versions[-1]} (mixed)")
        extra = "".join(f", {count} {what}" for what, count in
                        (("failed", self.failed), ("truncated", self.truncated)) if count)
        return (f"RoleEvaluation({self.role}, {self.split}: avg@{self.k}={self.avg_at_k:.3f} "
                f"pass@{self.k}={self.pass_at_k:.3f}, {self.n} problems x {self.k}, "
                f"{span}{extra})")


def evaluate_trajectories(plays: Sequence[Sequence[Trajectory]], roles: Sequence[str], k: int,
                          split: str, solved: Callable[[float], bool] = lambda r: r >= 1.0,
                          ) -> dict[str, RoleEvaluation]:
    """Per role: avg@k and pass@k of played problems (the k trajectories of each).

    Args:
        plays: per problem, its trajectories (failed ones included; they are counted).
        roles: the environment's roles.
        k: plays per problem.
        split: the split's name (recorded).
        solved: the environment's `solved`.
    """
    every = [t for problem in plays for t in problem]
    failed = sum(not t.ok for t in every)
    truncated = sum(t.truncated is not None for t in every)
    result = {}
    for role in roles:
        rewards = [[t.rewards[role] for t in problem if t.ok and role in t.rewards]
                   for problem in plays]
        versions = [v for t in every for turn in t.turns if turn.role == role
                    for v in turn.generation.versions]
        s = summarize(rewards, k, solved=solved, versions=versions, failed=failed,
                      truncated=truncated)
        result[role] = RoleEvaluation(role, split, s["avg@k"], s["pass@k"], s["n"], k,
                                      s["versions"], failed, truncated)
    return result


def window_columns(results: Mapping[str, RoleEvaluation]) -> dict[str, Any]:
    """One evaluation as flat columns: `<role>/avg@<k>`, `<role>/pass@<k>` per role, then
    n, k, failed, truncated and the distinct token versions of all roles."""
    first = next(iter(results.values()))
    columns: dict[str, Any] = {}
    for role, r in results.items():
        columns[f"{role}/avg@{r.k}"] = r.avg_at_k
        columns[f"{role}/pass@{r.k}"] = r.pass_at_k
    versions = sorted({v for r in results.values() for v in r.versions})
    return {**columns, "n": first.n, "k": first.k, "failed": first.failed,
            "truncated": first.truncated, "token_versions": versions}


def heldout_samples(env: Environment, split: str, n: int, seed: int,
                    argument: str = "split") -> tuple[Mapping[str, Any], ...]:
    """The first n samples of `env.split_samples(split, seed)` (fewer if the split is shorter).

    Raises:
        ValueError: the environment does not list `split` in its `splits` (the message names
            them and `argument`, the caller's parameter), or the split gave no sample.
    """
    if not isinstance(split, str) or split not in env.splits:
        raise ValueError(
            f"{argument}={split!r}: {env.name} has the splits {list(env.splits)}; pass one of "
            f"them, or give {env.name} a {split!r} split (list it in `splits` and serve it from "
            "`split_samples`)")
    samples = tuple(itertools.islice(env.split_samples(split, seed), n))
    if not samples:
        raise ValueError(f"{env.name}.split_samples({split!r}) gave no samples; it needs at "
                         "least one to evaluate on")
    return samples


def check_evaluation(plays: Sequence[Sequence[Trajectory]],
                     results: Mapping[str, RoleEvaluation]) -> None:
    """Refuse an evaluation whose plays all failed; warn when its weights changed meanwhile.

    Raises:
        RuntimeError: every play failed (the first traceback is in the message).

    Warns:
        RuntimeWarning: a role's tokens come from more than one weight version (attributed to
            the caller's caller: `session.evaluate`'s).
    """
    every = [t for problem in plays for t in problem]
    if not any(t.ok for t in every):
        first = next((t.error for t in every), None)
        raise RuntimeError(f"all {len(every)} evaluation episodes failed; first error:\n{first}")
    mixed = {role: list(r.versions) for role, r in results.items() if r.mixed_versions}
    if mixed:
        warnings.warn(
            f"this evaluation mixed weight versions (role -> versions of its tokens: {mixed}): "
            "the weights changed while it played, as a run was training. Evaluate between "
            "runs, or train with eval_every= to evaluate alongside training",
            RuntimeWarning, stacklevel=3)
