"""A trainer of one's own (astranb/remote/external.py, astranb/remote/trainer_link.py): the wire
in-process (loans, checked weights, every refusal), a session trained by a loop in a thread, and
a plain PyTorch loop in a subprocess (tests/external_loop.py) that is killed with SIGKILL mid-run,
started again, and trains the quickstart task to its reward target with no sample lost."""

from __future__ import annotations

import json
import os
import signal
import stat
import subprocess
import sys
import threading
from pathlib import Path

import anyio
import httpx
import pytest
import torch

import astranb as ab
from astranb.remote.external import (
    METRICS_HEADER,
    VERSION_HEADER,
    ExternalTrainer,
    create_app,
)
from astranb.remote.serialize import batch_from_bytes
from astranb.session.folder import RunFiles
from astranb.types import Batch
from astranb.weights.codec import checksum, decode, encode, encode_full
from tests.external_loop import loss_of
from tests.waiting import wait_until

SPEC = ab.models.tiny(hidden_size=32, num_heads=2)
TOKEN = "a-test-token-of-some-length"
AUTH = {"Authorization": f"Bearer {TOKEN}"}
LOOP = Path(__file__).with_name("external_loop.py")

BATCH = Batch(
    input_ids_B_T=torch.tensor([[1, 5, 6, 7, 0], [1, 5, 8, 0, 0]]),
    attention_mask_B_T=torch.tensor([[1, 1, 1, 1, 0], [1, 1, 1, 0, 0]]),
    loss_mask_B_T=torch.tensor([[0, 0, 1, 1, 0], [0, 0, 1, 0, 0]]),
    old_logp_B_T=torch.tensor([[0.0, 0.0, -1.5, -0.5, 0.0], [0.0, 0.0, -2.0, 0.0, 0.0]]),
    advantages_B_T=torch.tensor([[0.0, 0.0, 1.0, 1.0, 0.0], [0.0, 0.0, -1.0, 0.0, 0.0]]),
    versions_B_T=torch.tensor([[-1, -1, 0, 0, -1], [-1, -1, 0, -1, -1]]),
    temperature_B=torch.tensor([1.0, 1.0]),
    rewards_B=torch.tensor([1.0, 0.0]),
)


def _client(trainer: ExternalTrainer, host: str = "127.0.0.1", **options) -> httpx.AsyncClient:
    app = create_app(trainer, TOKEN, **options)
    return httpx.AsyncClient(transport=httpx.ASGITransport(app=app, client=(host, 5000)),
                             base_url="http://127.0.0.1")


def _moved(weights: dict[str, torch.Tensor], seed: int = 0) -> dict[str, torch.Tensor]:
    """The weights after a made-up step: a tenth of the entries nudged (bf16 bits change)."""
    generator = torch.Generator().manual_seed(seed)
    out = {}
    for name, tensor in weights.items():
        keep = torch.rand(tensor.shape, generator=generator) > 0.1
        out[name] = torch.where(keep, tensor, tensor + 0.05).to(tensor.dtype)
    return out


async def _publish(http: httpx.AsyncClient, version: int, payload: bytes, metrics=None,
                   **headers: str) -> httpx.Response:
    return await http.post("/v1/publish", params={"version": version}, content=payload,
                           headers={**AUTH, METRICS_HEADER: json.dumps(metrics or {}), **headers})


# -- the wire ------------------------------------------------------------------------------------

def test_a_step_lends_its_batch_and_ends_when_the_next_version_comes_back_checked():
    async def main():
        trainer = ExternalTrainer("solver", SPEC, ab.GRPO(entropy_coef=0.05))
        async with _client(trainer) as http:
            info = (await http.post("/v1/register", json={"name": "mine"}, headers=AUTH)).json()
            assert (info["policy"], info["version"], info["checksum"]) == \
                ("solver", 0, trainer.checksum)
            assert info["algorithm"]["entropy_coef"] == 0.05
            assert info["model"]["config"] == SPEC.config
            base = decode(None, (await http.get("/v1/weights", headers=AUTH)).content)
            assert checksum(base) == trainer.checksum == checksum(trainer.weights())
            assert sorted(base) == info["weight_names"]
            new = _moved(base)
            done = {}

            async def step():
                done["metrics"] = await trainer.step(BATCH)

            async with anyio.create_task_group() as group:
                group.start_soon(step)
                answer = await http.get("/v1/batch", params={"wait": 5}, headers=AUTH)
                assert answer.status_code == 200 and answer.headers[VERSION_HEADER] == "0"
                lent = batch_from_bytes(answer.content)
                for field in ("input_ids_B_T", "loss_mask_B_T", "old_logp_B_T",
                              "advantages_B_T", "versions_B_T"):
                    assert torch.equal(getattr(lent, field), getattr(BATCH, field)), field
                delta = encode(base, new, policy="solver", base_version=0, version=1)
                answer = await _publish(http, 1, delta, {"loss": 0.5, "trainer/lr": 1e-3})
                assert answer.status_code == 200, answer.text
                assert answer.json() == {"version": 1, "checksum": checksum(new), "kind": "delta"}
            assert done["metrics"] == {"loss": 0.5, "trainer/lr": 1e-3, "external_lent": 1.0}
            assert trainer.version == 1 and trainer.checksum == checksum(new)
            assert all(torch.equal(trainer.weights()[k], new[k]) for k in new)
            # version 1 is in: another version 1 (a second trainer, a retry) is refused
            again = await _publish(http, 1, delta)
            assert again.status_code == 409 and "not awaited" in again.json()["error"]
            assert trainer.version == 1 and trainer.refused == 1
            # with no batch out, a batch request waits, then says none came
            answer = await http.get("/v1/batch", params={"wait": 0.05}, headers=AUTH)
            assert answer.status_code == 204 and answer.headers[VERSION_HEADER] == "1"

    anyio.run(main)


def test_a_batch_held_by_a_trainer_that_died_is_lent_again_and_a_stopped_step_withdraws_it():
    async def main():
        trainer = ExternalTrainer("solver", SPEC, ab.GRPO())
        async with _client(trainer) as http:
            async with anyio.create_task_group() as group:
                group.start_soon(trainer.step, BATCH)
                first = await http.get("/v1/batch", params={"wait": 5}, headers=AUTH)
                again = await http.get("/v1/batch", params={"wait": 5}, headers=AUTH)
                assert first.content == again.content  # the same bytes, the same version
                assert again.headers[VERSION_HEADER] == "0" and trainer.lent_again == 1
                assert (await http.get("/v1/status", headers=AUTH)).json()["batch_out"] is True
                group.cancel_scope.cancel()  # the run stopped while the batch was out
            status = (await http.get("/v1/status", headers=AUTH)).json()
            assert status["batch_out"] is False and status["version"] == 0
            late = await _publish(http, 1, encode_full(_moved(trainer.weights()),
                                                       policy="solver", version=1))
            assert late.status_code == 409 and "no batch is out" in late.json()["error"]
            trainer.close()
            closed = await http.get("/v1/batch", params={"wait": 5}, headers=AUTH)
            assert closed.status_code == 410 and "closed" in closed.json()["error"]

    anyio.run(main)


def test_refusals_say_what_was_wrong_and_leave_the_loan_out():
    async def main():
        trainer = ExternalTrainer("solver", SPEC, ab.GRPO())
        base = trainer.weights()
        new = _moved(base, seed=1)
        async with _client(trainer) as http:
            # who may ask
            assert (await http.get("/v1/status")).status_code == 401
            wrong = {"Authorization": "Bearer " + "x" * 27}
            assert (await http.get("/v1/status", headers=wrong)).status_code == 401
            async with _client(trainer, host="10.1.2.3") as far:
                answer = await far.get("/v1/status", headers=AUTH)
                assert answer.status_code == 403 and "loopback" in answer.json()["error"]
            async with _client(trainer, host="10.1.2.3", loopback_only=False) as far:
                # listening beyond loopback (External(host=..., token=...)): the token decides
                assert (await far.get("/v1/status", headers=AUTH)).status_code == 200
                assert (await far.get("/v1/status")).status_code == 401
            bad_name = await http.post("/v1/register", json={"name": ""}, headers=AUTH)
            assert bad_name.status_code == 400 and "'name'" in bad_name.json()["error"]
            assert (await http.get("/v1/batch", params={"wait": "-1"},
                                   headers=AUTH)).status_code == 400
            async with anyio.create_task_group() as group:
                group.start_soon(trainer.step, BATCH)
                await http.get("/v1/batch", params={"wait": 5}, headers=AUTH)

                async def refused(version, payload, status, words, metrics=None, **headers):
                    answer = await _publish(http, version, payload, metrics, **headers)
                    assert answer.status_code == status, answer.text
                    assert words in answer.json()["error"], answer.json()
                    assert trainer.version == 0 and trainer.checksum == checksum(base)
                    return answer.json()

                await refused(2, encode_full(new, policy="solver", version=2), 409,
                              "not awaited")
                await refused(1, b"not a payload at all", 400, "not a weight payload")
                await refused(1, encode_full(new, policy="other", version=1), 422, "'other'")
                other_base = _moved(base, seed=2)
                answer = await refused(1, encode(other_base, new, policy="solver",
                                                 base_version=0, version=1), 409,
                                       "send a full snapshot")
                assert answer["send"] == "full"
                smaller = {k: v for k, v in new.items() if k != sorted(new)[0]}
                await refused(1, encode_full(smaller, policy="solver", version=1), 422,
                              "not this policy's model")
                payload = encode_full(new, policy="solver", version=1)
                await refused(1, payload, 400, "the run's own", {"reward": 1.0})
                await refused(1, payload, 400, "finite number", {"loss": float("nan")})
                await refused(1, payload, 400, "JSON object", ["loss"])
                await refused(1, payload, 400, "metric name", {"bad name!": 1})
                async with _client(trainer, max_body=100) as small:
                    answer = await small.post("/v1/publish", params={"version": 1},
                                              content=payload, headers=AUTH)
                    assert answer.status_code == 413
                assert trainer.refused == 10
                # and the loan is still out: the full snapshot is taken
                taken = await _publish(http, 1, payload, {"loss": 1.0})
                assert taken.status_code == 200 and taken.json()["kind"] == "full"
            assert trainer.version == 1 and trainer.checksum == checksum(new)

    anyio.run(main)


# -- a session trained by a loop of one's own ----------------------------------------------------

def _loop_in_a_thread(path: Path, sent: list[float]) -> threading.Thread:
    """tests/external_loop.py's loss, in a thread of this process, through a TrainerLink."""

    def train():
        link = ab.TrainerLink.from_file(path, name="thread-loop")
        model = link.spec.build(dtype=torch.float32)
        model.load_state_dict(link.weights())
        optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.0)
        for batch in link.batches(model, wait=1.0):
            loss = loss_of(model, batch, 0.2, 0.2, 0.05)
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
            sent.append(loss.item())
            link.publish(model.state_dict(), metrics={"loss": loss.item()})
        link.close()

    thread = threading.Thread(target=train, daemon=True)
    thread.start()
    return thread


def test_a_session_trains_with_a_loop_of_its_own_and_the_engine_holds_its_bits(tmp_path):
    sent: list[float] = []
    with ab.Session(tmp_path / "runs", trainer="thread") as session:
        policy = session.policy("solver", SPEC, algorithm=ab.GRPO(entropy_coef=0.05),
                                trainer="external")
        path = session.directory / "external" / "solver.json"
        assert stat.S_IMODE(path.stat().st_mode) == 0o600
        found = json.loads(path.read_text())
        assert found["url"].startswith("http://127.0.0.1:") and found["policy"] == "solver"
        assert policy.describe()["trainer"] == "ExternalTrainer"
        session.wire(ab.environments.load("arithmetic"), solver=policy)
        thread = _loop_in_a_thread(path, sent)
        run = session.train(steps=6, batch_size=16, group_size=4, max_staleness=1)
        run.wait(progress=False)
        df = run.metrics
        assert list(df["step"]) == list(range(6)) and policy.version == 6
        assert list(df["loss"]) == sent  # the loop's own numbers, row by row
        assert set(df["transfer_kind"]) <= {"delta", "full"} and "delta" in set(df["transfer_kind"])
        assert policy.engine.published_checksum() == policy.weights_checksum
        assert df["staleness_max"].max() <= 1
        assert run.accounting["trained_twice"] == 0
        with pytest.raises(ValueError, match="keeps its own state"):
            session.train(steps=7, batch_size=16, group_size=4, checkpoint_every=2)
        with pytest.raises(ValueError, match="external trainer trains its own way"):
            session.policy("other", SPEC, trainer="external", lora=ab.LoRA(rank=2))
        with pytest.raises(ValueError, match="trainer='external'"):
            session.policy("other", SPEC, trainer="mine")
        with pytest.raises(ValueError, match="token="):
            ab.External(host="0.0.0.0")
    thread.join(timeout=30)  # the session closed: the loop's batches() ended
    assert not thread.is_alive()


# -- a plain PyTorch loop in a subprocess, killed mid-run -----------------------------------------

def _start_loop(path: Path, log: Path) -> subprocess.Popen:
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parent.parent)}
    with open(log, "a") as out:
        return subprocess.Popen([sys.executable, str(LOOP), str(path)], stdout=out,
                                stderr=subprocess.STDOUT, env=env, start_new_session=True)


@pytest.mark.slow
def test_a_plain_pytorch_loop_killed_mid_run_trains_the_quickstart_task_losing_no_sample(
        tmp_path):
    target, window, cap = 0.6, 60, 1200  # the quickstart's target: mean reward over 60 steps
    log = tmp_path / "loop.log"
    loops: list[subprocess.Popen] = []
    try:
        with ab.Session(tmp_path / "runs") as session:
            policy = session.policy("solver", ab.models.tiny(),
                                    algorithm=ab.GRPO(entropy_coef=0.05), trainer="external")
            path = session.directory / "external" / "solver.json"
            session.wire(ab.environments.load("arithmetic"), solver=policy)
            loops.append(_start_loop(path, log))
            run = session.train(steps=cap, batch_size=128, group_size=8, max_staleness=2)
            wait_until(lambda: policy.version >= 60 or run.done, 240, "60 versions")
            os.killpg(loops[0].pid, signal.SIGKILL)  # mid-step, holding a batch or about to
            loops[0].wait(timeout=30)
            killed_at = policy.version
            loops.append(_start_loop(path, log))

            def reached():
                rewards = run.metrics["reward"] if len(run.metrics) else []
                return (len(rewards) >= window and rewards.tail(window).mean() >= target) \
                    or run.done
            wait_until(reached, 900, lambda: f"reward target (log: {log.read_text()[-2000:]})")
            run.stop()
            run.wait(progress=False)
            df, trainer = run.metrics, policy.trainer
            assert df["reward"].tail(window).mean() >= target, df["reward"].tail(window).mean()
            # every version once, in order, across the kill; no token from lost weights
            assert list(df["step"]) == list(range(len(df)))
            assert (df["token_version_max"] <= df["step"]).all()
            assert df["staleness_max"].max() <= 2
            # at most one refusal: the batch the stop withdrew while the second loop trained it
            assert trainer.refused <= 1 and trainer.lent_again <= 1
            assert len(trainer.trainers) == 2
            # the batch out at the kill was trained exactly once, after it
            assert df.loc[killed_at, "external_lent"] == 1 + trainer.lent_again
            assert policy.engine.published_checksum() == policy.weights_checksum
            # every sample accounted for once: trained or dropped by a named rule
            accounts = RunFiles(run.directory).samples
            assert [len(a["trained"]) for a in accounts] == list(df["samples_trained"])
            every = [k for a in accounts for k in a["trained"]] + \
                [k for a in accounts for ks in a["dropped"].values() for k in ks]
            assert len(every) == len(set(every)), "a sample was accounted for twice"
            assert (df["samples_trained"] > 0).all()
            print(f"killed at version {killed_at}; reward target {target} at step {len(df)}; "
                  f"lent again {trainer.lent_again}, refused {trainer.refused}")
        assert loops[1].wait(timeout=60) == 0  # the session closed: its loop ended by itself
        assert "session closed" in log.read_text()
    finally:
        for process in loops:
            if process.poll() is None:
                os.killpg(process.pid, signal.SIGKILL)
                process.wait()
