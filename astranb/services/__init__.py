"""HTTP services: a rollout service and a trainer service a Session can drive remotely.

`create_app` factories build each service as an ASGI app (rollout_app, trainer_app). The
Session's side is `astranb.remote`: the httpx clients (client), the rollout pool (pool), the
remote trainer (trainer) and the wire encoding (serialize). Wire formats are JSON/msgpack and
safetensors; never pickle.
"""
