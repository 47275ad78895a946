"""HTTP services: a rollout service and a trainer service a Session can drive remotely.

`create_app` factories build each service as an ASGI app (rollout_app, trainer_app); `client`
holds the Session side (httpx). Wire formats are JSON/msgpack and safetensors; never pickle.
"""
