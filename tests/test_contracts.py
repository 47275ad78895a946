"""The contracts say what is used, and every implementation in astranb has all of it.

An engine, trainer, publisher or remote-episodes implementation declares its contracts by
subclassing them (astranb/contracts.py). These tests find every such class in the package and
check, without running anything, that each member its contracts declare is there, with a
signature a caller of the contract can use; an optional member the contract gives a default for
(`Trainer.prepare`, `Publisher.publish_initial`, `Publisher.overlaps_next_step`) may be
inherited.
"""

from __future__ import annotations

import ast
import importlib
import inspect
import pkgutil
import textwrap
from typing import Any

import pytest

import astranb
from astranb import contracts
from astranb.engines.base import RolloutEngine

CONTRACTS = (contracts.Engine, RolloutEngine, contracts.Trainer, contracts.Checkpointable,
             contracts.SupervisedTrainer, contracts.RecordingTrainer, contracts.Publisher,
             contracts.RemoteEpisodes)

# the implementations there are today: a contract whose implementations stop declaring it
# would otherwise be checked against nothing
EXPECTED = {
    contracts.Engine: {"HFEngine", "SGLangEngine", "InstantEngine", "SimEngine"},
    RolloutEngine: {"HFEngine", "SGLangEngine", "InstantEngine", "SimEngine"},
    contracts.Trainer: {"LocalTrainer", "ProcessTrainer", "RemoteTrainer", "SimTrainer"},
    contracts.Checkpointable: {"LocalTrainer", "ProcessTrainer"},
    contracts.SupervisedTrainer: {"LocalTrainer", "ProcessTrainer"},
    contracts.RecordingTrainer: {"LocalTrainer", "ProcessTrainer"},
    contracts.Publisher: {"EnginePublisher", "StatePublisher", "ProcessPublisher",
                          "ServicesPublisher", "SimPublisher", "RegionPublisher"},
    contracts.RemoteEpisodes: {"RolloutPool", "RegionRollout"},
}

EITHER_SYNC_OR_ASYNC = {("Trainer", "step")}
"""Members the contract lets an implementation write as a plain method or a coroutine."""

_DATA = object()  # an annotated attribute of a contract (no value of its own)


def _is_protocol(klass: type) -> bool:
    return bool(klass.__dict__.get("_is_protocol", False))


def _declared(contract: type) -> dict[str, Any]:
    """name -> declaration (function, property, value or _DATA) of a contract and the
    contracts it extends."""
    out: dict[str, Any] = {}
    for klass in reversed(contract.__mro__):
        if not _is_protocol(klass) or klass.__module__ == "typing":
            continue
        for name in klass.__dict__.get("__annotations__", {}):
            out[name] = _DATA
        for name, value in vars(klass).items():
            if not name.startswith("_"):
                out[name] = value
    return out


def _function_node(function: Any) -> ast.FunctionDef | ast.AsyncFunctionDef:
    node = ast.parse(textwrap.dedent(inspect.getsource(function))).body[0]
    assert isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef)
    return node


def _is_stub(function: Any) -> bool:
    """Whether a contract's method is a bare declaration (docstring and/or `...`), not a
    default an implementation may inherit."""
    body = _function_node(function).body
    rest = [s for s in body if not (isinstance(s, ast.Expr) and isinstance(s.value, ast.Constant)
                                    and isinstance(s.value.value, str | type(Ellipsis)))]
    return not rest


def _assigned_on_self(klass: type) -> set[str]:
    """Attributes a class's own methods assign on `self` (instance attributes)."""
    try:
        tree = ast.parse(textwrap.dedent(inspect.getsource(klass)))
    except (OSError, TypeError):
        return set()
    names = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Store) \
                and isinstance(node.value, ast.Name) and node.value.id == "self":
            names.add(node.attr)
    return names


def _owner(cls: type, name: str) -> type | None:
    """The class in `cls`'s MRO that defines `name` (a value or an annotation), if any."""
    for klass in cls.__mro__:
        if name in vars(klass) or name in klass.__dict__.get("__annotations__", {}):
            return klass
    return None


def _signature_problem(contract_fn: Any, impl_fn: Any) -> str | None:
    """Why a call written against the contract's signature would not fit the implementation's
    (None: it fits)."""
    want = list(inspect.signature(contract_fn).parameters.values())[1:]
    have = list(inspect.signature(impl_fn).parameters.values())[1:]
    varargs = any(p.kind is p.VAR_POSITIONAL for p in have)
    varkw = any(p.kind is p.VAR_KEYWORD for p in have)
    positional = [p for p in have if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    by_name = {p.name: p for p in have}
    used = set()
    for i, p in enumerate(want):
        if p.kind in (p.VAR_POSITIONAL, p.VAR_KEYWORD):
            continue
        if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD):
            if i >= len(positional):
                if varargs:
                    continue
                return f"takes no positional argument {i + 1} ({p.name!r})"
            match = positional[i]
            if p.kind is p.POSITIONAL_OR_KEYWORD and match.name != p.name:
                return f"names argument {i + 1} {match.name!r}, the contract {p.name!r}"
        else:
            match = by_name.get(p.name)
            if match is None or match.kind not in (match.KEYWORD_ONLY,
                                                    match.POSITIONAL_OR_KEYWORD):
                if varkw:
                    continue
                return f"takes no keyword argument {p.name!r}"
        if p.default is not p.empty and match.default is match.empty:
            return f"requires {p.name!r}, which the contract lets callers leave out"
        used.add(match.name)
    for p in have:
        if p.name not in used and p.default is p.empty \
                and p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD):
            return f"requires {p.name!r}, which the contract does not pass"
    return None


def problems(cls: type, contract: type) -> list[str]:
    """What `cls` lacks or gets wrong of `contract`, one line each (empty: nothing)."""
    where = f"{cls.__module__}.{cls.__qualname__}"
    found = []
    for name, declaration in _declared(contract).items():
        owner = _owner(cls, name)
        inherited = owner is None or _is_protocol(owner)
        missing = f"{where} lacks {contract.__name__}.{name}"
        if declaration is _DATA or isinstance(declaration, property):
            stub = declaration is _DATA or _is_stub(declaration.fget)
            if inherited and stub and not any(name in _assigned_on_self(k) for k in cls.__mro__
                                               if not _is_protocol(k) and k is not object):
                found.append(missing)
            continue
        if not inspect.isfunction(declaration):
            continue  # a plain value: its default is inherited
        if inherited:
            if _is_stub(declaration):
                found.append(missing)
            continue
        impl = getattr(cls, name)
        if not callable(impl):
            found.append(f"{where}.{name} is not a method ({contract.__name__}.{name} is)")
            continue
        wants_async = inspect.iscoroutinefunction(declaration)
        if inspect.iscoroutinefunction(impl) != wants_async \
                and (contract.__name__, name) not in EITHER_SYNC_OR_ASYNC:
            kind = "a coroutine" if wants_async else "a plain method"
            found.append(f"{where}.{name} must be {kind} ({contract.__name__}.{name} is)")
        why = _signature_problem(declaration, impl)
        if why is not None:
            found.append(f"{where}.{name} {why} ({contract.__name__}.{name}"
                         f"{inspect.signature(declaration)})")
    return found


def _implementations() -> dict[type, list[type]]:
    """contract -> every class in astranb that declares it (subclasses it), contracts aside."""
    for module in pkgutil.walk_packages(astranb.__path__, "astranb."):
        if not module.name.endswith("__main__"):
            importlib.import_module(module.name)
    seen: dict[type, list[type]] = {c: [] for c in CONTRACTS}
    todo = list(CONTRACTS)
    while todo:
        for sub in todo.pop().__subclasses__():
            todo.append(sub)
            for contract in CONTRACTS:
                if contract in sub.__mro__ and not _is_protocol(sub) \
                        and sub.__module__.startswith("astranb.") and sub not in seen[contract]:
                    seen[contract].append(sub)
    return seen


@pytest.fixture(scope="module")
def implementations() -> dict[type, list[type]]:
    return _implementations()


def test_every_engine_trainer_and_publisher_declares_its_contracts(implementations):
    for contract, names in EXPECTED.items():
        found = {cls.__name__ for cls in implementations[contract]}
        assert names <= found, (f"{sorted(names - found)} no longer declare "
                                f"{contract.__name__} (subclass it)")


@pytest.mark.parametrize("contract", CONTRACTS, ids=lambda c: c.__name__)
def test_every_implementation_has_what_its_contract_declares(implementations, contract):
    found = [line for cls in implementations[contract] for line in problems(cls, contract)]
    assert not found, "\n".join(found)


# -- the check itself fails where it should ------------------------------------------------------

class _Broken(contracts.Trainer):
    """Declares Trainer, lacks `weights`, and names its step's argument differently."""

    def __init__(self) -> None:
        self.version = 0

    def step(self, rows) -> dict:
        return {}


class _BrokenPublisher(contracts.Publisher):
    """Declares Publisher with the old signature of `publish` and no `where`."""

    checksum = None

    async def publish(self, name, trainer) -> dict:
        return {}


class _Sync(contracts.Publisher):
    where, checksum = "here", None

    def publish(self) -> dict:  # type: ignore[override]  # the contract's is a coroutine
        return {}


def test_the_check_names_the_class_and_what_it_lacks_or_gets_wrong():
    assert problems(_Broken, contracts.Trainer) == [
        f"{__name__}._Broken.step names argument 1 'rows', the contract 'batch' "
        "(Trainer.step(self, batch: 'Batch') -> 'Any')",
        f"{__name__}._Broken lacks Trainer.weights",
    ]
    assert problems(_BrokenPublisher, contracts.Publisher) == [
        f"{__name__}._BrokenPublisher lacks Publisher.where",
        f"{__name__}._BrokenPublisher.publish requires 'name', which the contract does not "
        "pass (Publisher.publish(self) -> 'dict[str, Any]')",
    ]
    assert problems(_Sync, contracts.Publisher) == [
        f"{__name__}._Sync.publish must be a coroutine (Publisher.publish is)"]


def test_defaults_of_optional_members_are_inherited():
    from astranb.sim.trainer import SimPublisher, SimTrainer

    assert "prepare" not in vars(SimTrainer) and "publish_initial" not in vars(SimPublisher)
    assert SimPublisher.overlaps_next_step is False
    assert problems(SimTrainer, contracts.Trainer) == []
    assert problems(SimPublisher, contracts.Publisher) == []


def test_a_services_publisher_without_a_store_needs_a_trainer_service():
    from astranb.remote.pool import RolloutPool, ServicesPublisher
    from astranb.sim.trainer import SimTrainer, TrainPool

    trainer = SimTrainer(TrainPool(1), costs=None)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match=r"pass store=WeightStore\(name\)"):
        ServicesPublisher(RolloutPool([], None, {}), "p", trainer)
