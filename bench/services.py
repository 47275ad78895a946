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
     decode + apply + checksum). Then, at each version, the trainer's full snapshot and its delta
     are each pulled over HTTP (TrainerClient.weights) and applied here as an engine applies them
     (weights.Mirror: hash check, decode or apply in place, result checksum), 3 times each,
     medians: bytes, fetch and apply seconds. Beside them the loopback bandwidth, measured two
     ways: a raw TCP transfer between two processes (the wire) and a GET of a random body through
     the same HTTP stack (uvicorn, astranb's middleware, the weights route's response, the same
     client). The issue's targets, checked against the raw TCP bandwidth: a delta pull takes
     <= 1.5 x bytes / bandwidth + 50 ms; a delta of <= 10 % of the full bytes is pulled and
     applied >= 5x faster than the full snapshot.

  C. The same pulls for chosen fractions of changed elements (0.2 % to 25 %): the bf16 weights of
     the same model, each chosen element moved by one unit of its bit pattern (what an optimizer
     step below a few ulps does), served through the same HTTP stack from memory, pulled and
     applied with weights.Mirror, 3 times each, medians. It shows where a delta stops paying on
     loopback: its apply costs a few ns per changed element, a full snapshot's a copy. Every
     pull reads ahead as a rollout service does (weights.Incoming: the payload hashed and its
     zstd sections inflated while it arrives); "not ahead" beside it is the same delta without.
     A second table repeats 5-25 % with the sender paced to a 1 Gb/s link (between regions),
     where the transfer is long enough for the read-ahead to hide the inflating.

    .venv/bin/python bench/services.py            # ~3 minutes on 2 shared cores
    .venv/bin/python bench/services.py --quick    # smaller: a smoke test
    .venv/bin/python bench/services.py --part B   # one part only (A, B or C)
"""

from __future__ import annotations

import argparse
import asyncio
import functools
import os
import signal
import socket
import statistics
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
from astranb.weights import Incoming, Mirror  # noqa: E402


def start(*args: str) -> tuple[subprocess.Popen, str]:
    port = free_port()
    proc = subprocess.Popen([sys.executable, "-m", "astranb.cli", *args, "--port", str(port)],
                            cwd=ROOT, start_new_session=True, stderr=subprocess.DEVNULL)
    return proc, _wait_until_up(proc, f"http://127.0.0.1:{port}", args)


def _wait_until_up(proc: subprocess.Popen, url: str, what) -> str:
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline and proc.poll() is None:
        try:
            if httpx.get(f"{url}/health", timeout=1).status_code == 200:
                return url
        except httpx.HTTPError:
            time.sleep(0.2)
    stop(proc)
    raise TimeoutError(f"{what} did not start")


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
            pool = session.context.pool
            http_rate = session.context.call(_drive_pool, pool, env, policy, episodes, chunk)
            accounting = pool.accounting()
        local_rate = asyncio.run(_in_process(env, policy, episodes, chunk))
    finally:
        stop(*(p for p, _ in procs))
    assert accounting["lost"] == 0 and accounting["completed"] >= episodes, accounting
    return {"http_eps": http_rate, "in_process_eps": local_rate}


async def _drive_pool(pool, env, policy, episodes: int, chunk: int) -> float:
    import anyio

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

PULLS = 3  # pulls of each kind per version; medians are reported
SLACK = 0.050  # seconds the issue allows on top of 1.5 x bytes / bandwidth

_RAW_SENDER = """
import os, socket, sys
body = os.urandom(int(sys.argv[1]))
server = socket.create_server(("127.0.0.1", 0))
print(server.getsockname()[1], flush=True)
while True:
    conn, _ = server.accept()
    with conn:
        conn.recv(1)
        conn.sendall(body)
"""

_FILE_SENDER = """
import asyncio, sys, time
from pathlib import Path
import uvicorn
from fastapi import FastAPI, HTTPException
from starlette.responses import Response
from astranb.services.http import ServiceConfig, install, octets
blobs = {p.stem: p.read_bytes() for p in Path(sys.argv[1]).glob("*.bin")}
rate = float(sys.argv[2])  # bytes/s of a slower link, paced in 256 KB slices; 0: loopback's own
app = install(FastAPI(), ServiceConfig())
class Paced(Response):
    async def __call__(self, scope, receive, send):
        await send({"type": "http.response.start", "status": 200, "headers": self.raw_headers})
        view, started = memoryview(self.body), time.perf_counter()
        for at in range(0, len(view), 1 << 18):
            await send({"type": "http.response.body", "body": bytes(view[at:at + (1 << 18)]),
                        "more_body": at + (1 << 18) < len(view)})
            await asyncio.sleep(max(0.0, started + (at + (1 << 18)) / rate - time.perf_counter()))
@app.get("/health")
async def health():
    return {"ok": True}
@app.get("/v1/weights/{name}")
async def blob(name: str):
    if name not in blobs:
        raise HTTPException(404, name)
    if rate:
        return Paced(blobs[name], media_type="application/octet-stream")
    return octets(blobs[name])
uvicorn.run(app, host="127.0.0.1", port=int(sys.argv[3]), log_level="warning", access_log=False)
"""

_HTTP_SENDER = """
import os, sys
import uvicorn
from fastapi import FastAPI
from astranb.services.http import ServiceConfig, install, octets
body = os.urandom(int(sys.argv[1]))
app = install(FastAPI(), ServiceConfig())
@app.get("/health")
async def health():
    return {"ok": True}
@app.get("/v1/weights/{policy}")
async def blob(policy: str):
    return octets(body)  # the trainer's weights route answers with this
uvicorn.run(app, host="127.0.0.1", port=int(sys.argv[2]), log_level="warning", access_log=False)
"""


def loopback_bandwidth(nbytes: int, tries: int = 3) -> dict[str, float]:
    """Bytes per second on loopback, best of `tries`, two ways (see the module's docstring)."""
    sender = subprocess.Popen([sys.executable, "-c", _RAW_SENDER, str(nbytes)],
                              stdout=subprocess.PIPE, text=True, start_new_session=True)
    try:
        port = int(sender.stdout.readline())
        buffer = memoryview(bytearray(nbytes))  # reused: the wire's speed, not page faults
        raw = []
        for _ in range(tries + 1):  # the first one touches the buffer's pages
            with socket.create_connection(("127.0.0.1", port)) as conn:
                started, got = time.perf_counter(), 0
                conn.sendall(b"x")
                while got < nbytes:
                    n = conn.recv_into(buffer[got:])
                    if not n:
                        raise ConnectionError("the raw sender stopped early")
                    got += n
                raw.append(nbytes / (time.perf_counter() - started))
    finally:
        stop(sender)
    http_proc, url = start_script(_HTTP_SENDER, str(nbytes))
    try:
        http = []
        for _ in range(tries):
            seconds = asyncio.run(_fetch_only(url))
            http.append(nbytes / seconds)
    finally:
        stop(http_proc)
    return {"raw": max(raw[1:]), "http": max(http)}


def start_script(script: str, *args: str) -> tuple[subprocess.Popen, str]:
    port = free_port()
    proc = subprocess.Popen([sys.executable, "-c", script, *args, str(port)], cwd=ROOT,
                            start_new_session=True, stderr=subprocess.DEVNULL)
    return proc, _wait_until_up(proc, f"http://127.0.0.1:{port}", script[:40])


async def _fetch_only(url: str) -> float:
    client = TrainerClient(url)
    try:
        started = time.perf_counter()
        await client.weights("blob")
        return time.perf_counter() - started
    finally:
        await client.close()


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
            held = asyncio.run(_pulls(t_url, None))  # version 0, full
            for _ in range(steps):
                run = session.train(steps=1, batch_size=16, group_size=4, max_staleness=0)
                rows.append(run.wait(progress=False).metrics.iloc[-1].to_dict())
                full = asyncio.run(_pulls(t_url, None))
                delta = asyncio.run(_pulls(t_url, held))
                assert delta["kind"] == "delta" and full["kind"] == "full", (delta, full)
                assert delta["checksum"] == full["checksum"] == policy.weights_checksum
                pulls.append((full, delta))
                held = full
    finally:
        stop(trainer, rollout)
    return {"parameters": ab.models.tiny_parameters(spec.config), "rows": rows, "pulls": pulls}


async def _pulls(url: str, held: dict | None, route: str = "solver",
                 policy: str = "solver", ahead: bool = True) -> dict:
    """Pull the latest version PULLS times as a receiver holding `held` (None: nothing) and apply
    it as an engine does (weights.Mirror): a full snapshot decoded, a delta applied in place to a
    copy of what is held (the copy is the benchmark's, not timed). Medians of each time.
    `route` is the name in the weights route (part C's sender serves payloads by file name),
    `policy` the one the payloads are for. `ahead`: hash and inflate the payload as it arrives
    (weights.Incoming), as a rollout service does; its tail (Incoming.finish) counts as apply."""
    client = TrainerClient(url)  # one client, as a Session or a rollout service holds one
    runs = []
    try:
        for _ in range(PULLS):
            mirror = Mirror()
            if held is not None:
                mirror.set(held["tensors"])  # a copy in bf16, and its checksum (not timed)
            incoming = Incoming() if ahead else None
            started = time.perf_counter()
            if held is None:
                payload = await client.weights(route, watch=incoming)
            else:
                payload = await client.weights(route, held["version"], held["checksum"],
                                               watch=incoming)
            fetched = time.perf_counter()
            prepared = None if incoming is None else incoming.finish(payload)
            header = mirror.apply(payload, policy=policy, prepared=prepared)
            done = time.perf_counter()
            assert mirror.checksum == header.checksum
            runs.append((fetched - started, done - fetched, done - started))
            del payload
    finally:
        await client.close()
    fetch_s, apply_s, total_s = (statistics.median(r[i] for r in runs) for i in range(3))
    assert mirror.tensors is not None
    return {"kind": header.kind, "version": header.version, "checksum": header.checksum,
            "bytes": header.total_bytes, "fetch_s": fetch_s, "apply_s": apply_s,
            "total_s": total_s, "changed": header.changed / max(header.elements, 1),
            "tensors": mirror.tensors}


def _bound(nbytes: int, bandwidth: float) -> float:
    return 1.5 * nbytes / bandwidth + SLACK


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--part", choices=["A", "B", "C", "all"], default="all")
    args = parser.parse_args()
    episodes, chunk = (4096, 512) if args.quick else (40_960, 1024)
    hidden, layers, steps = (256, 2, 2) if args.quick else (1024, 4, 3)

    if args.part in ("A", "all"):
        part_a(episodes, chunk)
    if args.part in ("B", "all"):
        part_b(hidden, layers, steps)
    if args.part in ("C", "all"):
        part_c(hidden, layers)


def part_a(episodes: int, chunk: int) -> None:
    print(f"A. episodes/s, arithmetic, instant engine, {episodes} episodes in chunks of {chunk}")
    a = episodes_per_second(episodes, chunk)
    print(f"   through HTTP (2 rollout services, loopback): {a['http_eps']:8.0f} episodes/s "
          f"(target >= 1000)")
    print(f"   same episodes in this process, no HTTP:      {a['in_process_eps']:8.0f} episodes/s")
    print(f"   ratio HTTP / in-process: {a['http_eps'] / a['in_process_eps']:.2f}")


def part_b(hidden: int, layers: int, steps: int) -> None:
    print(f"\nB. weight pulls, tiny Qwen3 hidden {hidden} x {layers} layers, AdamW lr 1e-5, "
          f"{steps} steps (trainer and rollout services on loopback)")
    b = weight_pulls(hidden, layers, steps)
    model_bytes = b["parameters"] * 2
    print(f"   {b['parameters']:,} parameters, {model_bytes / 1e6:.1f} MB in bf16")
    bw = loopback_bandwidth(model_bytes)
    print(f"   loopback bandwidth, {model_bytes / 1e6:.0f} MB, best of 3: raw TCP between two "
          f"processes {bw['raw'] / 1e9:.2f} GB/s (the bound's); GET through the services' HTTP "
          f"stack {bw['http'] / 1e9:.2f} GB/s")
    print(f"   pulls over HTTP and applied as an engine does (weights.Mirror), median of {PULLS}; "
          "bound = 1.5 x bytes / raw bandwidth + 50 ms")
    print("   version  changed | kind         bytes  fetch s  apply s  total s |  bound s"
          "  fetch<=bound  total<=bound")
    for full, delta in b["pulls"]:
        for pull in (delta, full):
            bound = _bound(pull["bytes"], bw["raw"])
            print(f"   {pull['version']:7d}  {delta['changed']:6.2%} | {pull['kind']:5s} "
                  f"{pull['bytes']:12,d} {pull['fetch_s']:8.3f} {pull['apply_s']:8.3f} "
                  f"{pull['total_s']:8.3f} | {bound:8.3f}  "
                  f"{'pass' if pull['fetch_s'] <= bound else 'FAIL':>12s}  "
                  f"{'pass' if pull['total_s'] <= bound else 'FAIL':>12s}")
    print("   version | delta/full bytes | full/delta: fetch  total (target >= 5x when <= 10 %) "
          "| service notify s (kind)")
    for row, (full, delta) in zip(b["rows"], b["pulls"], strict=True):
        fraction = delta["bytes"] / full["bytes"]
        ratio = full["total_s"] / delta["total_s"]
        verdict = ("n/a: delta > 10 %" if fraction > 0.10
                   else "pass" if ratio >= 5 else "FAIL")
        fetch_ratio = full["fetch_s"] / delta["fetch_s"]
        print(f"   {full['version']:7d} | {fraction:16.3f} | {fetch_ratio:17.1f}x {ratio:5.1f}x  "
              f"{verdict:28s} | {row['transfer_seconds']:.3f} ({row['transfer_kind']})")


FRACTIONS = (0.002, 0.01, 0.05, 0.10, 0.15, 0.25)
LINK = 0.125e9  # bytes/s of the paced sender in part C's second table: a 1 Gb/s link


def part_c(hidden: int, layers: int) -> None:
    import tempfile

    import numpy as np
    import torch

    from astranb.weights import checksum, encode, encode_full

    spec = ab.models.tiny(hidden_size=hidden, num_layers=layers, num_heads=16)
    old = {k: v.contiguous() for k, v in spec.build(dtype=torch.bfloat16).state_dict().items()}
    elements = sum(t.numel() for t in old.values())
    print(f"\nC. pulls by fraction changed, tiny Qwen3 hidden {hidden} x {layers} layers "
          f"({elements:,} bf16 elements), one unit of the bit pattern per changed element")
    rng = np.random.default_rng(0)
    with tempfile.TemporaryDirectory() as folder:
        (Path(folder) / "full.bin").write_bytes(encode_full(old))
        names = []
        for i, fraction in enumerate(FRACTIONS):
            new = {}
            for name, t in old.items():
                bits = t.view(torch.int16).numpy().reshape(-1).copy()
                where = rng.random(bits.size) < fraction
                bits[where] += np.where(rng.random(int(where.sum())) < 0.5, 1, -1).astype(np.int16)
                new[name] = torch.from_numpy(bits).view(torch.bfloat16).reshape(t.shape)
            names.append(f"delta{i}")
            (Path(folder) / f"{names[-1]}.bin").write_bytes(encode(old, new))
        held = {"tensors": old, "version": 0, "checksum": checksum(old)}
        for rate, fractions in ((0.0, FRACTIONS), (LINK, FRACTIONS[2:])):
            _part_c_table(folder, held, rate, [(f, names[FRACTIONS.index(f)]) for f in fractions])


def _part_c_table(folder: str, held: dict, rate: float, cases: list[tuple[float, str]]) -> None:
    """Part C's table for one link: loopback as it is (rate 0), or a sender paced to `rate`
    bytes/s. "not ahead": the same delta applied without weights.Incoming's read-ahead."""
    proc, url = start_script(_FILE_SENDER, folder, str(rate))
    try:
        pull = functools.partial(_pulls, url, route="full", policy="")
        # a first full pull, untimed: as in an engine, a Mirror's first full snapshot of a
        # model this size starts loading the compiled delta loops (astranb.weights._kernels)
        asyncio.run(pull(None))
        print("   " + ("loopback" if not rate else f"sender paced to {rate / 1e9:.2f} GB/s "
                                                    f"({rate * 8 / 1e9:.0f} Gb/s link)"))
        print("   changed | delta/full bytes | delta: fetch s  apply s  total s | not ahead: "
              "apply s  total s | full total s | full/delta (target >= 5x when <= 10 % of the "
              "bytes)")
        for fraction, name in cases:
            delta = asyncio.run(_pulls(url, held, route=name, policy=""))
            plain = asyncio.run(_pulls(url, held, route=name, policy="", ahead=False))
            full = asyncio.run(pull(None))  # beside it, at the same moment
            share = delta["bytes"] / full["bytes"]
            ratio = full["total_s"] / delta["total_s"]
            verdict = "n/a: delta > 10 %" if share > 0.10 else "pass" if ratio >= 5 else "FAIL"
            print(f"   {fraction:7.1%} | {share:16.3f} | {delta['fetch_s']:14.3f} "
                  f"{delta['apply_s']:8.3f} {delta['total_s']:8.3f} | "
                  f"{plain['apply_s']:18.3f} {plain['total_s']:8.3f} | {full['total_s']:12.3f}"
                  f" | {ratio:5.1f}x {verdict}")
    finally:
        stop(proc)

if __name__ == "__main__":
    main()
