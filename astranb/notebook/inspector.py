"""The step inspector as HTML: what one recorded train step trained (`run.steps[i].show()`).

One self-contained piece of HTML, the same in a notebook output and in a file
(`save_html`): inline CSS, no script, nothing fetched. Each row's tokens are shaded by their
advantage (blue above 0, red below), and three radio buttons switch the shading, in CSS alone,
to the ratio exp(trainer logprob - engine logprob) (green above 1, purple below) or the gap
|trainer - engine| (orange); where styles are stripped, the advantage shading stays. Tokens
the algorithm treated specially are marked: clipped (red box: no gradient), dropped by M2PO
(struck through), truncated importance weight at its cap (dotted underline); prompt and padding
are grey and unshaded. Hovering a token shows its id, numbers and weight version.
"""

from __future__ import annotations

import html
import math
import os
import uuid
from pathlib import Path
from typing import TYPE_CHECKING

from .display import in_kernel, publish
from .html import table

if TYPE_CHECKING:
    from ..session.steps import RecordedStep

__all__ = ["StepInspector"]

_SHADES = (("a", "advantage"), ("r", "ratio"), ("g", "logp gap"))

_STYLE = """<style>
#{id} {{font-family: system-ui, sans-serif; font-size: 13px; color: #222; max-width: 1000px}}
#{id} .flag {{background: #fde68a; border-radius: 3px; padding: 0 4px; margin-left: 4px;
  font-size: 11px}}
#{id} .row {{border-top: 1px solid #eee; padding: 3px 0}}
#{id} .rowhead {{color: #555; font-size: 11px}}
#{id} .tokens {{font-family: ui-monospace, monospace; line-height: 1.9}}
#{id} .tok {{white-space: pre; padding: 1px 0; border-right: 1px solid #fff}}
#{id} .tok.prompt {{color: #999}}
#{id} .tok.clipped {{outline: 2px solid #c00000; outline-offset: -2px}}
#{id} .tok.dropped {{text-decoration: line-through; text-decoration-thickness: 2px}}
#{id} .tok.capped {{text-decoration: underline dotted #7a3e00; text-decoration-thickness: 2px}}
#{id} .shade-r:checked ~ .rows .tok.trained {{background: var(--r) !important}}
#{id} .shade-g:checked ~ .rows .tok.trained {{background: var(--g) !important}}
#{id} .legend {{color: #555; font-size: 11px}}
</style>"""


class StepInspector:
    """The HTML view of one `RecordedStep`: `html()` (a fragment), `save_html(path)` (a
    standalone page), `display()` (in the current cell; its text outside a kernel)."""

    def __init__(self, step: RecordedStep):
        self.step = step
        t = step.trace.tensors
        trained = t["loss_mask_B_T"] > 0
        log_ratio = (t["logp_B_T"] - t["old_logp_B_T"])[trained].abs()
        # one scale per shading over the whole step, so rows compare: the largest value is the
        # strongest colour
        self.scales = {"a": _largest(t["advantages_B_T"][trained].abs()),
                       "r": _largest(log_ratio), "g": _largest(log_ratio)}

    def html(self, standalone: bool = False) -> str:
        """The view as HTML (a fragment with an id of its own, or a page's body)."""
        root = "astranb-step" if standalone else f"astranb-step-{uuid.uuid4().hex[:12]}"
        step = self.step
        flags = "".join(f"<span class='flag'>{html.escape(f)}</span>" for f in step.flags)
        head = (f"<div><b>step {step.step}</b> of {html.escape(repr(step.policy))} "
                f"<span style='color:#666'>({html.escape(str(step.trace.header.get('algorithm')))}"
                f")</span>{flags}</div>")
        numbers = table(("number", "value"), list(step.numbers.items()))
        radios = "".join(
            f"<input type='radio' class='shade-{key}' name='{root}-shade' id='{root}-{key}'"
            f"{' checked' if key == 'a' else ''}><label for='{root}-{key}'>{label}</label> "
            for key, label in _SHADES)
        scales = self.scales
        legend = ("<div class='legend'>marks: <span class='tok clipped'>clipped</span> "
                  "<span class='tok dropped'>dropped</span> <span class='tok capped'>capped"
                  "</span> <span class='tok prompt'>not trained</span>; share: the row's part "
                  "of the step's gradient weight (|dloss/dlogp|); strongest colour at "
                  f"|advantage| {scales['a']:.3g}, |log ratio| {scales['r']:.3g}</div>")
        rows = "".join(self._row(b) for b in range(len(step.rows)))
        norms = table(("layer", "gradient norm (before clipping)"), step.layer_norms)
        return (_STYLE.format(id=root) + f"<div id='{root}' class='astranb-inspector'>{head}"
                f"{numbers}<div class='legend'>shade by:</div>{radios}{legend}"
                f"<div class='rows'>{rows}</div>{norms}</div>")

    def save_html(self, path: str | os.PathLike[str]) -> Path:
        """Write the view as one standalone HTML page."""
        path = Path(path)
        title = html.escape(f"astranb step {self.step.step} of {self.step.policy}")
        path.write_text("<!DOCTYPE html>\n<html lang=\"en\">\n<head>\n<meta charset=\"utf-8\">\n"
                        f"<title>{title}</title>\n</head>\n<body>\n{self.html(standalone=True)}"
                        "\n</body>\n</html>\n", encoding="utf-8")
        return path

    def display(self) -> None:
        """Show the view in the current cell (its text outside a kernel)."""
        if not in_kernel():
            print(self.step.text())
            return
        publish({"text/html": self.html(), "text/plain": repr(self.step)})

    def _row(self, b: int) -> str:
        step, t = self.step, self.step.trace.tensors
        info = step.rows[b]
        marks = {name: m[b] for name, m in step.masks.items()}
        ids = t["input_ids_B_T"][b].tolist()
        attention = t["attention_mask_B_T"][b].tolist()
        trained = (t["loss_mask_B_T"][b] > 0).tolist()
        logp, old = t["logp_B_T"][b].tolist(), t["old_logp_B_T"][b].tolist()
        adv, versions = t["advantages_B_T"][b].tolist(), t["versions_B_T"][b].tolist()
        scales = self.scales
        spans = []
        for i, token in enumerate(ids):
            if not attention[i]:
                continue
            text = html.escape(step.token_text(token))
            if not trained[i]:
                spans.append(f"<span class='tok prompt' title='id {token}'>{text}</span>")
                continue
            names = [name for name, m in marks.items() if bool(m[i])]
            log_ratio = logp[i] - old[i]
            colors = (_diverging(adv[i] / scales["a"], (37, 99, 235), (220, 38, 38)),
                      _diverging(log_ratio / scales["r"], (22, 163, 74), (147, 51, 234)),
                      _diverging(abs(log_ratio) / scales["g"], (234, 88, 12), (234, 88, 12)))
            tip = (f"id {token} · advantage {adv[i]:+.3g} · ratio {math.exp(log_ratio):.3g} · "
                   f"logp {logp[i]:.3g} (engine {old[i]:.3g}) · version {versions[i]}"
                   + "".join(f" · {n}" for n in names))
            spans.append(f"<span class='tok trained {' '.join(names)}' title='{html.escape(tip)}'"
                         f" style='--r:{colors[1]};--g:{colors[2]};background:{colors[0]}'>"
                         f"{text}</span>")
        counts = "".join(f" · {name} {info[name]}" for name in marks)
        versions_text = ",".join(str(v) for v in info["versions"]) or "-"
        head = (f"row {b} · reward {info['reward']:.3g} · advantage {info['advantage']:+.3g} · "
                f"{info['tokens']} trained tokens · versions {versions_text} · share "
                f"{info['share']:.1%} · gap {info['gap_mean']:.3g}{counts}")
        return (f"<div class='row'><div class='rowhead'>{html.escape(head)}</div>"
                f"<div class='tokens'>{''.join(spans)}</div></div>")


def _largest(values) -> float:
    """The largest of a tensor's values, 1 when there are none or all are 0."""
    return float(values.max()) if values.numel() and float(values.max()) > 0 else 1.0


def _diverging(value: float, above: tuple[int, int, int], below: tuple[int, int, int]) -> str:
    """A translucent colour for value in [-1, 1] (clamped): `above` for > 0, `below` for < 0."""
    value = max(-1.0, min(1.0, value))
    r, g, b = above if value >= 0 else below
    return f"rgba({r},{g},{b},{abs(value) * 0.6:.2f})"
