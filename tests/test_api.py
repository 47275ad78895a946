"""Pin the public facade: the names users import and the main signatures."""

import inspect
import re
from pathlib import Path

import astranb as ab

README = Path(__file__).resolve().parent.parent / "README.md"
NOTEBOOKS = README.parent / "notebooks"


def readme_api() -> set[str]:
    """The names of README's "API at a glance" table."""
    text = README.read_text()
    section = text[text.index("## API at a glance"):]
    section = section[:section.index("\n## ", 1)]
    rows = [line.split("|")[2] for line in section.splitlines() if line.startswith("| ")]
    return {name for row in rows[1:] for name in re.findall(r"`([\w]+)`", row)}


def test_the_facade_is_the_public_api_readme_lists():
    assert len(ab.__all__) == len(set(ab.__all__))
    assert set(ab.__all__) == readme_api()
    # dir() shows the public API only, though importing submodules binds their names too
    import astranb.dataflow.buffer  # noqa: F401

    assert "dataflow" in vars(ab) and dir(ab) == sorted(ab.__all__)
    for name in ab.__all__:
        assert getattr(ab, name) is not None, name


def test_docs_and_notebooks_use_only_public_names():
    texts = [README.read_text()] + [p.read_text() for p in sorted(NOTEBOOKS.glob("*.ipynb"))]
    used = {name for text in texts for name in re.findall(r"\bab\.(\w+)", text)}
    assert used - {*ab.__all__, "__all__"} == set()


def test_the_facade_check_catches_a_name_missing_from_readme(monkeypatch):
    monkeypatch.setattr(ab, "__all__", [*ab.__all__, "Hidden"])
    assert set(ab.__all__) != readme_api()


def params(fn):
    return list(inspect.signature(fn).parameters)


def test_main_signatures():
    assert params(ab.Session) == ["directory", "device", "torch_threads", "rollout", "trainer",
                                  "token", "failure_timeout", "transport"]
    assert params(ab.Session.add_rollout) == ["self", "url"]
    assert params(ab.Session.remove_rollout) == ["self", "url"]
    assert params(ab.Session.policy) == [
        "self", "name", "model", "engine", "algorithm", "optimizer", "max_batch_size", "seed",
        "weight_transfer", "full_every", "reference", "lora", "trainer"]
    assert params(ab.Session.wire) == ["self", "env", "weight", "roles"]
    assert params(ab.Session.train) == [
        "self", "steps", "batch_size", "group_size", "max_staleness", "order", "seed", "mode",
        "eval_every", "eval_n", "eval_k", "eval_split", "eval_env", "checkpoint_every",
        "keep_checkpoints", "record", "record_per_step", "loggers", "autoscale", "stall_seconds",
        "max_gen_batches", "stop_when_learned", "sampler", "inspect_every"]
    assert params(ab.Session.resume) == ["self", "run", "envs", "loggers"]
    assert params(ab.Session.evaluate) == ["self", "env", "split", "n", "k", "seed"]
    assert params(ab.Policy.sft) == ["self", "examples", "steps", "batch_size", "lr", "seed",
                                     "progress"]
    assert params(ab.models.hf) == ["name_or_path", "revision", "dtype"]
    assert params(ab.EpisodeContext.chat) == ["self", "role", "messages", "tools", "sampling"]
    assert params(ab.EpisodeContext.run_tools) == ["self", "messages", "message", "tools"]
    assert inspect.iscoroutinefunction(ab.EpisodeContext.chat)
    assert params(ab.Run.wait) == ["self", "timeout", "progress"]
    assert params(ab.models.tiny)[:4] == ["hidden_size", "num_layers", "num_heads", "seed"]
    assert params(ab.environments.load) == ["name", "kwargs"]
    assert params(ab.Environment.episode) == ["self", "ctx", "sample"]
    assert inspect.iscoroutinefunction(ab.Environment.episode)
    assert inspect.iscoroutinefunction(ab.EpisodeContext.generate)
    assert inspect.iscoroutinefunction(ab.EpisodeContext.tool)
    assert params(ab.EpisodeContext.tool) == ["self", "name", "fn", "args", "kwargs"]
    assert params(ab.debug) == ["env", "sample", "policies"]
    for method in ("forward", "back", "goto", "run_until", "edit", "rescore", "to_html",
                   "export_html"):
        assert callable(getattr(ab.EpisodeDebugger, method))
    # Trainer is the contract (a Protocol); LocalTrainer is its in-process implementation
    for method in ("step", "weights"):
        assert callable(getattr(ab.Trainer, method))
    for method in ("step", "weights", "save", "load"):
        assert callable(getattr(ab.LocalTrainer, method))
    for contract in (ab.Trainer, ab.Engine, ab.Publisher):
        assert getattr(contract, "_is_protocol", False), contract


def test_errors_share_one_base_and_keep_their_builtin_bases():
    assert issubclass(ab.WeightTransferError, ab.AstranbError)
    assert issubclass(ab.WeightTransferError, ValueError)
    assert issubclass(ab.ServiceUnavailable, ConnectionError)
    for error in (ab.EpisodesKeepFailing, ab.ReplayError, ab.ServiceError, ab.TrainerRolledBack,
                  ab.NoTrainableTokens, ab.SamplesRanOut):
        assert issubclass(error, ab.AstranbError) and issubclass(error, RuntimeError), error


