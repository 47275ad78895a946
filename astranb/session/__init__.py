"""The run layer: a Session, the runs it starts, and the folder they leave behind.

    session.py    Session, the front users call: policies, wiring, train, evaluate, resume
    context.py    RunContext, what the Session's runs share (loop, folder, wiring, runs);
                  launch, heldout, restore and wiring receive it, never the Session
    launch.py     a run's start and its main task on the session's loop
    heldout.py    held-out plays: Session.evaluate and train(eval_every=...)
    restore.py    Session.resume: the plan a run leaves, and the rebuild from it
    wiring.py     the live view of what is wired to what (`session.wiring`)
    policy.py     Policy: an engine, a trainer and a publisher under one name
    run.py        Run (a live run's handle), RunRecord and open_run (a run read back)
    recorder.py   Recorder: metrics rows, events and kept episodes, as they arrive
    episodes.py   which episodes a run keeps, and the compact files they are kept in
    report.py     run.json: what a run was asked for and how it ended
    checkpoint.py an embedded run's checkpoints and plan
    history.py    ab.runs and ab.compare over past run folders
    trackers.py   experiment trackers (TensorBoard, W&B, MLflow)
    folder.py     the run folder: its file names, readers, atomic writes and lock

Everything here sits above the pure parts (dataflow/, engines/, training/, ...) and the HTTP
client side (remote/); nothing below imports it.
"""

from __future__ import annotations

from .session import Session

__all__ = ["Session"]
