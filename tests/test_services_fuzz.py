"""Schema-driven fuzzing of real service processes: the committed OpenAPI schemas are current,
and ~500 generated requests (valid and not, 25 per operation) never get a 5xx and leave the
services up."""

from __future__ import annotations

import json
import sys

import httpx
import pytest
import schemathesis
from hypothesis import HealthCheck, settings

from astranb.services.http import free_port

from .services import ROOT, Process, rollout_process

sys.path.insert(0, str(ROOT / "scripts"))
from export_openapi import OUT, schemas  # noqa: E402

TOKEN = "fuzz-token"
AUTH = {"authorization": f"Bearer {TOKEN}"}


def test_committed_openapi_schemas_are_current():
    for name, schema in schemas().items():
        committed = json.loads((OUT / name).read_text())
        assert committed == json.loads(json.dumps(schema)), (
            f"docs/openapi/{name} is stale; run .venv/bin/python scripts/export_openapi.py")


@pytest.fixture(scope="module")
def live(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("fuzz")
    rollout = rollout_process(tmp, "fuzz-rollout", None, "--engine", "instant", "--token", TOKEN)
    trainer = Process(["serve", "trainer", "--token", TOKEN, "--checkpoint-dir", str(tmp / "ckpt")],
                      free_port(), tmp / "fuzz-trainer.log")
    rollout.start()
    trainer.start()
    yield {"rollout.json": rollout, "trainer.json": trainer}
    for p in (rollout, trainer):
        healthy = httpx.get(f"{p.url}/v1/status", headers=AUTH, timeout=10).status_code == 200
        p.kill()
        assert healthy, f"{p.args} stopped serving after the fuzz run:\n{p.log()}"


rollout_schema = schemathesis.openapi.from_path(OUT / "rollout.json")
trainer_schema = schemathesis.openapi.from_path(OUT / "trainer.json")
FUZZ = settings(max_examples=25, deadline=None, suppress_health_check=list(HealthCheck))


def _call(case, process: Process):
    if case.path == "/v1/shutdown":
        pytest.skip("shutdown is tested on its own; fuzzing it would end the run")
    if isinstance(case.body, dict) and isinstance(case.body.get("wait"), (int, float)):
        case.body["wait"] = min(case.body["wait"], 0.05)  # keep long-polls short
    answer = case.call(base_url=process.url, headers=AUTH, timeout=30)
    assert answer.status_code < 500, (f"{case.method} {case.path} -> {answer.status_code}: "
                                      f"{answer.text[:300]}")
    return answer


@pytest.mark.slow  # fuzzes live service processes (module fixture live)
@rollout_schema.parametrize()
@FUZZ
def test_rollout_service_never_answers_5xx(case, live):
    _call(case, live["rollout.json"])


@pytest.mark.slow  # fuzzes live service processes (module fixture live)
@trainer_schema.parametrize()
@FUZZ
def test_trainer_service_never_answers_5xx(case, live):
    _call(case, live["trainer.json"])
