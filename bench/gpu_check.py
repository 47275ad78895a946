"""GPU check: astranb's CUDA paths on one machine, end to end, in one JSON report.

Meant for one NVIDIA GPU (H200-class) with no network: every model is built locally with random
weights and nothing is downloaded. A host's own python with CUDA torch will do: what it lacks
of astranb's dependencies comes from `.gpu-wheels/` (`make gpu-wheels` on a networked machine;
bench/gpu_check.sh unpacks it into a scratch folder, see bench/gpu_wheels.py). Each part runs
in a process of its own under its own time limit, so a part that fails, hangs or takes the GPU
down still leaves the other parts' results in the report:

  pytest      `pytest -q tests/gpu`: pass/fail counts and the tail of the output        (75 s)
  engine      HFEngine against transformers' generate() in bf16 on a ~0.41B-parameter Qwen3
              (hidden 1024, 24 layers, 16 heads, 8 kv heads, ffn 3072, 32k vocab): tokens/s of
              both on the same 64 prompts x 128 tokens (sampled, as bench/engine.py does), their
              ratio, and whether greedy outputs agree for the first 16 tokens             (100 s)
  fsdp        one FSDP2 step on NCCL, world size 1, under torchrun, tiny model: loss, grad norm,
              seconds, version 0 -> 1                                                      (45 s)
  quickstart  notebooks/01_quickstart's loop on CUDA (tiny model, arithmetic, GRPO, batch 128,
              group 8, max staleness 2) for 100 steps: steps/s, episodes/s, final reward,
              max staleness                                                                (80 s)
  vllm        engine="vllm" (astranb.engines.vllm) on a real vLLM server, where the host has a
              Python with vLLM: seconds to healthy, tokens/s of 64 prompts x 64 tokens, a full
              then a delta update (their seconds; the server's weights file checksummed against
              the trainer's), later tokens' versions; else skipped                         (130 s)

The report also holds the machine (torch, transformers, CUDA, GPU name and memory, gathered in
a child process of its own, 30 s) and the total seconds. The limits add up to 7.7 minutes (a
killed part gets 5 s more to exit), so the whole check ends within 8. Each part has a status,
"passed", "failed" or "skipped", with a reason unless it passed. Without CUDA the engine part
skips ("no CUDA"), pytest runs but reports "skipped" (its tests skip themselves), and fsdp (on
gloo), quickstart (5 steps on CPU) and vllm (vLLM's CPU build, 8 prompts, where `make vllm` made
.venv-vllm) run as a dry run of their code paths, with a note saying so.

    make gpu-check                                     # writes results/gpu_check.json
    GPU_CHECK_OUT=/tmp/gpu.json make gpu-check         # or: python bench/gpu_check.py --out PATH

The report is printed too; the exit status is 1 when a part failed.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import re
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import replace
from datetime import UTC, datetime
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # runnable as a script from a checkout (and under torchrun)

# 2026-12-04 on an H200: pytest 28 s, engine 55 s, fsdp 23 s, quickstart 29 s
LIMITS_S = {"machine": 30, "pytest": 75, "engine": 100, "fsdp": 45, "quickstart": 80,
            "vllm": 130}
MARGIN_S = 15  # what a part keeps of its limit to stop its own work and report
# Qwen3-0.6B's layer shape with 24 layers and a 32k vocab: 0.41B parameters
ENGINE_MODEL = dict(hidden_size=1024, num_layers=24, num_heads=16, num_key_value_heads=8,
                    intermediate_size=3072, head_dim=128, vocab_size=32768)
PROMPTS, NEW_TOKENS = 64, 128
AGREE_PROMPTS, AGREE_N = 16, 16
# Random-weight logits sit close together, so a bf16 rounding difference between two kernel
# layouts can flip a greedy argmax. A divergence is accepted when, in a third forward pass, the
# two tokens' logits are within NEAR_TIE; a real bug picks tokens far apart (gaps of ~1 and more).
NEAR_TIE = 0.25
QUICKSTART = dict(steps=100, batch_size=128, group_size=8, max_staleness=2)
QUICKSTART_CPU_STEPS = 5


# -- the orchestrator ---------------------------------------------------------------------------

def check(out: Path) -> int:
    """Run every part, write and print the report; returns the exit status."""
    start = time.perf_counter()
    report: dict = {"started": datetime.now(UTC).isoformat(timespec="seconds")}
    report["machine"] = run_part("machine")
    cuda = bool(report["machine"].get("cuda_available"))
    report["parts"] = {}
    for name in ("pytest", "engine", "fsdp", "quickstart", "vllm"):
        if name == "engine" and not cuda:
            part = skipped(report["machine"])
        else:
            part = run_part(name)
        report["parts"][name] = part
        print(f"[gpu-check] {name}: {part['status']} ({part.get('seconds', 0)} s)", flush=True)
    report["total_seconds"] = round(time.perf_counter() - start, 1)
    text = json.dumps(readable(report), indent=1, allow_nan=False)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(text + "\n")
    print(text)
    print(f"[gpu-check] report written to {out}")
    return int(any(p["status"] == "failed" for p in report["parts"].values()))


def skipped(machine: dict) -> dict:
    """The engine part's result where CUDA is missing (or unknown: the machine part failed)."""
    if "torch" not in machine:
        return {"status": "skipped", "reason": "no CUDA known: the machine part failed"}
    build = " (a CPU build of torch)" if "+cpu" in machine["torch"] else ""
    return {"status": "skipped", "reason": f"no CUDA: torch {machine['torch']}{build}"}


def run_part(name: str) -> dict:
    """One part in a child process under its time limit; never raises."""
    limit = LIMITS_S[name]
    with tempfile.TemporaryDirectory(prefix="gpu-check-") as tmp:
        result = Path(tmp) / "result.json"
        command = [sys.executable, __file__, "--part", name, "--result", str(result),
                   "--budget-s", str(limit - MARGIN_S)]
        start = time.perf_counter()
        rc, output = run_bounded(command, limit)
        seconds = round(time.perf_counter() - start, 1)
        if result.exists():
            part = json.loads(result.read_text())
        else:
            why = f"timed out after {limit} s" if rc is None else f"exited with status {rc}"
            part = {"status": "failed", "reason": why, "output_tail": output[-3000:]}
    return {**part, "seconds": seconds, "limit_s": limit}


def run_bounded(command: list[str], timeout: float) -> tuple[int | None, str]:
    """(exit status, or None on timeout; output), ending the whole process group on timeout."""
    path = os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))
    env = {**os.environ, "PYTHONPATH": path, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}
    proc = subprocess.Popen(command, cwd=ROOT, env=env, text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            start_new_session=True)
    try:
        output = proc.communicate(timeout=timeout)[0]
        return proc.returncode, output
    except subprocess.TimeoutExpired:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGTERM)  # torchrun hands it on to its workers
        try:
            return None, proc.communicate(timeout=5)[0]
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)
            return None, proc.communicate()[0]


def readable(value):
    """The report's values with floats cut to 5 significant digits and NaN/inf as null (JSON)."""
    if isinstance(value, dict):
        return {k: readable(v) for k, v in value.items()}
    if isinstance(value, float):
        return float(f"{value:.5g}") if math.isfinite(value) else None
    return value


# -- the parts (each runs in a child process) ---------------------------------------------------

def part_machine(budget_s: float) -> dict:
    import platform

    import torch
    import transformers

    info = {"python": platform.python_version(), "torch": torch.__version__,
            "transformers": transformers.__version__, "cuda_available": torch.cuda.is_available(),
            "cuda": torch.version.cuda, "cpu_count": os.cpu_count()}
    if info["cuda_available"]:
        props = torch.cuda.get_device_properties(0)
        info |= {"gpu": props.name, "gpu_memory_gib": round(props.total_memory / 2**30, 1),
                 "gpu_count": torch.cuda.device_count(),
                 "nccl": str(torch.cuda.nccl.version())}
    return info


def part_pytest(budget_s: float) -> dict:
    import torch

    # addopts cleared: the repo's --nbmake needs a plugin a GPU host may lack (no notebooks here)
    command = [sys.executable, "-m", "pytest", "-q", "-o", "addopts=", "-p", "no:cacheprovider",
               "tests/gpu"]
    try:
        done = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=budget_s)
        rc, output = done.returncode, done.stdout + done.stderr
    except subprocess.TimeoutExpired as stopped:
        rc, output = None, _text(stopped.stdout) + _text(stopped.stderr)
    summary = [line for line in output.splitlines() if re.search(r"\d+ \w+.* in [\d.]+s", line)]
    counts = {"errors" if kind.startswith("error") else kind: int(n)
              for n, kind in re.findall(r"(\d+) (passed|failed|skipped|errors?|xfailed|xpassed)",
                                        summary[-1] if summary else "")}
    part = {"rc": rc, **counts, "output_tail": output[-2000:]}
    if not torch.cuda.is_available():
        return {"status": "skipped", "reason": "no CUDA (the tests in tests/gpu skip themselves)",
                **part}
    if rc is None:
        return {"status": "failed", "reason": f"pytest ran past {budget_s} s", **part}
    if rc != 0 or not counts.get("passed"):
        return {"status": "failed", "reason": f"pytest exited with status {rc}", **part}
    return {"status": "passed", **part}


def _text(output: bytes | str | None) -> str:
    return output.decode(errors="replace") if isinstance(output, bytes) else output or ""


def part_engine(budget_s: float, device: str = "cuda", model: dict | None = None) -> dict:
    """Throughput of HFEngine and generate() on one batch (bench/engine.py's own functions),
    then greedy agreement of the engine (batched) with generate() (one prompt at a time)."""
    import torch
    from engine import make_requests, run_engine, run_generate  # bench/engine.py

    from astranb import models
    from astranb.engines import HFEngine

    spec, dtype = models.tiny(**(model or ENGINE_MODEL)), torch.bfloat16
    vocab = spec.config["vocab_size"]
    requests = make_requests([NEW_TOKENS] * PROMPTS, vocab, seed=0)
    warm = make_requests([8] * PROMPTS, vocab, seed=1)
    greedy = [replace(r, sampling=replace(r.sampling, temperature=0.0, max_new_tokens=AGREE_N))
              for r in requests[:AGREE_PROMPTS]]
    with HFEngine(spec, device=device, dtype=dtype, max_batch_size=PROMPTS) as engine:
        run_engine(engine, warm)
        tokens, engine_s = run_engine(engine, requests)
        engine_greedy = [g.completion_ids for g in engine.generate_many(greedy)]
    reference = spec.build(dtype=dtype, device=device)
    with torch.device(device):  # run_generate builds its input tensors on the default device
        run_generate(reference, warm, PROMPTS)
        generated, generate_s = run_generate(reference, requests, PROMPTS)
    assert generated == tokens
    agreement = greedy_agreement(reference, greedy, engine_greedy)
    figures = {"parameters": sum(p.numel() for p in reference.parameters()), "dtype": "bfloat16",
               "prompts": PROMPTS, "new_tokens": NEW_TOKENS, "engine_tok_s": tokens / engine_s,
               "generate_tok_s": tokens / generate_s, "engine_over_generate": generate_s / engine_s,
               **agreement}
    if agreement["max_divergence_gap"] > NEAR_TIE:
        why = (f"greedy outputs diverge where the two tokens' logits are "
               f"{agreement['max_divergence_gap']:.2f} apart (> {NEAR_TIE}): not bf16 rounding")
        return {"status": "failed", "reason": why, **figures}
    return {"status": "passed", **figures}


def greedy_agreement(model, requests, engine_out) -> dict:
    """Compare the engine's greedy completions with generate()'s, one unpadded prompt at a time.

    Where the two first differ, one forward pass over the common prefix measures how far apart
    the two chosen tokens' logits are (near zero: a bf16 tie flipped; large: a bug).
    """
    import torch
    from transformers import GenerationConfig

    config = GenerationConfig(do_sample=False, max_new_tokens=AGREE_N, min_new_tokens=AGREE_N,
                              pad_token_id=0, eos_token_id=None)
    device = next(model.parameters()).device
    prefixes, gaps = [], [0.0]
    with torch.inference_mode():
        for request, ours in zip(requests, engine_out, strict=True):
            prompt = torch.tensor([request.prompt_ids], device=device)
            out = model.generate(input_ids=prompt, attention_mask=torch.ones_like(prompt),
                                 generation_config=config)
            theirs = out[0, prompt.shape[1]:].tolist()
            pairs = enumerate(zip(ours, theirs, strict=True))
            k = next((i for i, (a, b) in pairs if a != b), AGREE_N)  # common prefix length
            prefixes.append(k)
            if k < AGREE_N:
                ids = torch.tensor([list(request.prompt_ids) + theirs[:k]], device=device)
                logits = model(input_ids=ids).logits[0, -1].float()
                gaps.append(abs(float(logits[ours[k]] - logits[theirs[k]])))
    return {"agree_first_n": AGREE_N, "agree_prompts": len(prefixes),
            "greedy_agree_frac": sum(k == AGREE_N for k in prefixes) / len(prefixes),
            "mean_common_prefix": sum(prefixes) / len(prefixes), "max_divergence_gap": max(gaps)}


def part_fsdp(budget_s: float) -> dict:
    import torch

    cuda = torch.cuda.is_available()
    with tempfile.TemporaryDirectory(prefix="gpu-check-fsdp-") as tmp:
        out = Path(tmp) / "step.json"
        command = [sys.executable, "-m", "torch.distributed.run", "--standalone",
                   "--nproc-per-node", "1", __file__, "--fsdp-worker", str(out)]
        try:
            done = subprocess.run(command, cwd=ROOT, capture_output=True, text=True,
                                  timeout=budget_s)
            output = done.stdout + done.stderr
        except subprocess.TimeoutExpired as stopped:
            output = _text(stopped.stdout) + _text(stopped.stderr)
        if not out.exists():
            return {"status": "failed", "reason": "the torchrun job wrote no result",
                    "output_tail": output[-3000:]}
        step = json.loads(out.read_text())
    ok = step["version"] == 1 and math.isfinite(step["loss"]) and math.isfinite(step["grad_norm"])
    status = {"status": "passed"} if ok else {
        "status": "failed", "reason": "the step left version != 1 or a non-finite loss/grad norm"}
    note = {} if cuda else {"note": "no CUDA: ran on gloo/CPU as a dry run of the code path"}
    return {**status, **note, **step}


def fsdp_worker(out: Path) -> None:
    """One torchrun rank: create a tiny policy, take one step on a fixed batch, write figures."""
    import torch
    import torch.distributed as dist

    import astranb as ab
    from astranb.training.fsdp import main_worker
    from tests.fsdp_worker import make_batch

    def serve(trainer) -> None:
        trainer.create("policy", ab.models.tiny(), ab.GRPO(), ab.AdamWConfig(lr=1e-3))
        batch = make_batch(8, seed=1)
        start = time.perf_counter()
        metrics = trainer.step("policy", batch)  # returns floats: the GPU work is done
        step = {"backend": dist.get_backend(), "world_size": trainer.world_size,
                "loss": metrics["loss"], "grad_norm": metrics["grad_norm"],
                "step_seconds": time.perf_counter() - start, "version": trainer.version("policy")}
        out.write_text(json.dumps(step))

    compute_dtype = torch.bfloat16 if torch.cuda.is_available() else None
    main_worker(serve, timeout_s=60, compute_dtype=compute_dtype)


def part_quickstart(budget_s: float) -> dict:
    deadline = time.monotonic() + budget_s
    import torch

    import astranb as ab

    cuda = torch.cuda.is_available()
    settings = QUICKSTART if cuda else {**QUICKSTART, "steps": QUICKSTART_CPU_STEPS}
    with tempfile.TemporaryDirectory(prefix="gpu-check-qs-") as tmp, \
            ab.Session(tmp, device="cuda" if cuda else "cpu") as session:
        policy = session.policy("solver", model=ab.models.tiny(),
                                algorithm=ab.GRPO(entropy_coef=0.05),
                                optimizer=ab.AdamWConfig(lr=1e-3))
        session.wire(_arithmetic(), solver=policy)
        run = session.train(**settings)
        try:
            run.wait(timeout=max(1.0, deadline - time.monotonic()), progress=False)
        except TimeoutError:
            run.stop()
        summary = run.summary()
    steps, seconds = summary["steps"], summary.get("seconds") or math.nan
    figures = {"device": "cuda" if cuda else "cpu", **settings, "steps_done": steps,
               "run_seconds": seconds, "steps_per_s": steps / seconds,
               "episodes_per_s": summary.get("episodes", 0) / seconds,
               "final_reward": summary.get("reward_last_10pct"),
               "staleness_max": summary.get("staleness_max")}
    note = {} if cuda else {"note": f"no CUDA: {settings['steps']} steps on CPU as a dry run"}
    if steps < settings["steps"]:
        why = f"only {steps} of {settings['steps']} steps within {budget_s} s"
        return {"status": "failed", "reason": why, **note, **figures}
    if figures["staleness_max"] > settings["max_staleness"]:
        return {"status": "failed", "reason": "staleness above max_staleness", **note, **figures}
    return {"status": "passed", **note, **figures}


def _arithmetic():
    """The quickstart's environment: registered by its package, else from this checkout."""
    import astranb as ab

    try:
        return ab.environments.load("arithmetic")
    except ValueError:  # a GPU host's python without the environment packages installed
        sys.path.insert(0, str(ROOT / "environments" / "arithmetic"))
        from astranb_arithmetic import Arithmetic

        return Arithmetic()


def part_vllm(budget_s: float) -> dict:
    """engine="vllm" against a real vLLM server: start-up, tokens/s, a full then a delta update
    (the server's weights file checksummed against the trainer's), later tokens' versions."""
    import torch

    from astranb import models, weights
    from astranb.engines._vllm_server import vllm_python
    from astranb.engines.vllm import VLLMEngine, VLLMError
    from astranb.types import GenerationRequest, SamplingParams, WeightUpdate

    python = vllm_python()
    if python is None:
        return {"status": "skipped", "reason": "no Python with vLLM on this host (`make vllm` "
                "makes one where a registry is reachable; ASTRANB_VLLM_PYTHON names another)"}
    cuda = torch.cuda.is_available()
    device, dtype = ("cuda", "bfloat16") if cuda else ("cpu", "float32")
    spec = models.tiny(num_heads=2, seed=3)  # head_dim 32: vLLM's CPU attention needs >= 32
    prompts, new_tokens = (64, 64) if cuda else (8, 16)
    start = time.perf_counter()
    try:
        engine = VLLMEngine(spec, device=device, dtype=dtype, max_model_len=512,
                            launch_timeout=max(10.0, budget_s - 25))
    except VLLMError as failed:
        return {"status": "failed", "reason": str(failed).splitlines()[0],
                "output_tail": str(failed)[-2000:], "python": python}
    with engine:
        healthy_s = time.perf_counter() - start
        sampling = SamplingParams(max_new_tokens=new_tokens)
        model = spec.build(torch.float32)
        vocab = model.config.vocab_size
        requests = [GenerationRequest(prompt_ids=tuple((7 * i + j) % vocab for j in range(16)),
                                      sampling=sampling) for i in range(prompts)]
        began = time.perf_counter()
        gens = [f.result(timeout=60) for f in [engine.submit(r) for r in requests]]
        generate_s = time.perf_counter() - began
        tokens = sum(len(g.completion_ids) for g in gens)
        w1 = {k: (v.detach() + 0.01).bfloat16() for k, v in model.state_dict().items()}
        w2 = {k: (v.float() * 0.99).bfloat16() for k, v in w1.items()}
        full = engine.update_weights(WeightUpdate("policy", 1, payload=weights.encode_full(
            w1, policy="policy", version=1))).result(60)
        delta = engine.update_weights(WeightUpdate("policy", 2, payload=weights.encode(
            w1, w2, policy="policy", base_version=1, version=2))).result(60)
        after = engine.submit(requests[0]).result(timeout=60)
        figures = {"python": python, "device": device, "dtype": dtype, "healthy_s": healthy_s,
                   "prompts": prompts, "new_tokens": new_tokens,
                   "tokens_per_s": tokens / generate_s, "full_update_s": full["apply_seconds"],
                   "delta_update_s": delta["apply_seconds"],
                   "checksum_equal": engine.published_checksum() == weights.checksum(w2),
                   "versions_after": sorted(set(after.versions))}
    note = {} if cuda else {"note": "no CUDA: vLLM's CPU build as a dry run"}
    if not all(len(g.completion_ids) == len(g.logprobs) == len(g.versions) >= 1 for g in gens):
        return {"status": "failed", "reason": "a generation without tokens, or with tokens "
                "and logprobs or versions of different lengths", **note, **figures}
    if not figures["checksum_equal"] or figures["versions_after"] != [2]:
        return {"status": "failed", "reason": "the server's weights or versions are not the "
                "trainer's after two updates", **note, **figures}
    return {"status": "passed", **note, **figures}


PARTS = {"machine": part_machine, "pytest": part_pytest, "engine": part_engine,
         "fsdp": part_fsdp, "quickstart": part_quickstart, "vllm": part_vllm}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, help="report path (default: $GPU_CHECK_OUT, else "
                        "results/gpu_check.json)")
    parser.add_argument("--part", choices=PARTS, help=argparse.SUPPRESS)
    parser.add_argument("--result", type=Path, help=argparse.SUPPRESS)
    parser.add_argument("--budget-s", type=float, default=60.0, help=argparse.SUPPRESS)
    parser.add_argument("--fsdp-worker", type=Path, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.fsdp_worker:  # internal: one torchrun rank of the fsdp part
        fsdp_worker(args.fsdp_worker)
    elif args.part:  # internal: one part, its result written as JSON for the parent process
        args.result.write_text(json.dumps(PARTS[args.part](args.budget_s)))
    else:
        default = os.environ.get("GPU_CHECK_OUT") or ROOT / "results" / "gpu_check.json"
        sys.exit(check(args.out or Path(default)))


if __name__ == "__main__":
    main()
