"""Benchmark: the service path. Two parts, each side by side in one run.

  A. Episodes per second through the full HTTP path: a Session-side RolloutPool submits episodes
     of the `arithmetic` environment to 2 rollout service processes on loopback (instant engine:
     no model, so what is timed is astranb's machinery: msgpack bodies, routing, the service's
     episode tasks, long-poll pulls with acknowledgements, deduplication, Trajectory objects).
     Beside it, the same episodes played in this process with the same engine and no HTTP (the
     ceiling), as a ratio. Target: >= 1,000 episodes/s through HTTP.
  B. Weight pulls for a >= 50M-parameter model: a trainer service process (tiny Qwen3, hidden
     1024, 4 layers, ~67M parameters) trains a few AdamW steps on real batches from a rollout
     service; at each version the rollout service pulls from the trainer (notify_version: fetch +
     decode + apply + checksum). Then, for the last version, the trainer's full snapshot and its
     delta are each pulled over HTTP and applied here: bytes and seconds, full vs delta.

    .venv/bin/python bench/services.py            # ~2 minutes on 2 shared cores
    .venv/bin/python bench/services.py --quick    # smaller: a smoke test
"""

from __future__ import annotations

import argparse
import asyncio
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import astranb as ab  # noqa: E402
from astranb.engines.instant import InstantEngine  # noqa: E402
from astranb.environments.base import EpisodeContext  # noqa: E402
from astranb.remote.client import TrainerClient  # noqa: E402
from astranb.services.http import free_port  # noqa: E402
from astranb.weights import codec  # noqa: E402


def start(*args: str) -> tuple[subprocess.Popen, str]:
    port = free_port()
    proc = subprocess.Popen([sys.executable, "-m", "astranb.cli", *args, "--port", str(port)],
                            cwd=ROOT, start_new_session=True, stderr=subprocess.DEVNULL)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        try:
            if httpx.get(f"{url}/health", timeout=1).status_code == 200:
                return proc, url
        except httpx.HTTPError:
            time.sleep(0.2)
    raise TimeoutError(f"{args} did not start")


def stop(*procs: subprocess.Popen) -> None:
    for proc in procs:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()


# -- A. episodes per second ---------------------------------------------------------------------

def episodes_per_second(episodes: int, chunk: int) -> dict[str, float]:
    procs = [start("serve", "rollout", "--engine", "instant", "--max-inflight", "8192")
             for _ in range(2)]
    try:
        with ab.Session(ROOT / "runs" / "bench-services", rollout=[u for _, u in procs]) as session:
            policy = session.policy("solver", ab.models.tiny(), engine="instant")
            env = ab.environments.load("arithmetic")
            session.wire(env, solver=policy)
            http_rate = session._loop().call(_drive_pool, session, env, policy, episodes, chunk)
            accounting = session._pool.accounting()
        local_rate = asyncio.run(_in_process(env, policy, episodes, chunk))
    finally:
        stop(*(p for p, _ in procs))
    assert accounting["lost"] == 0 and accounting["completed"] >= episodes, accounting
    return {"http_eps": http_rate, "in_process_eps": local_rate}


async def _drive_pool(session, env, policy, episodes: int, chunk: int) -> float:
    import anyio

    pool = session._pool
    pool.reset_accounting()
    pool.register_env(env, {"solver": policy})
    samples = iter(env.samples(0))
    async with anyio.create_task_group() as tg:
        tg.start_soon(pool.run)
        await pool.play(env, [(f"{pool.tag}.warm.{i}", next(samples), 0, 0) for i in range(256)])
        started = time.perf_counter()
        done = 0

        async def one_chunk(k: int) -> None:
            nonlocal done
            batch = [(f"{pool.tag}.{k}.{i}", next(samples), k, 0) for i in range(chunk)]
            results = await pool.play(env, batch)
            done += len(results)  # not `done += len(await ...)`: that reads `done` before awaiting

        async with anyio.create_task_group() as chunks:  # several chunks in flight at once
            for k in range(episodes // chunk):
                chunks.start_soon(one_chunk, k)
        seconds = time.perf_counter() - started
        tg.cancel_scope.cancel()
    return done / seconds


async def _in_process(env, policy, episodes: int, chunk: int) -> float:
    tok = policy.tokenizer
    engine = InstantEngine("solver", vocab_size=len(tok), tokenizer=tok)

    class Slot:
        name, tokenizer = "solver", tok

    Slot.engine = engine
    samples = iter(env.samples(0))
    started = time.perf_counter()
    for _ in range(episodes // chunk):
        async def one():
            ctx = EpisodeContext(env, {"solver": Slot})
            return env.rewards_for(await env.episode(ctx, next(samples)))
        await asyncio.gather(*(one() for _ in range(chunk)))
    return (episodes // chunk) * chunk / (time.perf_counter() - started)


# -- B. weight pulls ----------------------------------------------------------------------------

def weight_pulls(hidden: int, layers: int, steps: int) -> dict:
    spec = ab.models.tiny(hidden_size=hidden, num_layers=layers, num_heads=16)
    trainer, t_url = start("serve", "trainer")
    rollout, r_url = start("serve", "rollout", "--engine", "instant")
    rows, pulls = [], []
    try:
        with ab.Session(ROOT / "runs" / "bench-services", rollout=[r_url],
                        trainer=t_url) as session:
            # full_every=0: every version travels as a delta (the rollout service holds v-1)
            policy = session.policy("solver", spec, engine="instant",
                                    optimizer=ab.AdamWConfig(lr=1e-5), full_every=0)
            session.wire(ab.environments.load("arithmetic"), solver=policy)
            held = asyncio.run(_pull(t_url, None))  # version 0, full
            for _ in range(steps):
                run = session.train(steps=1, batch_size=16, group_size=4, max_staleness=0)
                rows.append(run.wait(progress=False).metrics.iloc[-1].to_dict())
                full = asyncio.run(_pull(t_url, None))
                delta = asyncio.run(_pull(t_url, held))
                assert delta["checksum"] == full["checksum"] == policy.weights_checksum
                pulls.append((full, delta))
                held = full
    finally:
        stop(trainer, rollout)
    return {"parameters": ab.models.tiny_parameters(spec.config), "rows": rows, "pulls": pulls}


async def _pull(url: str, held: dict | None) -> dict:
    """Pull the latest version over HTTP as a receiver holding `held` (None: nothing), then
    decode it (full) or apply it to a copy of what is held (delta); checksum-verified."""
    client = TrainerClient(url)
    try:
        started = time.perf_counter()
        if held is None:
            payload = await client.weights("solver")
        else:
            payload = await client.weights("solver", held["version"], held["checksum"])
        fetched = time.perf_counter()
        header = codec.peek(payload)
        if header.kind == "full":
            tensors = codec.decode(None, payload)
        else:
            tensors = {k: v.clone() for k, v in held["tensors"].items()}
            fetched_copy = time.perf_counter()
            codec.apply(tensors, payload, base_checksum=held["checksum"])
            # the copy is the benchmark's, not the codec's
            fetched += time.perf_counter() - fetched_copy
        done = time.perf_counter()
    finally:
        await client.close()
    return {"kind": header.kind, "version": header.version, "checksum": header.checksum,
            "bytes": len(payload), "http_s": fetched - started, "apply_s": done - fetched,
            "changed": header.changed / max(header.elements, 1), "tensors": tensors}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--quick", action="store_true")
    args = parser.parse_args()
    episodes, chunk = (4096, 512) if args.quick else (40_960, 1024)
    hidden, layers, steps = (256, 2, 2) if args.quick else (1024, 4, 3)

    print(f"A. episodes/s, arithmetic, instant engine, {episodes} episodes in chunks of {chunk}")
    a = episodes_per_second(episodes, chunk)
    print(f"   through HTTP (2 rollout services, loopback): {a['http_eps']:8.0f} episodes/s "
          f"(target >= 1000)")
    print(f"   same episodes in this process, no HTTP:      {a['in_process_eps']:8.0f} episodes/s")
    print(f"   ratio HTTP / in-process: {a['http_eps'] / a['in_process_eps']:.2f}")

    print(f"\nB. weight pulls, tiny Qwen3 hidden {hidden} x {layers} layers, AdamW lr 1e-5, "
          f"{steps} steps (trainer and rollout services on loopback)")
    b = weight_pulls(hidden, layers, steps)
    model_bytes = b["parameters"] * 2
    print(f"   {b['parameters']:,} parameters, {model_bytes / 1e6:.1f} MB in bf16")
    print("   version  changed  | full: bytes    http s  decode s | delta: bytes   http s  apply s"
          " | delta/full bytes  seconds | service notify s (kind)")
    for row, (full, delta) in zip(b["rows"], b["pulls"], strict=True):
        f_s, d_s = full["http_s"] + full["apply_s"], delta["http_s"] + delta["apply_s"]
        print(f"   {full['version']:7d}  {delta['changed']:7.2%}  | {full['bytes']:11,d} "
              f"{full['http_s']:7.3f} {full['apply_s']:8.3f} | {delta['bytes']:11,d} "
              f"{delta['http_s']:7.3f} {delta['apply_s']:7.3f} | "
              f"{delta['bytes'] / full['bytes']:16.3f} "
              f"{d_s / f_s:8.2f} | {row['transfer_seconds']:.3f} ({row['transfer_kind']})")


if __name__ == "__main__":
    main()
