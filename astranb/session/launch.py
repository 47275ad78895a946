"""Starting a Session's run and its main task on the session's loop.

Every function here takes the Session's `RunContext` (context.py), never the Session.
`check_ready` refuses a run that cannot start (wiring problems, or a run still going).
`Session.train` and `Session.resume` validate their arguments, make the run's Recorder and call
`start`, which writes run.json's "running" record, schedules `run_main` on the context's event
loop, adds the run to `context.runs` and returns the `Run` handle at once. `run_main` builds the
`Dataflow` (the Sources, the checkpoint callback, the held-out windows) as `context.flow`, runs
it in a cancel scope that `run.stop()` cancels, and, however it ends, fills the run's episode
accounting, closes the recorder and then the experiment trackers. A failure of the dataflow's
task group is raised as its root cause (`root_cause`), not as an exception group, so notebooks
show it as the cell's error.
"""

from __future__ import annotations

import functools
import traceback
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import TYPE_CHECKING, Any

import anyio

from .._heap import hold_frozen
from ..contracts import Checkpointable
from ..dataflow.config import RunConfig
from ..dataflow.flow import Dataflow, HeldOut
from ..dataflow.ledger import parse_sample_id
from ..dataflow.orchestrator import Source
from .checkpoint import write_checkpoint
from .context import RunContext
from .folder import checkpoints_of
from .recorder import Recorder
from .report import RunInfo
from .run import Run
from .trackers import Tracker, Trackers, run_hyperparameters
from .wiring import blocking_problems

if TYPE_CHECKING:
    from ..environments.base import Environment
    from .policy import Policy

__all__ = ["check_ready", "start", "run_main", "accounting", "root_cause",
           "decoder"]

Wired = Sequence[tuple["Environment", Mapping[str, "Policy"], float]]


def check_ready(context: RunContext) -> list[tuple[Environment, dict[str, Policy], float]]:
    """The session's wiring, once nothing stops a run from starting and no run is going.

    Raises:
        ValueError: the wiring's problems (`blocking_problems`).
        RuntimeError: a run of the session is still going.
    """
    problems = blocking_problems(context)
    if problems:
        raise ValueError("; ".join(problems))
    going = [r for r in context.runs if not r.done]
    if going:
        raise RuntimeError("a run is still going; await it or call run.stop() first")
    return list(context.wiring)


def start(context: RunContext, config: RunConfig, wired: Wired, recorder: Recorder,
          heldout: HeldOut | None, *, targets: Mapping[str, int], checkpoints: tuple[int, int],
          position: Mapping[str, Any] | None = None, time_offset: float = 0.0,
          loggers: Sequence[Tracker] = (), autoscale: Any = None) -> Run:
    """Start `run_main` on the context's loop and return the run's handle (in `context.runs`).

    `checkpoints` is (checkpoint_every, keep_checkpoints); `position` and `time_offset` are a
    resumed run's sample-stream position and clock; `autoscale` an
    `astranb.remote.scaling.Autoscaler` (or None).
    """
    policies = sorted({p.name for _, wiring, _ in wired for p in wiring.values()})
    scope_box: list[anyio.CancelScope | None] = []  # the run's scope (see _cancel)
    final: dict[str, int] = {}  # the accounting, filled when the run ends; live until then
    resume = {"targets": dict(targets), "checkpoints": checkpoints,
              "position": position or {}, "time_offset": time_offset,
              "autoscale": autoscale}
    info = RunInfo.begin(recorder, config, wired,  # run.json: settings, then how it ended
                         stopped=lambda: bool(scope_box) and (scope_box[0] is None
                                                              or scope_box[0].cancel_called))
    trackers = None if not loggers else Trackers(
        loggers, recorder, run_hyperparameters(config, wired, heldout),
        {role: p.name for role, p in (heldout.wiring if heldout else {}).items()})
    release_heap = hold_frozen()  # full GC passes walk only what the run makes
    try:
        future = context.loop().start_task_soon(info.watch, run_main, context, config, wired,
                                                 recorder, scope_box, final, heldout, resume,
                                                 trackers, release_heap)
    except BaseException:
        release_heap()
        raise
    future.add_done_callback(lambda _: release_heap())  # a task cancelled before it began
    if trackers is not None:  # a task that never started: let its trackers go
        future.add_done_callback(lambda _: trackers.close(wait=False))
    run = Run(config, recorder, future, lambda: _cancel(context, scope_box), policies,
              lambda: dict(final) or context.call(accounting, context), heldout)
    context.runs.append(run)
    return run


def _cancel(context: RunContext, scope_box: list[anyio.CancelScope | None]) -> None:
    """Stop the run from any thread. On the loop: cancel its scope, or, when the task has not
    entered it yet (a stop right after `train()`), leave None in the box, which the task reads
    as "cancel at once" when it gets there."""
    def on_loop() -> None:
        if scope_box and scope_box[0] is not None:
            scope_box[0].cancel()
        elif not scope_box:
            scope_box.append(None)

    if context.portal is not None:
        context.portal.call(on_loop)


async def run_main(context: RunContext, config: RunConfig, wired: Wired, recorder: Recorder,
                   scope_box: list[anyio.CancelScope | None], final: dict[str, int],
                   heldout: HeldOut | None, resume: Mapping[str, Any],
                   trackers: Trackers | None = None,
                   release_heap: Callable[[], None] = lambda: None) -> None:
    """The run's task: the Dataflow until it ends, then the accounting, recorder, trackers."""
    flow = _flow(context, config, wired, recorder, heldout, resume)
    pool = context.pool
    if (heldout is not None and pool is not None
            and all(heldout.env is not env for env, _, _ in wired)):
        pool.register_env(heldout.env, heldout.wiring)  # the services play it too
    failure: BaseException | None
    try:
        with anyio.CancelScope() as scope:
            if scope_box:  # stopped before it began (see _cancel)
                scope_box[0] = scope
                scope.cancel()
            else:
                scope_box.append(scope)
            scaler = resume.get("autoscale")
            also = [] if scaler is None else [functools.partial(
                scaler.run, pool, lambda: recorder.rows, recorder.add_event)]
            await flow.run(*also)
    except BaseExceptionGroup as group:
        failure = root_cause(group)
    else:
        failure = None
    finally:
        release_heap()
        final.update(accounting(context))
        recorder.close()
        if trackers is not None:  # after the recorder: they have every row; files complete
            with anyio.CancelScope(shield=True):
                await anyio.to_thread.run_sync(trackers.close)
    if failure is not None:
        # Raised here, outside the except block, so its __context__ is not the task group's
        # ExceptionGroup: IPython prints a traceback that links to an exception group as a
        # plain stderr stream instead of an error output, and nbclient/nbmake/papermill
        # would then miss the failure.
        raise failure


def _flow(context: RunContext, config: RunConfig, wired: Wired, recorder: Recorder,
          heldout: HeldOut | None, resume: Mapping[str, Any]) -> Dataflow:
    """The run's Dataflow, kept as `context.flow` (read by `accounting` and checkpoints)."""
    drawn = list(resume["position"].get("drawn") or [])
    replay = _replay(resume["position"].get("pending") or [])
    sources = [Source(env, wiring, weight, config.seed, skip=drawn[i] if i < len(drawn) else 0,
                      replay=replay.get(i, ()))
               for i, (env, wiring, weight) in enumerate(wired)]
    every, keep = resume["checkpoints"]
    flow = context.flow = Dataflow(
        sources, config, recorder, remote=context.pool, heldout=heldout,
        targets=resume["targets"], time_offset=resume["time_offset"],
        checkpoint=functools.partial(_checkpoint, context, recorder, keep),
        checkpoint_every=every)
    flow.orchestrator.restore_position(resume["position"])
    return flow


def _replay(pending: Sequence[Mapping[str, Any]]) -> dict[int, list[tuple[int, Any]]]:
    """A checkpoint's pending samples as stream -> [(position, sample or None)]."""
    out: dict[int, list[tuple[int, Any]]] = {}
    for entry in pending:
        stream, position = parse_sample_id(entry["sample_id"])
        out.setdefault(stream, []).append((position, entry.get("sample")))
    return out


async def _checkpoint(context: RunContext, recorder: Recorder, keep: int, policy: Policy) -> None:
    """Write a checkpoint of `policy` (called by its train loop between two steps). Its state
    holds the streams' position with the samples not yet accounted for ("pending"), and how
    many episodes the run had played ("episodes"): a resumed run numbers its episodes on from
    there and sets the later ones aside."""
    flow = context.flow
    assert flow is not None  # set before the train loops start
    state = {"policy": policy.name, "version": policy.version,
             "position": flow.orchestrator.position(),
             "episodes": recorder.played,
             "time": anyio.current_time() - flow.loops[0].started}
    root = checkpoints_of(recorder.directory, policy.name)
    trainer = policy.trainer
    assert isinstance(trainer, Checkpointable)  # train() refuses checkpoints otherwise
    await anyio.to_thread.run_sync(functools.partial(
        write_checkpoint, root, policy.version, trainer.save, state, keep=keep))


def accounting(context: RunContext) -> dict[str, int]:
    """The current run's episode accounting (called on the loop)."""
    flow = context.flow
    counts = context.pool.accounting() if context.pool is not None else {}
    return {**counts, "trained_twice": flow.trained_twice if flow is not None else 0}


def root_cause(group: BaseExceptionGroup) -> BaseException:
    """The error behind nested task-group failures (cancellations it caused left out). When
    different kinds of error happened together: one RuntimeError naming each, with their
    tracebacks in its message (not an exception group, which notebooks show poorly)."""
    cancelled = anyio.get_cancelled_exc_class()
    leaves = [e for e in _leaves(group) if not isinstance(e, cancelled)] or list(_leaves(group))
    if len({type(e) for e in leaves}) == 1:
        context = leaves[0].__context__
        if context is not None and isinstance(context, BaseExceptionGroup):
            leaves[0].__context__ = None
        return leaves[0]
    details = "\n".join("".join(traceback.format_exception(e)) for e in leaves)
    return RuntimeError(f"{len(leaves)} errors at once in the run's background tasks:\n{details}")


def _leaves(error: BaseException) -> Iterator[BaseException]:
    if isinstance(error, BaseExceptionGroup):
        for inner in error.exceptions:
            yield from _leaves(inner)
    else:
        yield error


def decoder(policy: Policy) -> Callable[[Sequence[int]], str]:
    """Prompt ids -> text for recorded episodes; the episodes of a group share their prompt, so
    recent prompts are decoded once."""
    tok = policy.tokenizer

    @functools.lru_cache(maxsize=4096)
    def decode(ids: tuple[int, ...]) -> str:
        text: str = tok.decode(list(ids), skip_special_tokens=False)
        return text

    return lambda ids: decode(tuple(ids))
