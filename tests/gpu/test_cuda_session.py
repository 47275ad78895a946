"""GPU checks: the embedded session on CUDA (bf16 engine and trainer). Skipped without CUDA."""

import pytest
import torch

import astranb as ab
from tests.envs import CountA

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
]


def test_session_trains_on_cuda_and_engine_matches_trainer(tmp_path):
    with ab.Session(tmp_path, device="cuda") as session:
        policy = session.policy("solver", model=ab.models.tiny(hidden_size=64))
        session.wire(CountA(), solver=policy)
        run = session.train(steps=3, batch_size=8, group_size=4, max_staleness=1)
        run.wait(progress=False)
        assert (run.metrics["staleness_max"] <= 1).all()
        engine_state = policy.engine.state_dict()
        for name, tensor in policy.trainer.weights().items():
            assert engine_state[name].dtype == torch.bfloat16
            assert engine_state[name].cpu().equal(tensor.cpu()), name
