"""The FSDP2 trainer backend against LocalTrainer, with two real gloo processes on CPU.

Two torchrun jobs (tests/fsdp_worker.py) do the distributed work: `first` creates a GRPO and an
M2PO policy, steps each on a 7-row and then a 1-row batch and saves; `resume` loads those
checkpoints in fresh processes and steps again. The same steps run here on LocalTrainer.

Observed on CPU fp32 (torch 2.13, gloo): metrics agree to 5e-7 (relative), Adam's moments to
3e-6 of each tensor's largest value, weights to 8e-7 (max abs, lr 1e-3). The weights differ most
because Adam's first steps divide g by |g| + eps: where a gradient entry is near eps (1e-8), the
ranks' different fp32 summation order moves that entry's update by up to ~1e-3 of lr. Asserted:
weights atol 1e-5 / rtol 1e-4, metrics rtol 1e-4, moments 1e-4 of scale.
Adam's update barely depends on the gradient's scale, so the weights alone would not notice
gradients averaged instead of summed over ranks; grad_norm and the moments do (GRPO's optimizer
does not clip, so raw gradients reach the moments), and both fail if FSDP's divide factor is
left at its default.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from safetensors.torch import load_file

import astranb as ab
from astranb.algorithms.config import algorithm_from_dict, algorithm_to_dict
from astranb.training.collective import Collective, Command, decode, encode
from astranb.training.fsdp import FSDPBackend
from astranb.training.local import LocalTrainer
from tests.fsdp_worker import (
    BATCHES,
    CALLER_OPTIMIZER,
    MICRO_BATCH_SIZE,
    POLICIES,
    SPEC,
    CallerLoss,
    make_batch,
)
from tests.waiting import wait_until

ROOT = Path(__file__).resolve().parents[1]
ATOL, RTOL = 1e-5, 1e-4


def test_algorithm_configs_round_trip_through_json():
    for algorithm in [ab.GRPO(clip_high=0.28, entropy_coef=0.01, filter_groups=False),
                      ab.M2PO(threshold=0.1, only_violating=True, normalize_std=False)]:
        data = json.loads(json.dumps(algorithm_to_dict(algorithm)))
        assert data["kind"] == algorithm.name
        assert algorithm_from_dict(data) == algorithm
    with pytest.raises(ValueError, match="unknown algorithm kind 'ppo'"):
        algorithm_from_dict({"kind": "ppo"})
    with pytest.raises(ValueError, match="no field"):
        algorithm_from_dict({"kind": "grpo", "clip": 0.2})
    with pytest.raises(ValueError, match="clip_low must be in"):  # validated as when built
        algorithm_from_dict({"kind": "grpo", "clip_low": 2.0})

    class Custom(ab.GRPO):
        pass

    with pytest.raises(TypeError, match="not one of astranb.s algorithm configs"):
        algorithm_to_dict(Custom())


def test_command_encoding_round_trips_json_and_tensors():
    tensors = {"ids": torch.arange(6).view(2, 3), "x": torch.randn(4, 2).t(), "b": torch.ones(0)}
    command = Command("step", {"name": "p", "n": [1, 2.5, None]}, tensors, local="not sent")
    back = decode(*encode(command))
    assert back.name == "step" and back.args == command.args and back.local is None
    assert back.tensors.keys() == tensors.keys()
    for key, tensor in tensors.items():
        assert back.tensors[key].dtype == tensor.dtype and torch.equal(back.tensors[key], tensor)
    assert decode(*encode(Command("ping"))).tensors == {}
    with pytest.raises(TypeError):
        encode(Command("bad", {"x": object()}))


@pytest.fixture
def world_of_one(tmp_path):
    """A one-process gloo group in this process."""
    dist.init_process_group("gloo", init_method=f"file://{tmp_path}/store", rank=0, world_size=1)
    yield
    dist.destroy_process_group()


def test_channel_runs_calls_from_many_threads_one_at_a_time(world_of_one):
    running, seen = [0], []

    def echo(command: Command):
        running[0] += 1
        assert running[0] == 1, "two commands ran at once"
        seen.append(threading.get_ident())
        time.sleep(0.01)
        running[0] -= 1
        return command.args["i"], float(command.tensors["x"].sum())

    channel = Collective({"echo": echo}, timeout_s=30)
    results = {}

    def caller(i):
        results[i] = channel.call("echo", {"i": i}, {"x": torch.full((3,), float(i))})

    threads = [threading.Thread(target=caller, args=(i,)) for i in range(6)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert results == {i: (i, 3.0 * i) for i in range(6)}
    assert len(set(seen)) == 1 and seen[0] != threading.get_ident()  # one worker thread
    with pytest.raises(KeyError, match="no handler for command 'nope'"):
        channel.call("nope")
    channel.close()
    with pytest.raises(RuntimeError, match="closed"):
        channel.call("echo", {"i": 0})


def test_backend_on_one_rank_equals_local_trainer(world_of_one, tmp_path):
    algorithm, optimizer = POLICIES["grpo"]
    trainer = FSDPBackend(timeout_s=30)
    reference = LocalTrainer(SPEC, algorithm, optimizer, micro_batch_size=MICRO_BATCH_SIZE)
    try:
        assert trainer.create("p", SPEC, algorithm, optimizer, MICRO_BATCH_SIZE) == 0
        before = trainer.weights("p")
        assert list(before) == list(reference.weights())
        batch = make_batch(*BATCHES["a"])
        assert trainer.step("p", batch) == pytest.approx(reference.step(batch), rel=RTOL)
        _assert_close(trainer.weights("p"), reference.weights())
        after = trainer.weights("p")
        assert not torch.equal(before["model.norm.weight"], after["model.norm.weight"])  # copies
        trainer.save("p", tmp_path / "ckpt")
        trainer.save("p", tmp_path / "ckpt")  # over an existing checkpoint: replaced whole
        assert sorted(p.name for p in tmp_path.iterdir()) == ["ckpt", "store"]
        assert trainer.load("p", tmp_path / "ckpt") == trainer.version("p") == 1
        with pytest.raises(KeyError, match="no policy 'q'"):
            trainer.step("q", batch)
        trainer.create("wide", ab.models.tiny(hidden_size=64, num_heads=2), algorithm)
        with pytest.raises(ValueError, match="does not fit this policy's model"):
            trainer.load("wide", tmp_path / "ckpt")  # refused before any rank is told
        assert trainer.create("p", SPEC, algorithm) == trainer.version("p") == 0  # replaced
        _assert_close(trainer.weights("p"), before)
    finally:
        trainer.close()


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _env() -> dict[str, str]:
    return {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}


def _torchrun(mode: str, out: Path) -> None:
    command = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2",
               "--master-addr", "127.0.0.1", "--master-port", str(_free_port()),
               "-m", "tests.fsdp_worker", mode, str(out)]
    done = subprocess.run(command, cwd=ROOT, env=_env(), capture_output=True, text=True,
                          timeout=180)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-6000:]


def _assert_close(actual: dict, expected: dict) -> None:
    assert sorted(actual) == sorted(expected)  # safetensors files list names sorted
    for name, tensor in expected.items():
        torch.testing.assert_close(actual[name], tensor, atol=ATOL, rtol=RTOL, msg=name)


def _assert_close_to_scale(actual: dict, expected: dict, rel: float = 1e-4) -> None:
    """Each tensor within rel x its largest |value| (Adam's moments are far below any atol)."""
    assert sorted(actual) == sorted(expected)
    for name, tensor in expected.items():
        error, scale = float((actual[name] - tensor).abs().max()), float(tensor.abs().max())
        assert error <= rel * scale, (name, error, scale)


def _local(name: str) -> LocalTrainer:
    algorithm, optimizer = POLICIES[name]
    return LocalTrainer(SPEC, algorithm, optimizer, micro_batch_size=MICRO_BATCH_SIZE)


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """Both torchrun jobs' outputs, and LocalTrainer's twin of `first` (checkpoints included)."""
    out = tmp_path_factory.mktemp("fsdp")
    _torchrun("first", out)
    _torchrun("resume", out)
    reference = {}
    for name in POLICIES:
        trainer = _local(name)
        for key in ("a", "b"):
            reference[f"{name}.{key}"] = trainer.step(make_batch(*BATCHES[key]))
            reference[f"{name}.{key}.weights"] = trainer.weights()
        trainer.save(out / f"local-{name}")
    return out, reference


@pytest.mark.slow  # two torchrun jobs (module fixture runs)
def test_two_rank_steps_equal_local_trainer_steps(runs):
    out, reference = runs
    metrics = json.loads((out / "metrics.json").read_text())
    assert metrics["world_size"] == 2
    for name in POLICIES:
        for key in ("a", "b"):  # b has one row: rank 1 only keeps the collectives company
            step = f"{name}.{key}"
            _assert_close(load_file(out / f"{step}.safetensors"), reference[f"{step}.weights"])
            assert metrics[step] == pytest.approx(reference[step], rel=RTOL, abs=1e-6), step
    assert metrics["grpo.a"]["clip_frac"] > 0 and metrics["m2po.a"]["m2po_masked_frac"] > 0


@pytest.mark.slow  # two torchrun jobs (module fixture runs)
def test_a_users_own_loss_on_two_ranks_equals_it_in_a_local_trainer(runs):
    out, _ = runs
    metrics = json.loads((out / "metrics.json").read_text())
    local = LocalTrainer(SPEC, CallerLoss(), CALLER_OPTIMIZER, micro_batch_size=MICRO_BATCH_SIZE)
    for key in ("a", "b"):
        expected = local.step(make_batch(*BATCHES[key]))
        _assert_close(load_file(out / f"caller.{key}.safetensors"), local.weights())
        for name in ("loss", "entropy", "grad_norm", "tokens"):
            assert metrics[f"caller.{key}"][name] == pytest.approx(expected[name], rel=RTOL,
                                                                    abs=1e-6), (key, name)


@pytest.mark.slow  # two torchrun jobs (module fixture runs)
def test_checkpoint_is_local_trainers_format_and_has_no_pickle(runs):
    out, _ = runs
    for name in POLICIES:
        ckpt, local = out / f"ckpt-{name}", out / f"local-{name}"
        assert sorted(p.name for p in ckpt.iterdir()) == sorted(p.name for p in local.iterdir())
        info, local_info = (json.loads((d / "trainer.json").read_text()) for d in (ckpt, local))
        assert info == local_info  # version 2, optimizer settings, param groups
        _assert_close_to_scale(load_file(ckpt / "optimizer.safetensors"),
                               load_file(local / "optimizer.safetensors"))
        trainer = _local(name)
        trainer.load(ckpt)  # LocalTrainer reads what FSDP wrote
        assert trainer.version == 2
    assert not [p for p in out.rglob("*") if p.suffix in (".pkl", ".pt", ".metadata")]
    assert not [p for p in out.iterdir() if p.name.startswith(".")]  # no leftover temp dirs


@pytest.mark.slow  # two torchrun jobs (module fixture runs)
def test_load_in_new_processes_restores_weights_optimizer_and_version(runs):
    out, _ = runs
    resumed = json.loads((out / "resume.json").read_text())
    for name in POLICIES:
        assert resumed[f"{name}.loaded_version"] == resumed[f"{name}.version"] == 2
        saved, loaded = out / f"ckpt-{name}", out / f"resaved-{name}"
        for got, want in [(load_file(out / f"{name}.loaded.safetensors"),
                           load_file(saved / "model.safetensors")),
                          (load_file(loaded / "optimizer.safetensors"),
                           load_file(saved / "optimizer.safetensors"))]:
            assert got.keys() == want.keys()
            assert all(torch.equal(got[k], want[k]) for k in want)  # bit for bit


@pytest.mark.slow  # two torchrun jobs (module fixture runs)
def test_step_after_load_equals_local_trainer_after_load(runs):
    out, _ = runs
    resumed = json.loads((out / "resume.json").read_text())
    for name in POLICIES:
        trainer = _local(name)
        trainer.load(out / f"local-{name}")
        metrics = trainer.step(make_batch(*BATCHES["a"]))
        _assert_close(load_file(out / f"{name}.c.safetensors"), trainer.weights())
        assert resumed[f"{name}.c"] == pytest.approx(metrics, rel=RTOL, abs=1e-6)


def _alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except FileNotFoundError:
        return False
    return state != "Z"  # an orphan's zombie lingers where nothing reaps it


@pytest.mark.slow  # real torchrun ranks and timeouts
def test_ranks_exit_when_rank_zero_hangs_or_their_launcher_dies(tmp_path):
    """Rank 0 pings an idle follower; a hung rank 0 makes it exit, a vanished launcher rank 0."""
    timeout_s = 4.0
    env = {**_env(), "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(_free_port()),
           "WORLD_SIZE": "2"}
    worker = [sys.executable, "-m", "tests.fsdp_worker", "idle", str(tmp_path), str(timeout_s)]
    # rank 0 runs under a shell that stands in for torchrun (`; exit` keeps sh from exec-ing)
    commands = [["sh", "-c", '"$@"; exit $?', "sh", *worker], worker]
    logs = [open(tmp_path / f"rank{rank}.log", "w") for rank in range(2)]
    launcher, follower = (
        subprocess.Popen(commands[rank], cwd=ROOT, stdout=logs[rank], stderr=subprocess.STDOUT,
                         env={**env, "RANK": str(rank), "LOCAL_RANK": str(rank)})
        for rank in range(2)
    )
    rank0 = None
    try:
        wait_until(lambda: (tmp_path / "ready").exists() or follower.poll() is not None, 90,
                   "the job to start")
        assert follower.poll() is None, (tmp_path / "rank1.log").read_text()
        rank0 = int((tmp_path / "ready").read_text())
        time.sleep(timeout_s + 1)  # idle past the timeout: rank 0's pings keep the follower
        assert follower.poll() is None, (tmp_path / "rank1.log").read_text()

        os.kill(rank0, signal.SIGSTOP)  # hung, not dead: its sockets stay open
        started = time.monotonic()
        returncode = follower.wait(timeout=timeout_s + 30)
        waited = time.monotonic() - started
        log = (tmp_path / "rank1.log").read_text()
        assert returncode == 1 and "rank 0 has died or hung" in log, (returncode, log)
        assert waited < timeout_s + 10

        launcher.kill()
        launcher.wait()
        os.kill(rank0, signal.SIGCONT)
        wait_until(lambda: not _alive(rank0), 15, "rank 0 to end with its launcher")
        assert "its launcher has gone" in (tmp_path / "rank0.log").read_text()
    finally:
        for proc in (launcher, follower):
            proc.kill()
            proc.wait()
        if rank0 is not None and _alive(rank0):
            os.kill(rank0, signal.SIGKILL)
        for log in logs:
            log.close()
