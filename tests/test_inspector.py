"""The training-step inspector: what a sampled step trained, recorded by the trainer, kept in the
run folder, read back and shown."""

from __future__ import annotations

import math
from dataclasses import dataclass

import pytest
import torch

import astranb as ab
from astranb.algorithms import DAPO, GRPO, GSPO, M2PO
from astranb.training.local import LocalTrainer
from astranb.training.trace import StepTrace
from astranb.types import Batch

SPEC = ab.models.tiny(hidden_size=32, num_heads=2)


def stale_batch(rows: int = 6, length: int = 12, seed: int = 0) -> Batch:
    """A batch whose engine logprobs are far from the trainer's (as after many versions of
    staleness), so the clip binds on some tokens and M2PO drops some."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, 60, (rows, length), generator=g)
    mask = torch.zeros(rows, length)
    mask[:, 4:] = 1
    mask[0, -3:] = 0  # a shorter row
    old = (-4 + torch.randn(rows, length, generator=g)) * mask
    sign = torch.tensor([1.0, -1.0] * (rows // 2))[:, None]
    return Batch(ids, torch.ones(rows, length, dtype=torch.long), mask, old,
                 sign.expand(rows, length) * mask, torch.where(mask > 0, 3, -1),
                 torch.ones(rows), (sign[:, 0] > 0).float())


@pytest.mark.parametrize("algorithm, mask, metric", [
    (GRPO(), "clipped", "clip_frac"), (DAPO(), "clipped", "clip_frac"),
    (GSPO(), "clipped", "clip_frac"), (M2PO(), "dropped", "m2po_masked_frac"),
    (GRPO(tis_cap=1.5), "capped", "tis_capped_frac")])
def test_the_marked_tokens_are_exactly_the_ones_the_metric_counts(algorithm, mask, metric):
    # three micro-batches of two rows: each metric is a token-weighted sum of the three
    trainer = LocalTrainer(SPEC, algorithm, micro_batch_size=2)
    metrics, trace = trainer.step_recorded(stale_batch())
    marked = trace.masks()[mask]
    assert marked.shape == trace.tensors["loss_mask_B_T"].shape
    assert not bool((marked & (trace.tensors["loss_mask_B_T"] == 0)).any())
    counted = metrics[metric] * metrics["tokens"]
    assert int(marked.sum()) == round(counted) and abs(counted - round(counted)) < 1e-3
    if mask != "capped":
        assert int(marked.sum()) > 0  # the test means something


def test_a_recorded_step_trains_exactly_as_a_plain_one_and_keeps_its_numbers():
    torch.manual_seed(0)
    plain = LocalTrainer(SPEC, GRPO(), micro_batch_size=4)
    torch.manual_seed(0)
    recorded = LocalTrainer(SPEC, GRPO(), micro_batch_size=4)
    batch = stale_batch()
    expected = plain.step(batch)
    metrics, trace = recorded.step_recorded(batch)
    assert metrics == expected and recorded.version == plain.version == 1
    for name, value in plain.weights().items():
        assert torch.equal(value, recorded.weights()[name])
    t = trace.tensors
    # the gradient norm before clipping is the per-parameter norms' combination
    assert float(t["grad_norm_P"].square().sum().sqrt()) == pytest.approx(metrics["grad_norm"],
                                                                           rel=1e-5)
    assert len(trace.header["parameters"]) == t["grad_norm_P"].numel() > 0
    assert torch.equal(t["versions_B_T"], batch.versions_B_T)
    trained = t["loss_mask_B_T"] > 0
    gap = (t["logp_B_T"] - t["old_logp_B_T"]).abs()[trained]
    assert float(gap.mean()) == pytest.approx(metrics["logp_gap_mean"], rel=1e-5)
    # dLoss/dlogp: none off the trained tokens nor on clipped ones, some elsewhere
    grad = t["grad_logp_B_T"]
    assert not bool(grad[~trained].any()) and not bool(grad[trace.masks()["clipped"]].any())
    assert bool(grad[trained & ~trace.masks()["clipped"]].any())


def test_a_trace_round_trips_through_bytes():
    _, trace = LocalTrainer(SPEC, M2PO()).step_recorded(stale_batch())
    back = StepTrace.from_bytes(trace.to_bytes())
    assert back.header == trace.header and set(back.tensors) == set(trace.tensors)
    assert all(torch.equal(back.tensors[k], v) for k, v in trace.tensors.items())
    assert back.tensors["mask/dropped_B_T"].dtype == torch.bool
    assert math.isfinite(float(back.tensors["grad_norm_P"].sum()))


# -- a real run: recorded in the trainer (thread or child process), kept, read back -------------

def short_run(tmp_path, trainer: str, algorithm=None, **train):
    from tests.envs import CountA

    session = ab.Session(tmp_path / "runs", trainer=trainer)
    # a clip range narrower than the engine/trainer mismatch (bf16 copies): real clipping
    policy = session.policy("solver", model=SPEC, max_batch_size=32,
                            algorithm=algorithm or GRPO(clip_low=1e-3, clip_high=1e-3))
    session.wire(CountA(), solver=policy)
    with session:
        run = session.train(**{"steps": 4, "batch_size": 8, "group_size": 4, **train})
        run.wait(progress=False)
    return run


@pytest.mark.parametrize("trainer", ["thread", "process"])
def test_a_real_run_records_sampled_steps_whose_marks_match_their_metrics(tmp_path, trainer):
    run = short_run(tmp_path, trainer, inspect_every=2)
    steps = run.steps
    assert [s.step for s in steps] == [0, 2] and len(steps) == 2
    rows = {r["step"]: r for r in run.rows}
    clipped_somewhere = 0
    for step in steps:
        row = rows[step.step]
        assert step.row["clip_frac"] == row["clip_frac"] and step.policy == "solver"
        clipped = int(step.masks["clipped"].sum())
        assert clipped == round(row["clip_frac"] * row["tokens"])
        clipped_somewhere += clipped
        # the token versions the batch carried, within the row's staleness numbers
        t = step.trace.tensors
        versions = t["versions_B_T"][t["loss_mask_B_T"]]
        assert int(versions.min()) == row["token_version_min"]
        assert int(versions.max()) == row["token_version_max"]
        assert sum(r["share"] for r in step.rows) == pytest.approx(1.0)
        assert step.layer_norms and all(norm >= 0 for _, norm in step.layer_norms)
    assert clipped_somewhere > 0


@dataclass(frozen=True)
class NarrowGRPO(GRPO):
    """A user's own algorithm (it does not travel as JSON): a trainer in a child process takes
    its loss in the caller (training/caller_loss.py)."""

    clip_low: float = 1e-3
    clip_high: float = 1e-3

    @property
    def name(self) -> str:
        return "narrow_grpo"


def test_a_loss_taken_in_the_caller_is_recorded_with_its_own_advantages_and_marks(tmp_path):
    run = short_run(tmp_path, "process", algorithm=NarrowGRPO(), inspect_every=2)
    rows = {r["step"]: r for r in run.rows}
    assert len(run.steps) == 2
    for step in run.steps:
        row, t = rows[step.step], step.trace.tensors
        assert step.trace.header["algorithm"] == "narrow_grpo"
        assert int(step.masks["clipped"].sum()) == round(row["clip_frac"] * row["tokens"])
        # the batch's advantages (GRPO's: one per row), not the gradients the child trained on
        trained = t["loss_mask_B_T"]
        for b in range(trained.shape[0]):
            row_adv = t["advantages_B_T"][b][trained[b]]
            assert bool((row_adv == row_adv[0]).all()) if row_adv.numel() else True
        assert not torch.equal(t["advantages_B_T"], t["grad_logp_B_T"])


@pytest.mark.slow  # a run over in-process rollout and trainer services
@pytest.mark.parametrize("algorithm", [None, NarrowGRPO()], ids=["grpo", "loss_in_caller"])
def test_a_trainer_service_records_the_steps_it_is_asked_to(tmp_path, algorithm):
    from tests.envs import CountA
    from tests.services import in_process_services

    session, apps, _ = in_process_services(lambda **kw: ab.Session(tmp_path / "runs", **kw),
                                           rollouts=1)
    with session:
        policy = session.policy("solver", model=SPEC, max_batch_size=32,
                                algorithm=algorithm or GRPO(clip_low=1e-3, clip_high=1e-3))
        session.wire(CountA(), solver=policy)
        run = session.train(steps=4, batch_size=8, group_size=4, inspect_every=2)
        run.wait(progress=False)
    assert [s.step for s in run.steps] == [0, 2]
    rows = {r["step"]: r for r in run.rows}
    for step in run.steps:
        row = rows[step.step]
        assert int(step.masks["clipped"].sum()) == round(row["clip_frac"] * row["tokens"])
        assert step.layer_norms and step.trace.header["algorithm"] == policy.algorithm.name
    # the service keeps the last recorded step only, by its number
    service = apps["http://t"].state.service
    assert service.policies["solver"].last_trace[0] == 2
    with pytest.raises(Exception, match="no recorded step 1"):
        service.trace("solver", 1)


def test_recorded_steps_round_trip_through_open_run_with_text_and_html(tmp_path, capsys):
    run = short_run(tmp_path, "thread", inspect_every=1)
    record = ab.open_run(run.directory)
    assert len(record.steps) == 4 == len(run.steps)
    step = record.steps[1]
    assert step.step == 1 and step.row == run.steps[1].row
    assert record.steps.at(3, policy="solver").step == 3
    text = step.text()
    assert "step 1 of 'solver' (grpo)" in text and "clip_frac" in text and "row 0:" in text
    clipped_rows = [r for r in step.rows if r["clipped"]]
    assert clipped_rows  # the narrow clip binds
    assert "[" in text  # a clipped token, marked
    # HTML without a kernel: a clipped token is marked with its class, versions are shown
    page = step.save_html(tmp_path / "step.html").read_text()
    assert page.startswith("<!DOCTYPE html>") and "<script" not in page
    assert "tok trained clipped" in page and "version" in page and "shade by" in page
    # the token's text, decoded by the policy's tokenizer when the step was recorded
    t = step.trace.tensors
    b = clipped_rows[0]["row"]
    position = int(step.masks["clipped"][b].nonzero()[0, 0])
    token = step.token_text(int(t["input_ids_B_T"][b, position]))
    assert not token.startswith("<") and token in page or token.strip() == ""
    # outside a kernel show() prints the text; in one, the HTML (also the object's own display)
    step.show()
    assert "step 1 of 'solver'" in capsys.readouterr().out
    assert "tok trained clipped" in step._repr_html_()


def test_storage_is_bounded_to_the_newest_steps_per_policy(tmp_path, monkeypatch):
    monkeypatch.setattr("astranb.session.steps.STEPS_KEPT", 2)
    run = short_run(tmp_path, "thread", inspect_every=1)
    assert [s.step for s in run.steps] == [2, 3]
    files = sorted(p.name for p in (run.directory / "trained-steps" / "solver").iterdir())
    assert files == ["step-000002.safetensors", "step-000003.safetensors"]


def test_no_step_is_recorded_with_inspect_every_0_and_bad_values_say_so(tmp_path):
    run = short_run(tmp_path, "thread", inspect_every=0, steps=2)
    assert len(run.steps) == 0 and not (run.directory / "trained-steps").exists()
    with pytest.raises(ValueError, match="inspect_every must be an integer >= 0"):
        ab.RunConfig(steps=1, batch_size=2, group_size=2, max_staleness=0, inspect_every=-1)


def test_m2po_steps_mark_the_dropped_tokens_its_metric_counts(tmp_path):
    run = short_run(tmp_path, "thread", algorithm=M2PO(threshold=1e-7), inspect_every=1)
    rows = {r["step"]: r for r in run.rows}
    dropped = 0
    for step in run.steps:
        row = rows[step.step]
        count = int(step.masks["dropped"].sum())
        assert count == round(row["m2po_masked_frac"] * row["tokens"])
        dropped += count
    assert dropped > 0


def test_steps_that_teach_nothing_are_flagged_on_the_row_and_the_step():
    from astranb.dataflow.loop import silent_flags

    taught = {"trained_groups": 2, "tied_trained": 1, "completions": 8, "cut_completions": 1,
              "grad_norm": 0.3, "logp_gap_mean": 0.01}
    assert silent_flags(taught) == []
    assert silent_flags({**taught, "tied_trained": 2}) == ["tied"]
    assert silent_flags({**taught, "cut_completions": 4}) == ["truncated"]
    assert silent_flags({**taught, "grad_norm": 0.0}) == ["zero_loss"]
    assert silent_flags({**taught, "logp_gap_mean": 0.5}) == ["mismatch"]


def test_a_run_whose_groups_all_tie_is_flagged_on_every_row_and_recorded_step(tmp_path):
    from tests.envs import CountA

    class Tied(CountA):
        async def episode(self, ctx, sample):
            await ctx.generate("solver", sample["prompt"])
            return 1.0

    session = ab.Session(tmp_path / "runs", trainer="thread")
    policy = session.policy("solver", model=SPEC, max_batch_size=32,
                            algorithm=GRPO(filter_groups=False))
    session.wire(Tied(), solver=policy)
    with session:
        run = session.train(steps=2, batch_size=8, group_size=4, inspect_every=1)
        run.wait(progress=False)
    assert all({"tied", "zero_loss"} <= set(row["flags"]) for row in run.rows)
    assert [s.flags for s in run.steps.flagged()] == [s.flags for s in run.steps]
    assert "FLAGS: tied" in run.steps[0].text()


def test_the_dashboard_marks_flagged_steps_and_a_click_opens_the_nearest_recorded_one(tmp_path):
    from types import SimpleNamespace

    from astranb.notebook.panels import figure

    rows = [{"policy": "a", "step": s, "version": s + 1, "reward": 0.5, "flags": f, "time": s,
             "episodes": 8 * s, "rollout_tokens": 64 * s}
            for s, f in enumerate([[], ["tied"], [], ["mismatch", "zero_loss"]])]
    flagged = next(t for t in figure(rows, ["a"], 1)["data"] if t["name"] == "a taught nothing")
    assert flagged["x"] == [1, 3] and flagged["mode"] == "markers"

    run = short_run(tmp_path, "thread", inspect_every=2)
    dash = run.dashboard(mode="widgets")
    reward = next(t for t in dash.fig.data if t.name == "solver")
    assert reward._click_callbacks  # a click on the reward line opens a step
    dash._clicked(reward, SimpleNamespace(xs=[3]), None)
    assert "<b>step 2</b>" in dash.step_view.value and "tok trained" in dash.step_view.value
    dash.open_step("nobody", 1)
    assert "no recorded step of &#x27;nobody&#x27;" in dash.step_view.value
    dash.finish()
