"""The step-through episode debugger: step order, edit-and-rescore, the HTML export, the widget.

Most tests drive episodes with scripted policies (an engine that answers from a list), so the
expected steps and rewards are known exactly; a few use a tiny real model and a short real run.
"""

from __future__ import annotations

import json
import types
from html.parser import HTMLParser

import anyio
import pytest
from astranb_actor_verifier import ActorVerifier
from astranb_arithmetic import Arithmetic, check

import astranb as ab
from astranb.notebook.replay import ReplayError, encode
from astranb.weights.publish import StatePublisher

from .envs import CountA, ToolBetween
from .services import in_process_services

SAMPLE = {"prompt": "1+2=", "answer": 3}


class ScriptedEngine:
    """Completes each prompt with the next scripted text; logprob -0.5 and a fixed version."""

    def __init__(self, tokenizer, texts, version=0):
        self.tokenizer, self.texts, self.version = tokenizer, list(texts), version

    async def generate(self, request):
        ids = tuple(encode(self.tokenizer, self.texts.pop(0)))
        n = len(ids)
        return ab.Generation(request.prompt_ids, ids, (-0.5,) * n, (self.version,) * n, "stop",
                             text=self.tokenizer.decode(ids))


def scripted(name, *texts, version=0):
    spec = ab.models.tiny()
    tok = spec.tokenizer()
    trainer = types.SimpleNamespace(version=version)
    engine = ScriptedEngine(tok, texts, version)
    return ab.Policy(name, spec, ab.GRPO(), ab.AdamWConfig(), engine, trainer,
                     StatePublisher(name, engine, trainer), tok)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """A session with one tiny real policy (built once for the module)."""
    session = ab.Session(tmp_path_factory.mktemp("debugger") / "runs")
    policy = session.policy("solver", model=ab.models.tiny(hidden_size=32, num_heads=2),
                            max_batch_size=32)
    yield session, policy
    session.close()


# -- stepping --------------------------------------------------------------------------------------

def test_steps_follow_the_episodes_calls():
    dbg = ab.debug(ToolBetween(), SAMPLE, solver=scripted("p", "aab", "3"))
    kinds = [(s.kind, s.turn, s.tool) for s in dbg.steps]
    assert kinds == [("generate", 0, ""), ("tool", -1, "count_a"), ("generate", 1, ""),
                     ("tool", -1, "check"), ("reward", -1, "")]
    first, count, second, check, reward = dbg.steps
    assert (first.prompt, first.completion, first.tokens) == ("1+2=", "aab", ("a", "a", "b"))
    assert first.logprobs == (-0.5,) * 3 and first.versions == (0,) * 3
    assert count.args == {"text": "aab"} and count.result == 2   # an async tool, awaited
    assert second.prompt == "1+2=2="                                 # the tool's answer went in
    assert check.args == {"text": "3", "prefix": "3"} and check.result is True
    assert reward.rewards == {"solver": 1.0} and dbg.rewards == {"solver": 1.0}
    assert [s.index for s in dbg.steps] == list(range(5))


def test_forward_back_goto_and_run_until():
    dbg = ab.debug(ToolBetween(), SAMPLE, solver=scripted("p", "aab", "9"))
    assert dbg.position == 0 and dbg.current.kind == "generate"
    assert dbg.back().index == 0                        # stays on the first step
    assert dbg.forward().tool == "count_a" and dbg.position == 1
    assert dbg.goto(-1).kind == "reward" and dbg.position == 4
    assert dbg.forward().index == 4                     # stays on the last step
    dbg.goto(0)
    assert dbg.run_until(lambda s: s.kind == "tool" and s.result is False).tool == "check"
    assert dbg.position == 3
    with pytest.raises(LookupError, match="no step after step 3 .* still at step 3"):
        dbg.run_until(lambda s: s.kind == "generate")
    assert dbg.position == 3
    with pytest.raises(IndexError, match="step 5 does not exist; this episode has 5 steps"):
        dbg.goto(5)


def test_a_fresh_episode_on_a_tiny_model(tiny):
    session, policy = tiny
    dbg = ab.debug(ToolBetween(), SAMPLE, solver=policy)
    tok = policy.tokenizer
    turns = [s for s in dbg.steps if s.kind == "generate"]
    assert len(turns) == 2 and [s.kind for s in dbg.steps].count("tool") == 2
    for step in turns:
        assert "".join(step.tokens) == tok.decode(list(step.token_ids), skip_special_tokens=False)
        assert len(step.logprobs) == len(step.token_ids) == len(step.versions) > 0
        assert all(lp <= 0 for lp in step.logprobs) and set(step.versions) == {policy.version}
        assert step.origin == "sampled"
    assert dbg.steps[-1].rewards["solver"] in (0.0, 1.0)


def test_debug_inside_a_running_event_loop(tiny):
    """A notebook cell runs in a thread whose event loop is running: debug() still works."""
    _, policy = tiny

    async def cell():
        return ab.debug(Arithmetic(), {"prompt": "3+4=", "answer": 7}, solver=policy)

    dbg = anyio.run(cell)
    assert [s.kind for s in dbg.steps] == ["generate", "tool", "reward"]


# -- edit and rescore ------------------------------------------------------------------------------

@pytest.mark.parametrize("said, edited, before, after", [("5", "7", 0.0, 1.0), ("7", "5", 1.0, 0.0),
                                                          ("7", "71", 1.0, 0.0)])
def test_edit_and_rescore_follows_the_environment(said, edited, before, after):
    env = Arithmetic()
    dbg = ab.debug(env, {"prompt": "3+4=", "answer": 7}, solver=scripted("p", said))
    assert dbg.rewards == {"solver": before}
    fixed = dbg.edit(0, edited).rescore()
    assert fixed.rewards == {"solver": after}
    step = fixed.current                                   # the new debugger opens on the edit
    assert (step.kind, step.origin, step.completion) == ("generate", "edited", edited)
    assert step.token_ids == tuple(encode(ab.models.tiny().tokenizer(), edited))
    assert step.logprobs == (None,) * len(step.token_ids)  # no model sampled it
    assert fixed.steps[1].args == {"completion": edited, "answer": 7}   # the tool ran again
    assert fixed.steps[-1].note == f"before the edit: {{'solver': {before}}}"
    assert dbg.rewards == {"solver": before} and dbg.edits == {}   # the original is unchanged


def test_turns_after_an_edit_are_sampled_when_policies_are_there():
    # turn 0 said "bbb" (no 'a'); edited to "aa", turn 1's prompt becomes "1+2=2=" and is
    # sampled afresh: the script's next answer "3" is right
    dbg = ab.debug(ToolBetween(), SAMPLE, solver=scripted("p", "bbb", "9", "3"))
    assert dbg.rewards == {"solver": 0.0}
    new = dbg.edit(0, "aa").rescore()
    turn1 = new.steps[2]
    assert (turn1.prompt, turn1.completion, turn1.origin) == ("1+2=2=", "3", "sampled")
    assert new.steps[1].result == 2 and new.rewards == {"solver": 1.0}


def test_recorded_turns_after_an_edit_are_replayed_with_a_note():
    recorded = ab.debug(ToolBetween(), SAMPLE, solver=scripted("p", "bbb", "3")).episode
    dbg = recorded.debugger()                              # no policies: replay after the edit
    new = dbg.edit(0, "aa").rescore()
    turn1 = new.steps[2]
    assert (turn1.prompt, turn1.completion, turn1.origin) == ("1+2=2=", "3", "replayed")
    assert "prompt differs from the recorded one" in turn1.note
    assert new.rewards == {"solver": 1.0}
    unchanged = dbg.edit(1, "3").rescore().steps[0]        # before the edit: as recorded
    assert (unchanged.origin, unchanged.note, unchanged.completion) == ("replayed", "", "bbb")


def test_actor_verifier_rescore_rejudges_the_first_answer():
    # wrong first answer, rejected, fixed on the retry: solver 0.5 (the retry's discount),
    # verifier 0.5 * 1 (right verdict) + 0.5 * 0.5 (the solver's reward) = 0.75. Edit the first
    # answer to the right one: the recorded "n" now rejects a right answer (verdict 0), the solver
    # is right at once (1), so the verifier gets 0.5 * 0 + 0.5 * 1 = 0.5
    env = ActorVerifier()
    dbg = ab.debug(env, {"prompt": "3+4=", "answer": 7},
                   solver=scripted("alice", "5", "7"), verifier=scripted("bob", "n"))
    assert [s.role or s.tool for s in dbg.steps[:-1]] == [
        "solver", "verifier", "check", "solver", "check"]
    assert dbg.rewards == {"solver": 0.5, "verifier": 0.75}
    episode = dbg.episode
    new = episode.debugger().edit(0, "7").rescore()
    assert new.rewards == {"solver": 1.0, "verifier": 0.5}
    assert new.steps[1].origin == "replayed" and "prompt differs" in new.steps[1].note


def test_rescore_needs_a_turn_it_cannot_make():
    # edited so the verifier rejects: the episode now wants a retry the recording never made
    env = ActorVerifier()
    dbg = ab.debug(env, {"prompt": "3+4=", "answer": 7},
                   solver=scripted("alice", "7"), verifier=scripted("bob", "y"))
    recorded = dbg.episode.debugger().edit(1, "n")
    with pytest.raises(ReplayError, match=r"turn 2 \('solver'\).*no policy is wired"):
        recorded.rescore()
    assert recorded.edits == {1: "n"}                      # kept: nothing was re-scored


class IdsPrompt(Arithmetic):
    """Builds its prompt as token ids with ctx.tokenizer (which a replay must answer too)."""

    async def episode(self, ctx, sample):
        ids = ctx.tokenizer("solver").encode(sample["prompt"])
        out = await ctx.generate("solver", ids)
        return 1.0 if await ctx.tool("check", check, out.text, sample["answer"]) else 0.0


def test_a_replay_answers_the_tokenizer_and_token_id_prompts():
    recorded = ab.debug(IdsPrompt(), {"prompt": "3+4=", "answer": 7},
                        solver=scripted("p", "5")).episode
    new = recorded.debugger().edit(0, "7").rescore()
    assert new.rewards == {"solver": 1.0}
    assert (new.steps[0].prompt, new.steps[0].note) == ("3+4=", "")
    bare = ab.Episode.from_json(recorded.to_json())          # no tokenizer to answer with
    with pytest.raises(ReplayError, match="tokenizer of role 'solver'"):
        bare.debugger().rescore(env=IdsPrompt())


# -- the HTML viewer -------------------------------------------------------------------------------

class Collector(HTMLParser):
    """Sections, data blocks and every URL-bearing attribute of a page."""

    def __init__(self):
        super().__init__()
        self.sections, self.urls, self.data, self.scripts = [], [], [], 0
        self._in_data = False

    def handle_starttag(self, tag, attrs):
        attrs = dict(attrs)
        if tag == "section":
            self.sections.append(attrs)
        self.urls += [attrs[a] for a in ("src", "href") if a in attrs]
        if tag == "script":
            self.scripts += 1
            self._in_data = attrs.get("type") == "application/json"
        if tag == "link":
            self.urls.append(attrs.get("href", ""))

    def handle_endtag(self, tag):
        if tag == "script":
            self._in_data = False

    def handle_data(self, data):
        if self._in_data:
            self.data.append(data)


def test_exported_html_is_self_contained_and_holds_every_step(tmp_path):
    dbg = ab.debug(ToolBetween(), SAMPLE, solver=scripted("p", "a<b>", "</script>"))
    dbg = dbg.edit(1, "3").rescore()
    path = dbg.export_html(tmp_path / "out" / "episode.html")
    page = path.read_text(encoding="utf-8")
    parser = Collector()
    parser.feed(page)
    parser.close()
    assert page.startswith("<!DOCTYPE html>")
    assert [(int(s["data-step"]), s["data-kind"]) for s in parser.sections] == [
        (s.index, s.kind) for s in dbg.steps]
    assert not [u for u in parser.urls if u.startswith(("http://", "https://", "//"))]
    assert "http://" not in page and "https://" not in page
    (data,) = parser.data
    embedded = json.loads(data)
    assert embedded["steps"] == [s.to_json() for s in dbg.steps]
    assert embedded["position"] == dbg.position == 2
    for step in dbg.steps:                                  # each step's text is in the page
        needle = {"generate": step.completion, "tool": step.tool, "reward": "reward per role"}
        assert needle[step.kind].replace("<", "&lt;").replace(">", "&gt;") in page
    assert "before the edit" in page and "Prev" in page and "ArrowRight" in page
    # the notebook form is the same viewer, and a second one gets an id of its own
    fragment = Collector()
    fragment.feed(dbg._repr_html_())
    assert [s["data-step"] for s in fragment.sections] == [s["data-step"] for s in parser.sections]
    assert fragment.data == parser.data
    assert dbg._repr_html_() != dbg._repr_html_()


def test_token_shading_and_titles():
    dbg = ab.debug(Arithmetic(), {"prompt": "3+4=", "answer": 7}, solver=scripted("p", "7"))
    html = dbg.step_html(0)
    assert "logprob -0.500 (p=0.607) · version 0" in html and "rgba(214,39,40," in html
    assert "'7'" in repr(dbg.steps[0]) and "-0.50" in repr(dbg)


class StepHeads(HTMLParser):
    """Each step header's text as a browser's textContent gives it: the text nodes inside
    `<div class="head">` of a step, joined with nothing (no space is added between elements)."""

    def __init__(self):
        super().__init__()
        self.heads, self.roots, self._depth, self._section = [], [], 0, False

    def handle_starttag(self, tag, attrs):
        classes = (dict(attrs).get("class") or "").split()
        if tag == "div" and "astranb-dbg" in classes:
            self.roots.append(self._section)              # a root opened before any step?
        if tag == "section":
            self._section = True
        if self._depth:
            self._depth += 1
        elif tag == "div" and "head" in classes and self._section:
            self._depth = 1
            self.heads.append("")

    def handle_endtag(self, tag):
        if self._depth:
            self._depth -= 1

    def handle_data(self, data):
        if self._depth:
            self.heads[-1] += data


def step_heads(page):
    parser = StepHeads()
    parser.feed(page)
    parser.close()
    return parser


def test_step_headers_read_as_separate_words():
    from astranb.notebook.widgets import debugger_widget

    dbg = ab.debug(ToolBetween(), SAMPLE, solver=scripted("solver", "aab", "3"))
    head = "step 0 (of 0–4): turn 0 solver · role solver → policy solver · sampled · versions [0]"
    pane = step_heads(debugger_widget(dbg).pane.value)      # the widget's pane, as it shows it
    assert pane.heads == [head]
    assert "solversolver" not in pane.heads[0] and "sampledversions" not in pane.heads[0]
    assert pane.roots == [False]      # inside an .astranb-dbg root, so the stylesheet applies
    for page in (dbg._repr_html_(), dbg.to_html()):         # the notebook viewer and the export
        heads = step_heads(page).heads
        assert heads[0] == head and len(heads) == len(dbg.steps)
        assert heads[2].startswith("step 2 (of 0–4): turn 1 solver · role solver → policy")
        assert heads[1] == "step 1 (of 0–4): tool count_a"
    assert "[0] turn 0 solver -> solver (sampled, stop, versions [0])" in repr(dbg)  # text form


# -- recorded episodes of a real run ---------------------------------------------------------------

def test_run_episodes_step_and_rescore(tiny, tmp_path):
    session, policy = tiny
    env = ab.environments.load("arithmetic")
    session.wire(env, solver=policy)
    run = session.train(steps=1, batch_size=4, group_size=2, max_staleness=0).wait(progress=False)
    episode = run.episodes[0]
    assert episode.env == "Arithmetic" and episode.environment is env
    assert [c["name"] for c in episode.tool_calls] == ["check"]
    dbg = episode.debugger()
    assert [s.kind for s in dbg.steps] == ["generate", "tool", "reward"]
    assert dbg.steps[0].token_ids == tuple(episode.turns[0]["completion_ids"])
    assert "".join(dbg.steps[0].tokens).startswith(episode.turns[0]["completion"])
    answer = str(episode.sample["answer"])
    assert dbg.edit(0, answer).rescore().rewards == {"solver": 1.0}
    assert dbg.edit(0, "x").rescore().rewards == {"solver": 0.0}
    # the run's folder keeps the tool calls and the environment's name, not the environment
    loaded = ab.open_run(run.directory).episodes[0]
    line = loaded.to_json()
    assert line["tool_calls"] == list(episode.tool_calls) and line["env"] == "Arithmetic"
    assert loaded == episode and loaded.environment is None
    with pytest.raises(ValueError, match=r"does not know its environment.*rescore\(env="):
        loaded.debugger().edit(0, answer).rescore()
    assert loaded.debugger().edit(0, answer).rescore(env=env).rewards == {"solver": 1.0}
    assert loaded.debugger().steps[0].tokens[0].startswith("#")   # no tokenizer: ids


@pytest.mark.slow  # a run over a rollout service
def test_episodes_played_on_a_rollout_service_carry_their_tool_calls(tmp_path):
    session, _, _ = in_process_services(lambda **kw: ab.Session(tmp_path, **kw), rollouts=1,
                                        trainer=False)
    with session:
        policy = session.policy("solver", ab.models.tiny(hidden_size=32, num_heads=2))
        env = ToolBetween()
        session.wire(env, solver=policy)
        run = session.train(steps=1, batch_size=4, group_size=2).wait(progress=False)
        episode = next(e for e in run.episodes if e.error is None)
    assert episode.env == "ToolBetween" and episode.environment is env
    assert [c["name"] for c in episode.tool_calls] == ["count_a", "check"]
    assert [c["position"] for c in episode.tool_calls] == [1, 2]
    new = episode.debugger().edit(1, str(episode.sample["answer"])).rescore()
    assert new.rewards == {"solver": 1.0}


# -- tool calls and bad input ----------------------------------------------------------------------

def test_tool_calls_are_recorded_with_errors_and_reprs():
    ctx = ab.EpisodeContext(CountA(), {})

    def divide(a, b=1):
        return a / b

    async def calls():
        assert await ctx.tool("div", divide, 6, b=3) == 2.0
        assert await ctx.tool("obj", lambda: object) is object
        with pytest.raises(ZeroDivisionError):
            await ctx.tool("div", divide, 1, 0)

    anyio.run(calls)
    ok, obj, failed = ctx.tool_calls
    assert ok == ab.ToolCall("div", {"a": 6, "b": 3}, 2.0, None, 0)
    assert obj.result == "<class 'object'>"
    assert failed.error == "ZeroDivisionError: division by zero" and failed.result is None


def test_error_messages_say_what_to_do():
    dbg = ab.debug(Arithmetic(), {"prompt": "3+4=", "answer": 7}, solver=scripted("p", "5"))
    with pytest.raises(IndexError, match=r"turn 3 does not exist; this episode made 1 generate"):
        dbg.edit(3, "7")
    with pytest.raises(IndexError, match="not a step index"):
        dbg.edit(-1, "7")
    with pytest.raises(TypeError, match="must be text"):
        dbg.edit(0, 7)
    with pytest.raises(ValueError, match=r"unknown role\(s\) \['judge'\].*solver=policy"):
        ab.debug(Arithmetic(), {"prompt": "3+4=", "answer": 7}, solver=scripted("p", "5"),
                 judge=scripted("q", "y"))
    with pytest.raises(ValueError, match=r"no policy for role\(s\) \['verifier'\]"):
        ab.debug(ActorVerifier(), {"prompt": "3+4=", "answer": 7}, solver=scripted("p", "5"))
    with pytest.raises(TypeError, match="must be given a Policy"):
        ab.debug(Arithmetic(), {"prompt": "3+4=", "answer": 7}, solver="p")
    with pytest.raises(ValueError, match="unknown environment 'nope'"):
        ab.debug("nope", None)


def test_a_failed_episode_is_shown_with_its_traceback():
    dbg = ab.debug(ToolBetween(), {"prompt": "1+2="}, solver=scripted("p", "a", "3"))  # no answer
    last = dbg.steps[-1]
    assert last.kind == "reward" and "KeyError: 'answer'" in last.error and dbg.rewards == {}
    assert "FAILED" in repr(dbg) and "the episode failed" in dbg.to_html()


def test_show_prints_the_text_outside_a_kernel(monkeypatch, capsys):
    dbg = ab.debug(Arithmetic(), {"prompt": "3+4=", "answer": 7}, solver=scripted("p", "5"))
    episode = dbg.episode
    for mode in ("none", "static", "widgets"):
        monkeypatch.setenv("ASTRANB_DISPLAY", mode)
        dbg = episode.show()
        assert isinstance(dbg, ab.EpisodeDebugger)
        out = capsys.readouterr().out
        assert "tool check(completion='5', answer=7) -> False" in out
        assert "rewards {'solver': 0.0}" in out


# -- the widget ------------------------------------------------------------------------------------

def test_widget_buttons_only_drive_the_debugger():
    from astranb.notebook.widgets import debugger_widget

    dbg = ab.debug(ToolBetween(), SAMPLE, solver=scripted("p", "aab", "9"))
    w = debugger_widget(dbg)
    assert w.slider.max == 4 and w.slider.value == 0 and "turn 0 solver" in w.pane.value
    assert w.editor.value == "aab" and not w.editor.disabled
    w.forward_button.click()
    assert dbg.position == 1 and w.slider.value == 1 and w.editor.disabled
    w.next_tool_button.click()
    assert dbg.position == 3
    w.next_tool_button.click()                              # none left: a message, no move
    assert dbg.position == 3 and "no step after step 3" in w.status.value
    w.back_button.click()
    assert dbg.position == 2 and w.editor.value == "9"
    w.slider.value = 0
    assert dbg.position == 0
    w.slider.value = 2
    w.editor.value = "3"
    w.rescore_button.click()
    assert w.debugger is not dbg and w.debugger.rewards == {"solver": 1.0}
    assert w.debugger.position == 2 and w.slider.value == 2
    assert "rewards {'solver': 0.0} -&gt; {'solver': 1.0}" in w.status.value
