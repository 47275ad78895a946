"""AgentBench task servers as astranb environments.

    from astranb_agentbench import AgentBench

    env = AgentBench("alfworld-std", controller="http://127.0.0.1:5000/api")
    session.wire(env, agent=policy)

AgentBench (THUDM/AgentBench) runs each task (ALFWorld, WebShop, OS interaction, DB, ...) as task
workers behind a controller, usually in docker. This adapter speaks the controller's HTTP
protocol, as AgentBench's own `TaskClient` does:

    POST {controller}/start_sample  {"name": task, "index": i}
        -> {"session_id": s, "output": {"index", "status", "result", "history"}}
    POST {controller}/interact      {"session_id": s,
                                     "agent_response": {"status": "normal", "content": reply}}
        -> the same shape; "history" is the whole conversation so far
    POST {controller}/cancel        {"session_id": s}
    GET  {controller}/get_indices?name=task -> [index, ...]

A sample runs while output.status is "running"; any other status ends it ("completed", "agent
invalid action", "task limit reached", ...), and output.result holds the task's result.
"""

from __future__ import annotations

from .env import AgentBench, AgentBenchError, default_reward

__all__ = ["AgentBench", "AgentBenchError", "default_reward"]
