"""Notebook displays: Session, Policy and Run render useful HTML (escaped) and text."""

from __future__ import annotations

from html.parser import HTMLParser

import astranb as ab
from tests.envs import CountA


class Text(HTMLParser):
    def __init__(self, html, scripts=False):
        super().__init__()
        self.scripts = scripts
        self.parts, self.tags = [], []
        self.feed(html)

    def handle_starttag(self, tag, attrs):
        self.tags.append(tag)
        assert self.scripts or tag != "script", "displays must not carry scripts"

    def handle_data(self, data):
        self.parts.append(data)

    @property
    def text(self):
        return " ".join(p.strip() for p in self.parts if p.strip())


def test_session_policy_and_run_displays(tmp_path):
    session = ab.Session(tmp_path / "runs<x>")
    empty = Text(session._repr_html_()).text
    assert "no policies yet" in empty and "runs<x>" in empty  # escaped, read back as text
    policy = session.policy("solver", model=ab.models.tiny(hidden_size=32, num_heads=2),
                            algorithm=ab.GRPO(entropy_coef=0.05), max_batch_size=32)
    session.wire(CountA(), solver=policy)
    page = Text(policy._repr_html_()).text
    assert "Policy 'solver'" in page and "version 0" in page and "entropy_coef=0.05" in page
    assert "HFEngine" in page and f"checksum {policy.weights_checksum:016x}" in page
    with session:
        run = session.train(steps=3, batch_size=8, group_size=4, max_staleness=1)
        run.wait(progress=False)
        text = Text(run._repr_html_()).text
        assert "finished, 3/3 steps, batch 8 (groups of 4), max_staleness 1, independent" in text
        assert "solver 3" in text and "run.dashboard()" in text
        assert repr(run).startswith("Run(finished, 3/3 steps")
        after = Text(policy._repr_html_()).text
        assert "version 3" in after and f"checksum {policy.weights_checksum:016x}" in after
        assert f"{policy.weights_checksum:016x}" not in page
        page = Text(session._repr_html_()).text
        assert "embedded" in page and "1 run(s): finished" in page
        assert "solver" in page and "CountA" in page  # the wiring is part of it


def test_trajectory_text_and_html():
    from astranb.types import Generation, SamplingParams, ToolCall, Trajectory, Turn

    gen = Generation((1, 5), (7, 2), (-0.5, -1.25), (3, 4), "stop", "a7")
    turn = Turn("solver", "p", gen, SamplingParams())
    traj = Trajectory({"prompt": "ab="}, (turn,), {"solver": 0.5}, 7, None, 3, "7.0",
                      (ToolCall("check", {"text": "a7"}, True, None, 1),), "Arithmetic")
    text = repr(traj)
    assert text == ("Trajectory(Arithmetic 7.0 group 7: [solver: 'a7' (2 tokens, v3-4)], "
                    "1 tool call(s), rewards={'solver': 0.5})")
    page = Text(traj._repr_html_(), scripts=True).text  # the stepping viewer has a little JS
    assert "check" in page and "0.5" in page
