"""A researcher's own loss trains the same in every trainer: this process, a child process, a
trainer service (real processes on loopback), with nothing pickled.

The loss below is defined inside a test function, as in a notebook cell: its class cannot be
imported by name anywhere else, so the child process and the service run only its gradient
(astranb/training/caller_loss.py). `ImportableLoss`, at module level, can be imported by name: a
service started with --allow-code runs it itself, one started without refuses it.
"""

from __future__ import annotations

import dataclasses
import json
import math

import anyio
import pytest
import torch
from safetensors.torch import load_file

import astranb as ab
from astranb.algorithms import token_mean
from astranb.algorithms.config import (
    CodeNotAllowed,
    algorithm_from_dict,
    algorithm_reference,
    travels_as_config,
)
from astranb.errors import ServiceError
from astranb.remote.client import TrainerClient
from astranb.remote.process import ProcessTrainer
from astranb.remote.serialize import spec_to_wire
from astranb.remote.trainer import RemoteTrainer
from astranb.services.http import free_port
from astranb.training.caller_loss import gradient_batch, trainer_algorithm
from tests.fsdp_worker import SPEC, make_batch
from tests.services import Process
from tests.waiting import wait_until

STEPS, ROWS = 5, 12
OPTIMIZER = ab.AdamWConfig(lr=1e-2, weight_decay=0.01, grad_clip=0.5)


def batches() -> list[ab.types.Batch]:
    return [make_batch(ROWS, seed) for seed in range(STEPS)]


def cell_loss() -> ab.Algorithm:
    """A loss as a researcher writes it in a notebook cell (a class defined right here)."""

    @dataclasses.dataclass(frozen=True)
    class SquaredRatioPG(ab.Algorithm):
        scale: float = 0.7
        normalize_std: bool = True
        filter_groups: bool = False
        entropy_coef: float = 0.01

        @property
        def name(self) -> str:
            return "squared_ratio_pg"

        def loss(self, logp_B_T, old_logp_B_T, adv_B_T, mask_B_T, num_tokens=None):
            log_ratio = torch.where(mask_B_T.bool(), logp_B_T - old_logp_B_T, 0.0)
            ratio = torch.exp(log_ratio).clamp(max=2.0)
            per_token = -self.scale * ratio * adv_B_T + 0.5 * log_ratio ** 2
            return (token_mean(per_token, mask_B_T, num_tokens),
                    {"cell/ratio_max": float(ratio.detach().max())})

    return SquaredRatioPG()


@dataclasses.dataclass(frozen=True)
class ImportableLoss(ab.Algorithm):
    """A user's loss in a module of their own (importable as tests.test_custom_loss)."""

    weight: float = 1.5
    normalize_std: bool = True
    filter_groups: bool = False
    entropy_coef: float = 0.0

    @property
    def name(self) -> str:
        return "importable"

    def loss(self, logp_B_T, old_logp_B_T, adv_B_T, mask_B_T, num_tokens=None):
        ratio = torch.exp(torch.where(mask_B_T.bool(), logp_B_T - old_logp_B_T, 0.0))
        return token_mean(-self.weight * ratio * adv_B_T, mask_B_T, num_tokens), {}


def thread_run(algorithm: ab.Algorithm) -> tuple[dict[str, torch.Tensor], list[dict]]:
    trainer = ab.LocalTrainer(SPEC, algorithm, OPTIMIZER)
    metrics = [trainer.step(batch) for batch in batches()]
    return trainer.weights(), metrics


def max_gap(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    assert a.keys() == b.keys()
    return max(float((a[k].float() - b[k].float()).abs().max()) for k in a)


# -- the pure half --------------------------------------------------------------------------------
def test_only_astranbs_own_configs_travel_and_a_cell_loss_has_no_reference():
    assert travels_as_config(ab.GRPO()) and travels_as_config(ab.M2PO())
    assert not travels_as_config(cell_loss())

    class Sub(ab.GRPO):  # a subclass may change the loss: it does not pass for GRPO
        pass

    assert not travels_as_config(Sub())
    assert algorithm_reference(cell_loss()) is None  # <locals>: not importable by name
    ref = algorithm_reference(ImportableLoss(weight=2.0))
    assert ref == {"kind": "import", "ref": "tests.test_custom_loss:ImportableLoss",
                   "fields": {"weight": 2.0, "normalize_std": True, "filter_groups": False,
                              "entropy_coef": 0.0}}
    with pytest.raises(CodeNotAllowed, match="--allow-code"):
        algorithm_from_dict(ref)
    assert algorithm_from_dict(ref, allow_import=True) == ImportableLoss(weight=2.0)
    with pytest.raises(ValueError, match="not an Algorithm"):
        algorithm_from_dict({"kind": "import", "ref": "math:pi"}, allow_import=True)
    assert trainer_algorithm(ab.GRPO()) == ab.GRPO()
    assert trainer_algorithm(cell_loss()).entropy_coef == 0.01


def test_the_gradient_sent_is_the_loss_gradient_and_zero_off_the_trained_tokens():
    algorithm, batch = cell_loss(), make_batch(ROWS, 0)
    logp = batch.old_logp_B_T + 0.1 * torch.randn(batch.old_logp_B_T.shape)
    sent, metrics = gradient_batch(algorithm, batch, logp)
    leaf = logp.clone().requires_grad_(True)
    loss, _ = algorithm.loss(leaf, batch.old_logp_B_T, batch.advantages_B_T, batch.loss_mask_B_T)
    loss.backward()
    mask = batch.loss_mask_B_T.bool()
    assert torch.allclose(sent.advantages_B_T[mask], leaf.grad[mask], atol=1e-9)
    assert not sent.advantages_B_T[~mask].any()
    assert math.isclose(metrics["loss"], float(loss.detach()), rel_tol=1e-6)
    assert "cell/ratio_max" in metrics
    assert torch.equal(sent.input_ids_B_T, batch.input_ids_B_T)  # only the advantages change


def test_a_loss_that_returns_no_scalar_is_a_clear_error():
    @dataclasses.dataclass(frozen=True)
    class Wrong(ImportableLoss):
        def loss(self, logp_B_T, old_logp_B_T, adv_B_T, mask_B_T, num_tokens=None):
            return logp_B_T * adv_B_T, {}  # forgot the mean

    with pytest.raises(TypeError, match="must return \\(a scalar tensor, metrics\\)"):
        gradient_batch(Wrong(), make_batch(4, 0), make_batch(4, 0).old_logp_B_T)


# -- the three trainers ---------------------------------------------------------------------------
@pytest.mark.slow  # a trainer child process
def test_a_cell_loss_trains_the_same_in_a_child_process_as_in_this_one():
    expected, thread_metrics = thread_run(cell_loss())
    grpo, _ = thread_run(ab.GRPO(filter_groups=False))
    assert max_gap(expected, grpo) > 1e-3  # the cell's loss is what trained, not GRPO's
    trainer = ProcessTrainer("p", SPEC, cell_loss(), OPTIMIZER)
    try:
        metrics = [trainer.step(batch) for batch in batches()]
        assert trainer.version == STEPS
        assert max_gap(trainer.weights(), expected) <= 1e-6
    finally:
        trainer.close()
    for ours, theirs in zip(metrics, thread_metrics, strict=True):
        for key in ("loss", "entropy", "cell/ratio_max", "grad_norm", "tokens"):
            assert math.isclose(ours[key], theirs[key], rel_tol=1e-5, abs_tol=1e-7), key


@pytest.fixture(scope="module")
def trainer_services(tmp_path_factory):
    """Two trainer services as real processes: one plain, one started with --allow-code."""
    root = tmp_path_factory.mktemp("services")
    plain = Process(["serve", "trainer", "--checkpoint-dir", str(root / "plain")],
                    free_port(), root / "plain.log")
    code = Process(["serve", "trainer", "--allow-code", "--checkpoint-dir", str(root / "code")],
                   free_port(), root / "code.log")
    try:
        yield plain.start(), code.start(), root
    finally:
        plain.kill()
        code.kill()


def service_run(url: str, name: str, algorithm: ab.Algorithm,
                checkpoints) -> tuple[RemoteTrainer, dict]:
    async def run():
        client = TrainerClient(url)
        try:
            body = {"name": name, "model": spec_to_wire(SPEC), "micro_batch_size": 64,
                    "optimizer": dataclasses.asdict(OPTIMIZER)}
            trainer = RemoteTrainer(client, body, algorithm)
            await trainer.create()
            metrics = [await trainer.step(batch) for batch in batches()]
            assert await client.checkpoint(name) == STEPS
            return trainer, metrics
        finally:
            await client.close()

    trainer, metrics = anyio.run(run)
    weights = load_file(checkpoints / name / f"v{STEPS:06d}" / "model.safetensors")
    return trainer, {"weights": weights, "metrics": metrics}


@pytest.mark.slow  # two trainer services
def test_a_cell_loss_trains_the_same_on_a_trainer_service(trainer_services):
    plain, _, root = trainer_services
    expected, thread_metrics = thread_run(cell_loss())
    trainer, got = service_run(plain.url, "cell", cell_loss(), root / "plain")
    assert trainer.loss_here and trainer.body["algorithm"]["kind"] == "logp_gradient"
    assert max_gap(got["weights"], expected) <= 1e-6
    for ours, theirs in zip(got["metrics"], thread_metrics, strict=True):
        assert math.isclose(ours["loss"], theirs["loss"], rel_tol=1e-5, abs_tol=1e-7)
        assert "cell/ratio_max" in ours


@pytest.mark.slow
def test_a_service_imports_code_only_when_started_to(trainer_services):
    plain, code, root = trainer_services
    ref = algorithm_reference(ImportableLoss())

    async def ask(url):
        client = TrainerClient(url)
        try:
            return await client.add_policy({"name": "q", "model": spec_to_wire(SPEC),
                                            "algorithm": ref})
        finally:
            await client.close()

    with pytest.raises(ServiceError) as refused:
        anyio.run(ask, plain.url)
    assert refused.value.status == 403
    assert "does not import code" in str(refused.value) and "--allow-code" in str(refused.value)

    # the Session's path: without --allow-code the loss runs in the caller, with it on the service
    expected, _ = thread_run(ImportableLoss())
    here, _ = service_run(plain.url, "here", ImportableLoss(), root / "plain")
    there, got = service_run(code.url, "there", ImportableLoss(), root / "code")
    assert here.loss_here and not there.loss_here
    assert there.body["algorithm"] == ref
    assert max_gap(got["weights"], expected) <= 1e-6


@pytest.mark.slow  # a session with its trainer in a child process, twice
def test_a_session_trains_a_cell_loss_in_its_child_and_resumes_it_once_built_again(tmp_path):
    """The Session's own path. The run's plan can name the cell's class only (it cannot be
    imported by name), so resuming in a fresh Session asks for the policy; built again with the
    same algorithm, the run resumes from its checkpoint and trains on."""

    def build(session: ab.Session) -> None:
        policy = session.policy("solver", model=ab.models.tiny(hidden_size=32, num_heads=2),
                                algorithm=cell_loss(), optimizer=OPTIMIZER)
        assert type(policy.trainer).__name__ == "ProcessTrainer"
        session.wire(ab.environments.load("arithmetic"), solver=policy)

    def stop_after(run, steps: int) -> list[dict]:
        wait_until(lambda: len(run.rows) >= steps, 120, f"{steps} steps")
        run.stop()
        wait_until(lambda: run.status != "running", 60, "the run to stop")
        return run.rows

    session = ab.Session(tmp_path, trainer="process")
    build(session)
    run = session.train(steps=1000, batch_size=8, group_size=4, checkpoint_every=2)
    rows = stop_after(run, 2)
    session.close()
    assert all(0 < row["cell/ratio_max"] <= 2.0 for row in rows)  # the cell's loss trained
    plan = json.loads((run.directory / "plan.json").read_text())
    assert plan["policies"]["solver"]["algorithm"] == {
        "kind": "custom", "class": "cell_loss.<locals>.SquaredRatioPG"}

    with pytest.raises(ValueError, match=r"build the policy in this session again, "
                                         r"session.policy\('solver'"):
        ab.Session.resume(tmp_path)
    again = ab.Session(tmp_path, trainer="process")
    try:
        build(again)
        resumed = again.resume()
        start = resumed.events[0]["versions"]["solver"]
        assert start >= 2
        rows = stop_after(resumed, start + 1)
        assert rows[-1]["version"] > start and "cell/ratio_max" in rows[-1]
    finally:
        again.close()
