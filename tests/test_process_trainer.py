"""The trainer in a child process (astranb.remote.process, Session(trainer="process")).

Real child processes over real pipes: the same steps as LocalTrainer to the bit, weights that
reach the engine bit-exact, errors that name what went wrong, a dead child that says so.
"""

from __future__ import annotations

import io
import os
import signal

import pytest
import torch

import astranb as ab
from astranb.dataflow.batcher import build_batch
from astranb.remote.process import ProcessTrainer, TrainerProcessError, _read, _write
from astranb.training.local import LocalTrainer
from tests.test_dataflow import group

SPEC = ab.models.tiny(hidden_size=32, num_heads=2)


def _batch(algorithm=None):
    return build_batch([group(0, [(0, 0, 0), (0,), (0, 0), (0, 0, 0)], [1.0, 0.0, 0.5, 0.0])],
                       "p", algorithm or ab.GRPO(), pad_id=0)


@pytest.fixture
def child(tmp_path):
    trainer = ProcessTrainer("p", SPEC, ab.GRPO(), ab.AdamWConfig(lr=1e-2),
                             log=tmp_path / "trainer.log")
    yield trainer
    trainer.close()


@pytest.mark.slow  # a trainer child process
def test_steps_in_the_child_equal_local_steps_to_the_bit(child):
    torch.set_num_threads(1)  # the child runs one thread: same kernels, same sums
    local = LocalTrainer(SPEC, ab.GRPO(), ab.AdamWConfig(lr=1e-2))
    batch = _batch()
    for _ in range(3):
        remote_metrics, local_metrics = child.step(batch), local.step(batch)
        assert remote_metrics["loss"] == local_metrics["loss"]
    assert child.version == local.version == 3
    remote = child.weights()
    for name, tensor in local.weights().items():
        assert torch.equal(remote[name], tensor), name


@pytest.mark.slow  # a trainer child process
def test_a_bad_batch_is_a_clear_error_and_the_child_lives_on(child):
    with pytest.raises(TrainerProcessError, match="not a valid safetensors blob"):
        child._call({"op": "step"}, b"definitely not safetensors")
    with pytest.raises(TrainerProcessError, match="unknown operation 'teleport'"):
        child._call({"op": "teleport"})
    child.step(_batch())  # still serving
    assert child.version == 1


@pytest.mark.slow  # a trainer child process
def test_a_killed_child_is_reported_with_its_log(child):
    child.step(_batch())
    os.kill(child._proc.pid, signal.SIGKILL)
    child._proc.wait()
    with pytest.raises(TrainerProcessError, match=r"died during 'step' \(exit code -9\)"):
        child.step(_batch())
    with pytest.raises(TrainerProcessError, match="is closed"):
        child.step(_batch())
    child.close()  # idempotent after death


@pytest.mark.slow  # a trainer child process
def test_save_load_and_sft_through_the_child(child, tmp_path):
    child.step(_batch())
    child.save(tmp_path / "ckpt")
    assert (tmp_path / "ckpt" / "model.safetensors").exists()
    before = child.weights()
    child.step(_batch())
    child.load(tmp_path / "ckpt")
    assert child.version == 1
    for name, tensor in child.weights().items():
        assert torch.equal(tensor, before[name]), name
    metrics = child.sft_step(_batch(), lr=0.0)  # lr 0 for this step only: nothing moves
    assert child.version == 2 and metrics["loss"] > 0
    for name, tensor in child.weights().items():
        assert torch.equal(tensor, before[name]), name


@pytest.mark.slow  # a trainer child process
def test_a_session_trains_in_a_child_and_the_engine_holds_its_weights(tmp_path):
    class Echo(ab.Environment):
        roles = ("solver",)
        sampling = ab.SamplingParams(max_new_tokens=3)

        def samples(self, seed=0):
            while True:
                yield {"prompt": [5, 6, 7]}

        async def episode(self, ctx, sample):
            out = await ctx.generate("solver", sample["prompt"])
            return float(out.completion_ids[0] % 2)

    with ab.Session(tmp_path / "s", trainer="process") as session:
        policy = session.policy("solver", SPEC, optimizer=ab.AdamWConfig(lr=1e-2))
        assert type(policy.trainer).__name__ == "ProcessTrainer"
        session.wire(Echo(), solver=policy)
        run = session.train(steps=4, batch_size=8, group_size=4, max_staleness=1)
        run.wait(progress=False)
        rows = run.rows
        assert [r["version"] for r in rows] == [1, 2, 3, 4]
        assert all(r["transfer_kind"] == "full" for r in rows)  # same machine: no deltas
        # the engine samples from exactly the weights the child published (bf16, bit for bit)
        assert policy.engine.published_checksum() == policy.weights_checksum
        trained = {k: v.to(torch.bfloat16) for k, v in policy.trainer.weights().items()}
        assert ab.weights.checksum(trained) == policy.weights_checksum
        assert max(r["staleness_max"] for r in rows) <= 1
        assert (tmp_path / "s" / "trainer-solver.log").exists()


def test_the_default_trainer_follows_the_machine_and_the_environment(tmp_path, monkeypatch):
    from astranb.remote.process import default_trainer

    monkeypatch.setenv("ASTRANB_TRAINER", "process")
    assert default_trainer("cpu") == "process"
    monkeypatch.setenv("ASTRANB_TRAINER", "threads")
    with pytest.raises(ValueError, match="ASTRANB_TRAINER='threads'"):
        default_trainer("cpu")
    monkeypatch.delenv("ASTRANB_TRAINER")
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {0})
    assert default_trainer("cpu") == "thread"  # one core: nothing to overlap
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {0, 1})
    assert default_trainer("cpu") == "process"
    assert default_trainer("cuda") == "thread"
    with pytest.raises(ValueError, match="trainer='elsewhere'"):
        ab.Session(tmp_path / "x", trainer="elsewhere")


@pytest.mark.slow  # a trainer child process
def test_a_warm_start_in_the_child_reaches_the_engine(tmp_path):
    with ab.Session(tmp_path / "s", trainer="process") as session:
        policy = session.policy("solver", SPEC, optimizer=ab.AdamWConfig(lr=1e-2))
        history = policy.sft([("1+1=", "2"), ("2+2=", "4")] * 2, steps=3, batch_size=2,
                             lr=1e-2, progress=False)
        assert len(history) == 3 and policy.version == 3
        assert policy.engine.version == 3
        assert policy.engine.published_checksum() == policy.weights_checksum


class _Trickle(io.RawIOBase):
    """A pipe end whose writes take at most a few bytes, as a write interrupted by a signal
    does; reads hand back what was written."""

    def __init__(self, most: int) -> None:
        self.most, self.data = most, bytearray()

    def writable(self) -> bool:
        return True

    def write(self, b) -> int:
        taken = bytes(b[: self.most])
        self.data += taken
        return len(taken)


def test_frames_survive_writes_that_take_only_part_of_a_buffer():
    header, body = {"op": "step", "note": "x" * 300}, bytes(range(256)) * 40
    for most in (1, 7, 4096):
        pipe = _Trickle(most)
        _write(pipe, header, body)
        assert _read(io.BytesIO(bytes(pipe.data))) == (header, body)
    assert _read(io.BytesIO(bytes(pipe.data)[:-1])) is None  # a cut frame reads as the end
