"""The episode debugger as HTML: one self-contained viewer for notebooks, files and widget panes.

Inline CSS, a little vanilla JavaScript and the steps as JSON in a
`<script type="application/json">` tag; nothing is fetched from the network. Every step is
rendered into the HTML itself and the script only shows one at a time (Prev/Next buttons, the
left/right arrow keys, the step list), so without JavaScript (an untrusted notebook, a mail
client, a crawler) the steps are simply shown one after another.

Completion tokens are shaded by logprob: the less likely a token was under the weights that
sampled it, the redder; hovering shows its text, id, logprob and weight version.
"""

from __future__ import annotations

import html
import json
import math
import uuid
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

from ..types import agent_depth

if TYPE_CHECKING:
    from .debugger import Step

__all__ = ["STYLE", "document", "fragment", "step_section"]

STYLE = """<style>
.astranb-dbg {font-family: system-ui, -apple-system, sans-serif; font-size: 13px; max-width: 980px;
  color: #222; outline: none}
.astranb-dbg .nav {display: flex; flex-wrap: wrap; gap: 4px; align-items: center; margin: 4px 0}
.astranb-dbg:not(.js) .nav {display: none}
.astranb-dbg.js .astranb-step:not(.current) {display: none}
.astranb-dbg .nav button {font-size: 12px; padding: 1px 6px; border: 1px solid #bbb;
  border-radius: 3px; background: #f4f4f4; cursor: pointer}
.astranb-dbg .nav button.current {background: #2b6cb0; color: #fff; border-color: #2b6cb0}
.astranb-dbg .where {margin: 0 8px; color: #555}
.astranb-dbg .astranb-step {border: 1px solid #ddd; border-radius: 4px; padding: 6px 10px;
  margin: 6px 0}
.astranb-dbg .head {font-weight: 600; margin-bottom: 4px}
.astranb-dbg .badge {font-weight: normal; font-size: 11px; border-radius: 3px; padding: 0 4px;
  background: #eee; color: #444}
.astranb-dbg .sep {font-weight: normal; color: #999}
.astranb-dbg .badge.edited {background: #fde68a}
.astranb-dbg .badge.replayed {background: #dbeafe}
.astranb-dbg .label {color: #666; font-size: 11px; margin-top: 4px}
.astranb-dbg pre {white-space: pre-wrap; word-break: break-all; margin: 2px 0; padding: 4px;
  background: #f7f7f7; border-radius: 3px}
.astranb-dbg .tokens {font-family: ui-monospace, monospace; line-height: 1.9}
.astranb-dbg .tok {white-space: pre; padding: 1px 1px; border-right: 1px solid #fff}
.astranb-dbg .tok.unknown {outline: 1px dashed #999}
.astranb-dbg .note {color: #8a4b00}
.astranb-dbg .error {color: #b00000}
.astranb-dbg table {border-collapse: collapse}
.astranb-dbg td {padding: 1px 10px 1px 0}
</style>"""

_SCRIPT = """<script>
(function () {
  var root = document.getElementById("__ID__");
  if (!root || root.getAttribute("data-ready")) return;
  root.setAttribute("data-ready", "1");
  var steps = root.querySelectorAll(".astranb-step");
  var chips = root.querySelectorAll(".outline button");
  var where = root.querySelector(".where");
  var pos = __POSITION__;
  function show(i) {
    pos = Math.max(0, Math.min(steps.length - 1, i));
    for (var k = 0; k < steps.length; k++) {
      steps[k].classList.toggle("current", k === pos);
      if (chips[k]) chips[k].classList.toggle("current", k === pos);
    }
    where.textContent = "step " + pos + " \u00b7 steps 0\u2013" + (steps.length - 1) +
      " \u00b7 \u2190 \u2192 keys step";
  }
  function key(event) {
    if (event.key === "ArrowLeft") show(pos - 1);
    else if (event.key === "ArrowRight") show(pos + 1);
    else return;
    event.preventDefault();
    event.stopPropagation();
  }
  root.querySelector(".prev").addEventListener("click", function () { show(pos - 1); });
  root.querySelector(".next").addEventListener("click", function () { show(pos + 1); });
  for (var k = 0; k < chips.length; k++) {
    chips[k].addEventListener("click", (function (i) { return function () { show(i); }; })(k));
  }
  if (__STANDALONE__) document.addEventListener("keydown", key);
  else root.addEventListener("keydown", key);
  root.classList.add("js");
  show(pos);
})();
</script>"""


def document(steps: Sequence[Step], title: str, position: int = 0) -> str:
    """A whole HTML page holding the viewer (what `export_html` writes)."""
    body = _viewer(steps, title, position, "astranb-episode", standalone=True)
    return ("<!DOCTYPE html>\n<html lang=\"en\">\n<head>\n<meta charset=\"utf-8\">\n"
            f"<title>{_e(title)}</title>\n</head>\n<body>\n{body}\n</body>\n</html>\n")


def fragment(steps: Sequence[Step], title: str, position: int = 0) -> str:
    """The viewer as an HTML fragment for a notebook output (an id of its own per output)."""
    return _viewer(steps, title, position, f"astranb-dbg-{uuid.uuid4().hex[:12]}", standalone=False)


def step_section(step: Step, total: int, current: bool = False) -> str:
    """One step as a <section> (the viewer shows one at a time)."""
    body = {"generate": _generate, "tool": _tool, "reward": _reward}[step.kind](step)
    note = f'<div class="note">{_e(step.note)}</div>' if step.note else ""
    classes = "astranb-step current" if current else "astranb-step"
    return (f'<section class="{classes}" data-step="{step.index}" data-kind="{step.kind}">'
            f'<div class="head">step {step.index} (of 0–{total - 1}): {_e(step.title)}'
            f'{_badges(step)}</div>{body}{note}</section>')


# -- internals -------------------------------------------------------------------------------------

def _viewer(steps: Sequence[Step], title: str, position: int, root_id: str,
            standalone: bool) -> str:
    chips = "".join(f'<button type="button" title="{_e(s.title)}">{s.index} {_e(_chip(s))}</button>'
                    for s in steps)
    sections = "\n".join(step_section(s, len(steps), s.index == position) for s in steps)
    data = {"title": title, "position": position, "steps": [s.to_json() for s in steps]}
    script = (_SCRIPT.replace("__ID__", root_id).replace("__POSITION__", str(int(position)))
              .replace("__STANDALONE__", "true" if standalone else "false"))
    return (f'{STYLE}\n<div class="astranb-dbg" id="{root_id}" tabindex="0">'
            f'<div class="head">{_e(title)}</div>'
            f'<div class="nav"><button type="button" class="prev" title="previous step (←)">'
            f'&#9664; Prev</button><button type="button" class="next" title="next step (→)">'
            f'Next &#9654;</button><span class="where"></span></div>'
            f'<div class="nav outline">{chips}</div>\n{sections}\n'
            f'<script type="application/json" class="astranb-data">{_json(data)}</script>\n'
            f'{script}</div>')


def _generate(step: Step) -> str:
    tokens = "".join(_token(t, i, lp, v) for t, i, lp, v
                     in zip(step.tokens, step.token_ids, step.logprobs, step.versions, strict=True))
    if not tokens:  # an edit without a tokenizer: text only
        tokens = f'<span class="tok unknown" title="tokens unknown">{_e(step.completion)}</span>'
    if step.extends >= 0:
        prompt = (f'<div class="label">prompt: turn {step.extends}\'s tokens as sampled, then '
                  f'(new)</div><pre>{_e(step.new_prompt)}</pre>'
                  f'<details><summary>whole prompt</summary><pre>{_e(step.prompt)}</pre>'
                  f'</details>')
    else:
        prompt = f'<div class="label">prompt</div><pre>{_e(step.prompt)}</pre>'
    mask = f'<div class="label">loss mask: {_e(step.mask)}</div>' if step.mask else ""
    return (f'{prompt}{mask}'
            f'<div class="label">completion ({_e(step.finish_reason)}); shade: the redder, the '
            f'less likely the token was; hover a token for its logprob and version</div>'
            f'<pre class="tokens">{tokens}</pre>'
            f'<div class="label">text</div><pre>{_e(step.completion)}</pre>')


def _tool(step: Step) -> str:
    args = "".join(f"<tr><td>{_e(k)}</td><td><code>{_e(_show(v))}</code></td></tr>"
                   for k, v in step.args.items())
    outcome = (f'<pre class="error">raised {_e(step.error)}</pre>' if step.error
               else f"<pre>{_e(_show(step.result))}</pre>")
    return (f'<div class="label">arguments</div><table>{args}</table>'
            f'<div class="label">result</div>{outcome}')


def _reward(step: Step) -> str:
    if step.error is not None:
        return (f'<div class="label">the episode failed</div>'
                f'<pre class="error">{_e(step.error)}</pre>')
    rows = "".join(f"<tr><td>{_e(role)}</td><td><b>{value:g}</b></td></tr>"
                   for role, value in step.rewards.items())
    return f'<div class="label">reward per role</div><table>{rows}</table>'


def _token(text: str, token_id: int, logprob: float | None, version: int | None) -> str:
    shown = text.replace("\n", "\u23ce\n") if text else "\u2205"
    if logprob is None:
        tip = f"{text!r} · id {token_id} · logprob unknown · version unknown"
        return f'<span class="tok unknown" title="{_e(tip)}">{_e(shown)}</span>'
    p = math.exp(logprob) if math.isfinite(logprob) else 0.0
    tip = (f"{text!r} · id {token_id} · logprob {logprob:.3f} (p={p:.3f}) · "
           f"version {version if version is not None else 'unknown'}")
    shade = f"background:rgba(214,39,40,{0.06 + 0.74 * (1 - p):.2f})"
    return f'<span class="tok" style="{shade}" title="{_e(tip)}">{_e(shown)}</span>'


def _badges(step: Step) -> str:
    if step.kind != "generate":
        return ""
    versions = sorted({v for v in step.versions if v is not None})
    origin = step.origin or "sampled"
    tree = ((f'<span class="badge agent">sub-agent {_e(step.agent)} (depth '
             f'{agent_depth(step.agent)})</span>',) if step.agent else ())
    badges = (*tree,
              f'<span class="badge">role {_e(step.role)} → policy {_e(step.policy)}</span>',
              f'<span class="badge {_e(origin)}">{_e(origin)}</span>',
              f'<span class="badge">versions {_e(versions) if versions else "unknown"}</span>')
    # real text between the badges, not only CSS margins: the header must read as words in
    # any text rendering (textContent, copy and paste, a pane the stylesheet does not reach)
    return "".join(_SEP + badge for badge in badges)


_SEP = '<span class="sep"> · </span>'


def _chip(step: Step) -> str:
    if step.kind == "generate":
        where = f"@{step.agent}" if step.agent else ""
        return f"{step.role}{where}" + ("*" if step.origin == "edited" else "")
    return step.tool if step.kind == "tool" else "reward"


def _show(value: Any) -> str:
    return json.dumps(value, default=repr, ensure_ascii=False)


def _json(data: Mapping[str, Any]) -> str:
    """JSON that is safe inside a <script> element (no "</script>", no "<!--")."""
    text = json.dumps(data, allow_nan=False, ensure_ascii=False)
    return text.replace("<", "\\u003c").replace(">", "\\u003e").replace("&", "\\u0026")


def _e(text: Any) -> str:
    return html.escape(str(text), quote=True)
