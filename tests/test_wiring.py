"""session.wiring (text, HTML, problems, apply/parse) and the wiring widget, built headless."""

from __future__ import annotations

import sys

import pytest

import astranb as ab
from astranb.session.wiring import parse

from .envs import CountA, TwoRoles

TINY = ab.models.tiny(hidden_size=32, num_heads=2)  # named "tiny-qwen3-32x2"


@pytest.fixture
def session(tmp_path):
    """Two policies, "solver" and "verifier", nothing wired yet."""
    with ab.Session(tmp_path / "runs") as session:
        session.policy("solver", TINY, max_batch_size=8)
        session.policy("verifier", TINY, max_batch_size=8)
        yield session


@pytest.fixture
def widgets():
    """astranb.notebook.widgets for one test, then forgotten again: test_api checks in this same
    process that `import astranb` alone never loads ipywidgets."""
    before = set(sys.modules)
    from astranb.notebook import widgets

    yield widgets
    for name in set(sys.modules) - before:
        if name.startswith(("ipywidgets", "astranb.notebook.widgets")):
            del sys.modules[name]
    if "astranb.notebook.widgets" not in before:
        del sys.modules["astranb.notebook"].widgets


def policies(session):
    return session.policies["solver"], session.policies["verifier"]


# -- text form ---------------------------------------------------------------------------------
def test_text_of_two_policy_environment(session):
    solver, verifier = policies(session)
    session.wire(TwoRoles(), solver=solver, verifier=verifier)
    assert session.wiring.text() == (
        "TwoRoles (weight 1.0)\n"
        "  solver   -> policy 'solver'   (tiny-qwen3-32x2, hf)\n"
        "  verifier -> policy 'verifier' (tiny-qwen3-32x2, hf)\n"
        "problems: none"
    )
    assert repr(session.wiring) == session.wiring.text()


def test_text_of_shared_parameters(session):
    solver, _ = policies(session)
    session.wire(TwoRoles(), solver=solver, verifier=solver)
    lines = session.wiring.text().splitlines()
    assert lines[:4] == [
        "TwoRoles (weight 1.0)",
        "  solver   -> policy 'solver' (tiny-qwen3-32x2, hf)",
        "  verifier -> policy 'solver' (tiny-qwen3-32x2, hf)",
        "  shared parameters: policy 'solver' fills solver, verifier",
    ]
    # the other policy trains in no run: a warning, not an error
    assert lines[4] == "problems:"
    assert lines[5].startswith("  - warning: policy 'verifier' is not wired")


def test_text_of_several_environments_shows_their_shares(session):
    solver, verifier = policies(session)
    session.wire(TwoRoles(), solver=solver, verifier=verifier)
    session.wire(CountA(), weight=3, solver=verifier)
    text = session.wiring.text()
    assert "TwoRoles (weight 1.0, ~25% of groups)" in text
    assert "CountA (weight 3.0, ~75% of groups)\n  solver -> policy 'verifier'" in text


# -- problems ----------------------------------------------------------------------------------
def test_unwired_role_names_the_fix(session):
    solver, _ = policies(session)
    session.wire(TwoRoles(), solver=solver)
    problems = session.wiring.problems()
    assert any("session.wire(env, verifier=<policy>)" in p and "TwoRoles" in p for p in problems)
    assert "  verifier -> (not wired)" in session.wiring.text()


def test_unused_policy_is_a_warning_with_the_fix(session):
    solver, _ = policies(session)
    session.wire(CountA(), solver=solver)
    assert session.wiring.problems(warnings=False) == []  # a run could start
    (warning,) = session.wiring.problems()
    assert warning.startswith("warning: policy 'verifier' is not wired to any environment")
    assert "session.wire(env, solver=session.policies['verifier'])" in warning


def test_cleared_wiring(session):
    solver, verifier = policies(session)
    session.wire(TwoRoles(), solver=solver, verifier=verifier)
    session.context.wiring.clear()
    assert session.wiring.problems() == ["nothing is wired; call session.wire(env, role=policy) "
                                         "first"]
    assert session.wiring.environments == []
    assert session.wiring.text().startswith("no environment is wired; policies: 'solver' "
                                            "(tiny-qwen3-32x2, hf), 'verifier'")


# -- apply and parse ---------------------------------------------------------------------------
def test_apply_parsed_text_keeps_the_weight(session):
    solver, verifier = policies(session)
    env = session.wire(TwoRoles(), weight=2, solver=solver, verifier=verifier)
    assert parse("solver=verifier,\n verifier='solver'") == {"solver": "verifier",
                                                             "verifier": "solver"}
    session.wiring.apply("TwoRoles", **session.wiring.parse("solver=verifier, verifier=solver"))
    assert session.context.wiring == [(env, {"solver": verifier, "verifier": solver}, 2.0)]


def test_apply_and_parse_errors_say_the_fix(session):
    with pytest.raises(ValueError, match="role=policy pairs"):
        parse("solver verifier")
    with pytest.raises(ValueError, match="given twice"):
        parse("solver=a, solver=b")
    with pytest.raises(ValueError, match=r"policies are \['solver', 'verifier'\]"):
        session.wiring.apply(TwoRoles(), solver="nobody")


# -- HTML --------------------------------------------------------------------------------------
def test_html_form(session):
    solver, _ = policies(session)
    session.wire(TwoRoles(), solver=solver)
    page = session.wiring._repr_html_()
    assert page.startswith('<div class="astranb-wiring"><table')
    assert "TwoRoles" in page and "<b>solver</b>" in page and "tiny-qwen3-32x2 &middot; hf" in page
    assert '<span style="color:#c00000">not wired</span>' in page
    assert '<li style="color:#c00000">role(s) [\'verifier\'] of TwoRoles' in page
    assert "verifier=&lt;policy&gt;" in page
    assert "<script" not in page
    assert page in session._repr_html_()  # the session shows its policies, then the wiring
    assert repr(session) == (f"Session({str(session.directory)!r}, policies=['solver', "
                             "'verifier'], environments=['TwoRoles'])")


# -- widget ------------------------------------------------------------------------------------
def test_widget_rewires_the_session_on_apply(session, widgets):
    solver, verifier = policies(session)
    env = session.wire(TwoRoles(), solver=solver)
    form = widgets.wiring_widget(session)
    assert isinstance(form, widgets.WiringWidget)
    dropdowns = form.dropdowns["TwoRoles"]
    assert dropdowns["solver"].options == ("solver", "verifier") == tuple(session.policies)
    assert (dropdowns["solver"].value, dropdowns["verifier"].value) == ("solver", None)
    assert "verifier=&lt;policy&gt;" in form.problems.value

    dropdowns["verifier"].value = "verifier"
    assert "not applied yet" in form.status.value
    assert session.context.wiring == [(env, {"solver": solver}, 1.0)]  # not before Apply

    form.apply_buttons["TwoRoles"].click()
    assert session.context.wiring == [(env, {"solver": solver, "verifier": verifier}, 1.0)]
    assert session.wiring.problems(warnings=False) == []
    assert "ready to train" in form.problems.value
    assert "<b>verifier</b>" in form.graph.value
    assert "TwoRoles wired" in form.status.value

    # shared parameters: the run could start, but policy 'verifier' would not train
    form.dropdowns["TwoRoles"]["verifier"].value = "solver"
    form.apply_buttons["TwoRoles"].click()
    assert session.context.wiring == [(env, {"solver": solver, "verifier": solver}, 1.0)]
    assert session.wiring.problems(warnings=False) == []
    assert "warning: policy 'verifier' is not wired" in form.problems.value


def test_widget_refresh_and_apply_errors(session, widgets):
    solver, _ = policies(session)
    session.wire(TwoRoles(), solver=solver)
    form = widgets.wiring_widget(session)
    session.wire(CountA(), solver=solver)  # wired in another cell
    form.refresh()
    assert list(form.dropdowns) == ["TwoRoles", "CountA"]

    form.dropdowns["CountA"]["solver"].value = "verifier"
    del session.policies["verifier"]  # gone before Apply: the error shows, nothing raises
    form.apply_buttons["CountA"].click()
    assert "Apply (CountA) failed: no policy named 'verifier'" in form.status.value
    assert form.dropdowns["CountA"]["solver"].options == ("solver",)
