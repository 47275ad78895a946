"""What is wired to what in a session: environments, their roles, and the policies filling them.

`session.wiring` is a live view (it reads the session's `RunContext` on every call) with three
forms: `text()` for scripts and logs, `_repr_html_()` so a notebook cell ending in
`session.wiring` shows a small table, and `problems()`, every reason a run would fail or surprise
you, each with the call that fixes it. `apply()` rewires an environment (it calls
`session.wire`, keeping the weight), and `parse()` reads role=policy pairs from text for
headless wiring:

    session.wiring.apply(env, **session.wiring.parse("solver=a, verifier=b"))
    print(session.wiring)
    # TwoRoles (weight 1.0)
    #   solver   -> policy 'a' (tiny-qwen3-32x2, hf)
    #   verifier -> policy 'b' (tiny-qwen3-32x2, hf)
    # problems: none

This module never imports a widget library; `astranb.notebook.widgets.wiring_widget` builds the
interactive form on top of it.
"""

from __future__ import annotations

import html
from collections.abc import Callable
from dataclasses import dataclass

from ..environments.base import Environment
from .context import RunContext
from .policy import Policy

__all__ = ["Wiring", "blocking_problems", "PolicyView", "EnvironmentView", "parse", "graph_html",
           "problems_html"]

WARNING = "warning: "
"""Prefix of the problems that do not stop a run."""


def blocking_problems(context: RunContext) -> list[str]:
    """What stops a run from starting, each with its fix (empty: ready to train)."""
    if not context.wiring:
        return ["nothing is wired; call session.wire(env, role=policy) first"]
    problems = []
    for env, wiring, _ in context.wiring:
        missing = [r for r in env.roles if r not in wiring]
        if missing:
            hint = ", ".join(f"{r}=<policy>" for r in missing)
            problems.append(f"role(s) {missing} of {env.name} are not wired; "
                            f"call session.wire(env, {hint})")
        for role, policy in wiring.items():
            if context.policies.get(policy.name) is not policy:
                problems.append(f"role {role!r} of {env.name} is wired to policy "
                                f"{policy.name!r}, which is not in this session any more; "
                                "wire it to one of " + str(sorted(context.policies)))
    return problems


@dataclass(frozen=True)
class PolicyView:
    """One policy of the session, as the wiring shows it."""

    name: str
    """The policy's name (what roles are wired to)."""
    model: str
    """The model spec's display name."""
    engine: str
    """"remote" when rollout services sample for it, else the local engine ("hf", ...)."""

    @property
    def local(self) -> bool:
        return self.engine != "remote"


@dataclass(frozen=True)
class EnvironmentView:
    """One wired environment: its roles and the policy filling each."""

    env: Environment
    """The environment object (what session.wire keys on)."""
    label: str
    """Its name, with " #2", " #3"... when several wired environments share one."""
    weight: float
    """Relative sampling weight between the wired environments."""
    edges: dict[str, str | None]
    """role -> policy name (None: not wired), in the environment's role order."""

    def shared(self) -> dict[str, list[str]]:
        """Policies filling more than one role here (shared parameters): name -> roles."""
        roles: dict[str, list[str]] = {}
        for role, name in self.edges.items():
            if name is not None:
                roles.setdefault(name, []).append(role)
        return {name: rs for name, rs in roles.items() if len(rs) > 1}


def parse(text: str) -> dict[str, str]:
    """Read "role=policy" pairs separated by commas or newlines: "solver=a, verifier=b".

    Returns:
        role -> policy name, to pass on as `wiring.apply(env, **pairs)`.

    Raises:
        ValueError: on a pair without "=", an empty side, or a role given twice.
    """
    pairs: dict[str, str] = {}
    for item in text.replace("\n", ",").split(","):
        item = item.strip()
        if not item:
            continue
        role, sep, name = (part.strip() for part in item.partition("="))
        name = name.strip("'\"")
        if not sep or not role or not name:
            raise ValueError(f"cannot read {item!r}: write role=policy pairs separated by "
                             "commas, e.g. 'solver=a, verifier=b'")
        if role in pairs:
            raise ValueError(f"role {role!r} is given twice in {text!r}; give each role once")
        pairs[role] = name
    return pairs


class Wiring:
    """A live view of a session's wiring (see the module docstring); `session.wiring` makes one.

    Args:
        context: the session's run context, whose policies and wiring it shows.
        wire: how `apply` rewires: the session's `wire` (which checks what it is given).
    """

    parse = staticmethod(parse)

    def __init__(self, context: RunContext, wire: Callable[..., Environment]):
        self._context = context
        self._wire = wire

    @property
    def policies(self) -> list[PolicyView]:
        """Every policy of the session, in creation order."""
        return [_policy_view(p) for p in self._context.policies.values()]

    @property
    def environments(self) -> list[EnvironmentView]:
        """Every wired environment, in the order they were (last) wired."""
        views: list[EnvironmentView] = []
        seen: dict[str, int] = {}
        for env, roles, weight in self._context.wiring:
            seen[env.name] = seen.get(env.name, 0) + 1
            label = env.name if seen[env.name] == 1 else f"{env.name} #{seen[env.name]}"
            edges = {r: roles[r].name if r in roles else None for r in env.roles}
            views.append(EnvironmentView(env, label, weight, edges))
        return views

    def problems(self, warnings: bool = True) -> list[str]:
        """What stops a run (or will surprise you), each naming the call that fixes it.

        Unwired roles and policies no longer in the session come first; then, prefixed
        "warning: ", policies no run trains (left out with `warnings=False`). Empty: ready to
        train.
        """
        problems = blocking_problems(self._context)
        if self._context.wiring and warnings:
            problems.extend(self._unused())
        return problems

    def apply(self, env: Environment | str, *, weight: float | None = None,
              **roles: Policy | str) -> Environment:
        """Wire `env`'s roles to policies (objects or names) through `session.wire`.

        Args:
            env: an environment, or the label of a wired one ("TwoRoles"); any other name is
                loaded from the registry, as `session.wire` does.
            weight: sampling weight; None keeps the environment's current weight (1.0 if new).
            **roles: role -> policy or policy name.

        Returns:
            The wired environment.
        """
        if isinstance(env, str):
            env = next((v.env for v in self.environments if v.label == env), env)
        if weight is None:
            weight = next((w for e, _, w in self._context.wiring if e is env), 1.0)
        policies = {role: self._policy(p) for role, p in roles.items()}
        return self._wire(env, weight=weight, **policies)

    def text(self) -> str:
        """The wiring as indented text, one line per role, then the problems."""
        lines = []
        envs = self.environments
        total = sum(v.weight for v in envs)
        names = {p.name: p for p in self.policies}
        for view in envs:
            share = f", ~{view.weight / total:.0%} of groups" if len(envs) > 1 else ""
            lines.append(f"{view.label} (weight {view.weight}{share})")
            lines.extend(_role_lines(view, names))
        if not envs:
            lines.append("no environment is wired; policies: "
                         + (", ".join(f"'{p.name}' ({p.model}, {p.engine})"
                                      for p in names.values()) or "none"))
        problems = self.problems()
        lines.append("problems: none" if not problems else "problems:")
        lines.extend(f"  - {p}" for p in problems)
        return "\n".join(lines)

    def __repr__(self) -> str:
        return self.text()

    def _repr_html_(self) -> str:
        body = graph_html(self) + problems_html(self.problems())
        return f'<div class="astranb-wiring">{body}</div>'

    # -- internals -------------------------------------------------------------------------------
    def _policy(self, policy: Policy | str) -> Policy:
        if isinstance(policy, Policy):
            return policy
        try:
            return self._context.policies[policy]
        except KeyError:
            raise ValueError(f"no policy named {policy!r}; this session's policies are "
                             f"{sorted(self._context.policies)} (session.policy(...) adds one)"
                             ) from None

    def _unused(self) -> list[str]:
        used = {p.name for _, roles, _ in self._context.wiring for p in roles.values()}
        unused = [name for name in self._context.policies if name not in used]
        if not unused:
            return []
        env, role = self._free_role()
        return [f"{WARNING}policy {name!r} is not wired to any environment, so no run trains "
                f"it; wire it to a role, e.g. role {role!r} of {env.name}: "
                f"session.wire(env, {role}=session.policies[{name!r}])" for name in unused]

    def _free_role(self) -> tuple[Environment, str]:
        """A role to suggest wiring an unused policy to: an unwired one if any."""
        for env, roles, _ in self._context.wiring:
            for role in env.roles:
                if role not in roles:
                    return env, role
        env = self._context.wiring[0][0]
        return env, env.roles[0]


def graph_html(wiring: Wiring) -> str:
    """The wiring as an HTML table: a header row per environment, a row per role."""
    names: dict[str | None, PolicyView] = {p.name: p for p in wiring.policies}  # get(None): None
    rows = []
    for view in wiring.environments:
        rows.append(_html_env_row(view))
        shared = view.shared()
        for role, name in view.edges.items():
            rows.append(_html_role_row(role, names.get(name), name, name in shared))
    if not rows:
        rows.append(_cells(["<i>no environment is wired</i>"], colspan=5))
    return '<table style="border-collapse:collapse;margin:0">' + "".join(rows) + "</table>"


def problems_html(problems: list[str]) -> str:
    """Problems as an HTML list: errors in red, warnings in amber; a green line when none."""
    if not problems:
        return '<div style="color:#187a00">problems: none &mdash; ready to train</div>'
    items = []
    for problem in problems:
        color = "#a05a00" if problem.startswith(WARNING) else "#c00000"
        items.append(f'<li style="color:{color}">{html.escape(problem, quote=False)}</li>')
    return '<ul style="margin:0.3em 0;padding-left:1.2em">' + "".join(items) + "</ul>"


def _policy_view(policy: Policy) -> PolicyView:
    if policy.remote:
        engine = "remote"
    else:  # HFEngine -> "hf", InstantEngine -> "instant"
        engine = type(policy.engine).__name__.removesuffix("Engine").lower() or "local"
    return PolicyView(policy.name, policy.spec.name, engine)


def _role_lines(view: EnvironmentView, policies: dict[str, PolicyView]) -> list[str]:
    width = max(len(r) for r in view.edges)
    targets = {r: f"policy {n!r}" if n is not None else "(not wired)"
               for r, n in view.edges.items()}
    target_width = max(len(t) for t in targets.values())
    lines = []
    for role, name in view.edges.items():
        line = f"  {role:<{width}} -> {targets[role]}"
        if name is not None:
            p = policies.get(name)
            about = f"{p.model}, {p.engine}" if p is not None else "not in this session"
            line = f"{line:<{width + target_width + 6}} ({about})"
        lines.append(line)
    for name, roles in view.shared().items():
        lines.append(f"  shared parameters: policy {name!r} fills {', '.join(roles)}")
    return lines


_CELL = "padding:0.15em 0.6em;text-align:left;border:none"


def _cells(contents: list[str], colspan: int = 1) -> str:
    span = f' colspan="{colspan}"' if colspan > 1 else ""
    return "<tr>" + "".join(f'<td style="{_CELL}"{span}>{c}</td>' for c in contents) + "</tr>"


def _html_env_row(view: EnvironmentView) -> str:
    label = html.escape(view.label, quote=False)
    return (f'<tr><th colspan="5" style="{_CELL};padding-top:0.4em">{label} '
            f'<span style="font-weight:normal;color:#666">weight {view.weight}</span></th></tr>')


def _html_role_row(role: str, policy: PolicyView | None, name: str | None, shared: bool) -> str:
    grey = '<span style="color:#666">{}</span>'
    if name is None:
        return _cells([html.escape(role), "&rarr;", '<span style="color:#c00000">not wired</span>',
                       "", ""])
    about = (f"{html.escape(policy.model)} &middot; {html.escape(policy.engine)}"
             if policy is not None else "not in this session")
    return _cells([html.escape(role), "&rarr;", f"<b>{html.escape(name)}</b>",
                   grey.format(about), grey.format("shared") if shared else ""])
