"""The HTTP client side: talking to rollout and trainer services through the same contracts the
in-process parts satisfy.

    client.py     async httpx clients of both services (injectable transport)
    pool.py       RolloutPool (routing, heartbeats, failover, accounting) and ServicesPublisher
    trainer.py    RemoteTrainer: a policy's trainer on a trainer service
    scaling.py    Autoscaler: adds and drains rollout services from the trainers' idle time
    routing.py    which service gets each queued episode: the one that would finish it first
    serialize.py  the wire format: trajectories, generations and specs as dicts; batches as
                  safetensors bytes; JSON or msgpack bodies (never pickle)

Only the session layer, the CLI, `astranb.services` and `astranb.notebook` import this package.
"""
