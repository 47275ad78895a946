"""The other-process side: parts of a policy that run in another process, behind the same
contracts the in-process parts satisfy (`astranb.contracts`).

Rollout and trainer services, over HTTP:

    client.py     async httpx clients of both services (injectable transport)
    pool.py       RolloutPool, the session's rollout services, composed of the three below;
                  ServicesPublisher, a policy's Publisher over them
    members.py    Members: who the services are and how healthy (ready, suspect, dead)
    dispatch.py   Dispatch: the episode queue, first result wins, a dead member's work
                  resubmitted; the run's accounting
    broadcast.py  WeightBroadcast: each new version out to the services, straight, pushed, or
                  through a region's relay
    routing.py    which service gets each queued episode: the one that would finish it first
    scaling.py    Autoscaler: adds and drains rollout services from the trainers' idle time
    trainer.py    RemoteTrainer: a policy's trainer on a trainer service
    serialize.py  the wire format: trajectories, generations and specs as dicts; batches as
                  safetensors bytes; JSON or msgpack bodies (never pickle)

A trainer in a child process, over a pipe (no HTTP):

    process.py    ProcessTrainer (a LocalTrainer in the child), ProcessPublisher (the child's
                  full snapshots into the engine here), the frames, and the child's loop
    _trainer_child.py  the child's entry point: `python -m astranb.remote._trainer_child`

Only the session layer, the CLI, `astranb.services` and `astranb.notebook` import this package.
"""
