"""Runs that make no progress say so: clear errors for runs that can never train, a "stalled"
event (and `run.status == "stalled"`) for runs that stop moving, never a silent spin.

The runs below would sit forever without the fix; every wait has a deadline, so they fail
instead of hanging."""

from __future__ import annotations

import random
import re
import time

import anyio
import pytest

import astranb as ab
from astranb.dataflow.buffer import Buffer, Group
from astranb.dataflow.stall import (
    PolicyWait,
    Snapshot,
    StallWatch,
    describe,
    filter_streak,
    filtered_message,
)
from astranb.notebook.dashboard import View
from tests.envs import CountA
from tests.waiting import wait_until

DEADLINE = 60.0
"""Seconds a run gets to say what is wrong (it says it in well under one)."""


class Varied(CountA):
    """Plays a turn and earns a random reward: every group has a signal (CountA's rewards tie
    once the tiny model always writes the same answer)."""

    def __init__(self):
        super().__init__()
        self.rng = random.Random(0)

    async def episode(self, ctx, sample):
        await ctx.generate("solver", sample["prompt"])
        return self.rng.random()


class NoSamples(CountA):
    def samples(self, seed=0):
        return iter(())


class FewSamples(Varied):
    """Three samples, then the stream ends."""

    def samples(self, seed=0):
        yield from ({"prompt": p} for p in ("ab=", "ba=", "aa="))


class LongPrompt(CountA):
    """Every prompt is longer than the tiny model's context (512 tokens)."""

    def samples(self, seed=0):
        while True:
            yield {"prompt": "ab" * 400}


class AlwaysZero(CountA):
    """Plays a turn and earns 0.0: every group ties, so filter_groups drops them all."""

    async def episode(self, ctx, sample):
        await ctx.generate("solver", sample["prompt"])
        return 0.0


class ZeroThenVaried(Varied):
    """AlwaysZero while `ties` is set, then Varied's random rewards."""

    ties = True

    async def episode(self, ctx, sample):
        reward = await super().episode(ctx, sample)
        return 0.0 if self.ties else reward


class NeverEnds(CountA):
    """Episodes that wait forever (a tool that never answers)."""

    async def episode(self, ctx, sample):
        await anyio.sleep_forever()


def make_session(tmp_path, env):
    session = ab.Session(tmp_path / "runs")
    policy = session.policy("solver", model=ab.models.tiny(hidden_size=32, num_heads=2),
                            max_batch_size=32)
    session.wire(env, solver=policy)
    return session


def stalled_events(run):
    return [e for e in run.events if e["kind"] == "stalled"]


# -- the pure parts ------------------------------------------------------------------------------
def test_the_watch_says_stalled_once_per_stall_and_again_after_the_run_moved():
    watch = StallWatch(10.0, now=0.0)
    assert not watch.look(0.0, (0, 0))
    assert not watch.look(9.9, (0, 0))  # not yet 10 s without a change
    assert watch.look(10.0, (0, 0))
    assert not watch.look(50.0, (0, 0))  # said once for this stall
    assert watch.idle(50.0) == 50.0
    assert not watch.look(51.0, (1, 0))  # a step: the run moved
    assert not watch.look(60.0, (1, 0))
    assert watch.look(61.0, (1, 0))  # stalled again, said again
    # an evaluation window, a checkpoint, weights on their way: the run counts as moving
    assert not watch.look(100.0, (1, 0), busy=True)
    assert not watch.look(109.0, (1, 0))
    assert watch.look(110.0, (1, 0))
    with pytest.raises(ValueError, match="stall_seconds must be > 0"):
        StallWatch(0, now=0.0)


def test_the_stall_message_names_what_the_run_waits_for():
    snap = Snapshot(130.0, (
        PolicyWait("solver", "buffer", buffered=1, needed=4, live=8, capacity=8, filtered=12),
        PolicyWait("verifier", "trainer", buffered=0, needed=4, live=2, capacity=8,
                   step_seconds=95.0),
    ), in_flight=3, oldest_seconds=128.0)
    waiting, message = describe(snap)
    assert waiting == ["buffer", "gate", "trainer", "episodes in flight"]
    assert message.startswith("no step and no new group for 130 s: ")
    assert "solver waits for its buffer (1 of the 4 groups a step takes are there)" in message
    assert "admits no new group for solver (8 live of 8" in message
    assert "the last 12 groups of solver were dropped by filter_groups" in message
    assert "verifier's trainer has been running a step for 95 s" in message
    assert "3 group(s) of episodes are playing, the oldest for 128 s" in message

    barrier = Snapshot(200.0, (PolicyWait("a", "barrier", 0, 2, 0, 4),), 0, None, True)
    assert describe(barrier)[0] == ["barrier", "samples"]
    assert "every sample stream has ended" in describe(barrier)[1]


def test_the_filter_groups_message_says_what_was_earned_and_what_to_do():
    message = filtered_message("solver", 16, [0.0])
    assert message.startswith("the last 16 groups of solver were all dropped by filter_groups: "
                              "every reward was 0.0")
    for fix in ("warm start", "easier samples", "filter_groups=False"):
        assert fix in message
    assert "the same reward (0.0, 1.0)" in filtered_message("solver", 16, [1.0, 0.0])
    assert filter_streak(1) == 8 and filter_streak(4) == 16


def test_a_closed_buffer_serves_what_it_holds_then_says_why_no_more_will_come():
    async def main():
        buffer = Buffer("solver")
        buffer.put(Group(0, (), 0))
        buffer.close("every sample stream has ended")
        assert len(await buffer.pop(1, 0, 1)) == 1
        buffer.put(Group(1, (), 0))
        with pytest.raises(ab.SamplesRanOut, match="needs 2 groups for a step and 1 are left: "
                                                "every sample stream has ended"):
            await buffer.pop(2, 0, 1)
        assert len(buffer) == 1  # the group taken is back

    anyio.run(main)


def test_stall_seconds_must_be_positive():
    with pytest.raises(ValueError, match="stall_seconds must be a number of seconds > 0"):
        ab.RunConfig(1, 4, 2, 1, stall_seconds=0)


# -- runs that can never train: a clear error, at once ------------------------------------------
def test_an_environment_without_samples_fails_the_run_at_once(tmp_path):
    with make_session(tmp_path, NoSamples()) as session:
        run = session.train(steps=2, batch_size=4, group_size=2)
        with pytest.raises(ab.SamplesRanOut, match=r"NoSamples.samples\(seed\) yielded no sample"):
            run.wait(timeout=DEADLINE, progress=False)
        assert run.status == "failed"


def test_a_stream_that_ends_before_the_steps_are_taken_fails_the_run(tmp_path):
    with make_session(tmp_path, FewSamples()) as session:
        run = session.train(steps=5, batch_size=4, group_size=2, max_staleness=4)
        with pytest.raises(ab.SamplesRanOut, match=r"every sample stream has ended \(3 from "
                                                r"FewSamples\).*make samples\(\) endless"):
            run.wait(timeout=DEADLINE, progress=False)
        assert len(run.rows) == 1  # the one step its three samples could feed was taken


def test_prompts_longer_than_the_context_fail_the_run_instead_of_spinning(tmp_path):
    with make_session(tmp_path, LongPrompt()) as session:
        run = session.train(steps=2, batch_size=4, group_size=2)
        with pytest.raises(ab.NoTrainableTokens) as caught:
            run.wait(timeout=DEADLINE, progress=False)
    message = str(caught.value)
    # N = max(64, 2 x batch_size): the run's limit on episodes in a row that train nothing
    assert message.startswith("the last 64 episodes of LongPrompt produced no token to train on: "
                              "each was cut short before its first turn (context: the prompt "
                              "has 800 tokens and the model's context is 512). Use shorter prompts")
    assert "or a model with a longer context" in message
    assert run.rows == []


# -- runs that stop moving: a "stalled" event, run.status, the dashboard ------------------------
@pytest.mark.slow  # a second or more: make test runs it, make test-fast does not
def test_groups_all_dropped_by_filter_groups_say_so(tmp_path, capsys):
    with make_session(tmp_path, AlwaysZero()) as session:
        # said once the run has not moved for stall_seconds / 4 (2 s here, 30 s by default)
        run = session.train(steps=3, batch_size=4, group_size=2, stall_seconds=8)
        event = wait_until(lambda: stalled_events(run), DEADLINE, "a stalled event")[0]
        assert event["reason"] == "filter_groups" and event["policies"] == ["solver"]
        said = re.match(r"the last (\d+) groups of solver were all dropped by filter_groups: "
                        r"every reward was 0\.0, so no group has a signal", event["message"])
        assert said and int(said.group(1)) >= 8  # filter_streak(2 groups a batch)
        assert run.status == "stalled" and run.stalled == event["message"]
        assert f"stalled: {said.group(0)}" in View(run).status()
        with pytest.raises(TimeoutError):  # the waiting cell says it too
            run.wait(timeout=0.5, progress=False)
        assert f"astranb: the run is stalled: {said.group(0)}" in capsys.readouterr().err
        run.stop()
        run.wait(timeout=DEADLINE, progress=False)
        assert run.status == "stopped" and run.stalled is None
        assert run.rows == []
    on_disk = ab.open_run(run.directory).events
    assert [e["reason"] for e in on_disk if e["kind"] == "stalled"][:1] == ["filter_groups"]


@pytest.mark.slow  # a second or more: make test runs it, make test-fast does not
def test_a_stall_ends_when_the_run_steps_again(tmp_path):
    env = ZeroThenVaried()
    with make_session(tmp_path, env) as session:
        run = session.train(steps=1000, batch_size=4, group_size=2, stall_seconds=4)
        try:
            wait_until(lambda: stalled_events(run), DEADLINE, "a stalled event")
            assert run.status == "stalled"
            env.ties = False
            wait_until(lambda: run.rows, DEADLINE, "a step after the ties")
            assert run.status == "running" and run.stalled is None
        finally:
            run.stop()
            run.wait(timeout=DEADLINE, progress=False)


@pytest.mark.slow  # a second or more: make test runs it, make test-fast does not
def test_a_run_that_stops_moving_says_what_it_waits_for(tmp_path):
    with make_session(tmp_path, NeverEnds()) as session:
        run = session.train(steps=2, batch_size=4, group_size=2, stall_seconds=0.5)
        event = wait_until(lambda: stalled_events(run), DEADLINE, "a stalled event")[0]
        assert event["reason"] == "no_progress"
        assert event["waiting_for"] == ["buffer", "gate", "episodes in flight"]
        assert "solver waits for its buffer (0 of the 2 groups a step takes are there)" \
            in event["message"]
        assert "4 group(s) of episodes are playing" in event["message"]
        assert run.status == "stalled"
        time.sleep(1.5)  # said once per stall, not at every look
        assert len(stalled_events(run)) == 1
        run.stop()
        run.wait(timeout=DEADLINE, progress=False)
        assert run.status == "stopped"
