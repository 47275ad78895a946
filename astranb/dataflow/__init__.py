"""One run's dataflow: the staleness gate, per-policy buffers, the batcher, the orchestrator that
plays groups of episodes, the version barrier and the train loops, assembled by `flow.Dataflow`.

Written against `astranb.contracts` only, so the same parts run with engines in this process,
with rollout services, and on the simulator's virtual clock.
"""
