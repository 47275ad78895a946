"""Benchmark: bit-exact weight deltas (astranb.weights.codec): size vs AstraFlow's format, speed.

Three parts in one run, every payload decoded and checked bit for bit (a wrong decode stops the
run with an error and a non-zero exit status):

  A. Synthetic: one Llama-7B-shaped layer in bf16 (q/k/v/o 4096x4096, gate 11008x4096, two norms;
     112,205,824 elements), old = N(0, 0.02). For each density p, every element is changed with
     probability p independently (positions are a Bernoulli process, so N*H(p)/8 bytes is the
     information bound for the positions), "as optimizer updates do": a random integer in
     +-1..+-4 is added to the bf16 bit pattern. One more row changes 1% to random bit patterns
     (nothing in the values to exploit). AstraFlow's format: 16-byte header + 6 bytes per change.
  B. Real trace: tiny Qwen3 (hidden 768, 6 layers, 12 heads, ~57M parameters) trained with AdamW
     on fp32 master weights (next-token cross-entropy on random tokens, batch 4 x 64) at lr 1e-6
     and 1e-5 from the same init; after each step the bf16 weights are published and the delta
     against the previous step's bf16 weights is encoded and decoded.
  C. Throughput on one core (torch.set_num_threads(1); numpy, xxhash and zstd are single-threaded
     here) on the 1% synthetic case: encode, apply (in place, base checksum precomputed) and
     decode, best of --repeats, in GB/s of model bytes (elements x 2), beside the machine's
     memory-copy speed (np.copyto of 200 MB). A phase profile (cProfile of one call each, plus the
     element-wise primitives timed alone) is printed with the table so a missed target can be
     traced to its phase.

    .venv/bin/python bench/delta.py            # ~2-4 minutes on 2 shared cores
    .venv/bin/python bench/delta.py --quick    # smaller tensors and 4 steps: a smoke test
"""

from __future__ import annotations

import argparse
import cProfile
import functools
import gc
import math
import os
import pstats
import re
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # runnable as a script from a checkout

import numpy as np  # noqa: E402
import torch  # noqa: E402

from astranb.models import tiny  # noqa: E402
from astranb.weights import codec  # noqa: E402

SECTION = "## Weight deltas (bench/delta.py)"

# one decoder layer of a 7B Llama-style model (names and shapes)
LAYER = {
    "input_layernorm.weight": (4096,),
    "mlp.gate_proj.weight": (11008, 4096),
    "post_attention_layernorm.weight": (4096,),
    "self_attn.k_proj.weight": (4096, 4096),
    "self_attn.o_proj.weight": (4096, 4096),
    "self_attn.q_proj.weight": (4096, 4096),
    "self_attn.v_proj.weight": (4096, 4096),
}
QUICK_LAYER = {name: tuple(max(1, d // 4) if len(shape) == 2 else d for d in shape)
               for name, shape in LAYER.items()}
DENSITIES = (0.001, 0.005, 0.01, 0.02, 0.05, 0.10)
TRACE_MODEL = dict(hidden_size=768, num_layers=6, num_heads=12)
TRACE_LRS = (1e-6, 1e-5)

TARGET_VS_ASTRAFLOW = 0.30  # payload / AstraFlow bytes, at 1% density and every trace step
TARGET_VS_BOUND = 1.15  # position bytes / N*H(p)/8, at 1% density
TARGET_GBPS = 1.0  # encode, apply and decode, one core


class BenchFailure(AssertionError):
    """A payload did not decode to the weights it was made from."""


# -- helpers ---------------------------------------------------------------------------------------
def astraflow_bytes(changed: int) -> int:
    """AstraFlow's sparse update: a 16-byte header, then a 4-byte index and a 2-byte value each."""
    return 16 + 6 * changed


def entropy_bound(changed: int, total: int) -> float:
    """N * H(p) / 8 bytes: the least a code for independent positions can average."""
    p = changed / total
    if p <= 0.0 or p >= 1.0:
        return 0.0
    h = -(p * math.log2(p) + (1 - p) * math.log2(1 - p))
    return total * h / 8


def as_views(flat: torch.Tensor, layout: dict[str, tuple[int, ...]]) -> dict[str, torch.Tensor]:
    """Named tensors that are contiguous slices of one flat buffer."""
    out, offset = {}, 0
    for name, shape in layout.items():
        n = math.prod(shape)
        out[name] = flat[offset : offset + n].view(shape)
        offset += n
    return out


def bits16(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.int16) if t.element_size() == 2 else t.view(torch.int32)


def verify(
    got: dict[str, torch.Tensor], want: dict[str, torch.Tensor], want_sum: int, what: str
) -> None:
    """Raise BenchFailure unless `got` equals `want` bit for bit (checksum and raw bits)."""
    if set(got) != set(want):
        raise BenchFailure(f"{what}: decoded names differ from the encoded ones")
    have = codec.checksum(got)
    if have != want_sum:
        raise BenchFailure(f"{what}: decoded checksum {have:#x} != expected {want_sum:#x}")
    for name in want:
        a, b = got[name], want[name]
        if a.dtype != b.dtype or a.shape != b.shape or not torch.equal(bits16(a), bits16(b)):
            raise BenchFailure(f"{what}: tensor {name!r} differs from the encoded weights")


def best_of(repeats: int, fn, setup=None) -> tuple[float, object]:
    """Smallest wall time of `repeats` calls of fn(setup()) (setup outside the timing)."""
    best, result = math.inf, None
    for _ in range(repeats):
        arg = setup() if setup else None
        gc.collect()
        start = time.perf_counter()
        result = fn(arg)
        best = min(best, time.perf_counter() - start)
    return best, result


def fmt_bytes(n: float) -> str:
    for unit, scale in (("GB", 1e9), ("MB", 1e6), ("KB", 1e3)):
        if n >= scale:
            return f"{n / scale:.2f} {unit}"
    return f"{n:.0f} B"


def mark(ok: bool) -> str:
    return "ok" if ok else "MISSED"


# -- A. synthetic ----------------------------------------------------------------------------------
def synthetic_old(layout, seed: int) -> torch.Tensor:
    total = sum(math.prod(s) for s in layout.values())
    gen = torch.Generator().manual_seed(seed)
    return (torch.randn(total, generator=gen) * 0.02).to(torch.bfloat16)


def synthetic_new(
    old_flat: torch.Tensor, p: float, seed: int, random_bits: bool = False
) -> tuple[torch.Tensor, int]:
    """old with each element changed with probability p; returns (new, changed count)."""
    n = old_flat.numel()
    rng = np.random.default_rng(seed)
    # a Bernoulli(p) process: gaps between changes are geometric
    gaps = rng.geometric(p, size=int(n * p + 6 * math.sqrt(n * p) + 64))
    positions = np.cumsum(gaps) - 1
    if positions[-1] < n:
        raise RuntimeError("too few gaps drawn")  # 6 sigma: does not happen
    positions = positions[positions < n]
    new_flat = old_flat.clone()
    bits = new_flat.view(torch.int16).numpy()  # shares memory with new_flat
    if random_bits:
        # xor with a non-zero pattern: uniform over the 65535 patterns other than the old one
        flips = rng.integers(1, 1 << 16, size=positions.size, dtype=np.uint16).view(np.int16)
        bits[positions] ^= flips
    else:
        steps = rng.integers(1, 5, size=positions.size, dtype=np.int16)
        signs = np.where(rng.random(positions.size) < 0.5, -1, 1).astype(np.int16)
        bits[positions] += steps * signs
    return new_flat, int(positions.size)


def run_synthetic(args, layout) -> tuple[str, dict]:
    old_flat = synthetic_old(layout, args.seed)
    old = as_views(old_flat, layout)
    total = old_flat.numel()
    old_sum = codec.checksum(old)
    cases = [(p, False) for p in DENSITIES] + [(0.01, True)]
    rows, at_1pct = [], {}
    for i, (p, random_bits) in enumerate(cases):
        new_flat, changed = synthetic_new(old_flat, p, args.seed + 1 + i, random_bits)
        new = as_views(new_flat, layout)
        new_sum = codec.checksum(new)
        start = time.perf_counter()
        payload = codec.encode(old, new, policy="bench", base_version=0, version=1)
        enc_s = time.perf_counter() - start
        header = codec.peek(payload)
        if header.changed != changed or header.elements != total:
            raise BenchFailure(f"p={p}: header says {header.changed} changes of {header.elements}, "
                               f"made {changed} of {total}")
        what = f"synthetic p={p}{' random bits' if random_bits else ''}"
        verify(codec.decode(old, payload), new, new_sum, what + " decode")
        receiver = as_views(old_flat.clone(), layout)
        codec.apply(receiver, payload, base_checksum=old_sum)
        verify(receiver, new, new_sum, what + " apply")
        del receiver
        ours = len(payload)
        if ours != header.total_bytes:
            raise BenchFailure(f"{what}: payload is {ours} bytes, header says {header.total_bytes}")
        af = astraflow_bytes(changed)
        bound = entropy_bound(changed, total)
        pos, val = header.section_bytes("positions"), header.section_bytes("values")
        row = dict(p=p, random_bits=random_bits, changed=changed, ours=ours,
                   full=header.model_bytes, af=af, pos=pos, bound=bound, val=val, enc_s=enc_s)
        rows.append(row)
        if p == 0.01 and not random_bits:
            at_1pct = row
        del new_flat, new
    lines = [
        f"{len(layout)} bf16 tensors "
        f"({', '.join('x'.join(map(str, s)) for s in layout.values())}), "
        f"N = {total:,} elements, full bf16 = {fmt_bytes(2 * total)}; old = N(0, 0.02); changes at "
        "independent uniform positions, +-1..+-4 added to the bf16 bits (last row: random bit "
        "patterns). Every payload decoded and applied, checked bit for bit.",
        "",
        "| density | changed | ours | full bf16 | AstraFlow | ours/AF | ours/full | positions | "
        "N·H(p)/8 | pos/bound | values | values B/change |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in rows:
        label = f"{r['p'] * 100:g}%" + (" random bits" if r["random_bits"] else "")
        lines.append(
            f"| {label} | {r['changed']:,} | {fmt_bytes(r['ours'])} | {fmt_bytes(r['full'])} | "
            f"{fmt_bytes(r['af'])} | {r['ours'] / r['af']:.3f} | {r['ours'] / r['full']:.4f} | "
            f"{fmt_bytes(r['pos'])} | {fmt_bytes(r['bound'])} | {r['pos'] / r['bound']:.3f} | "
            f"{fmt_bytes(r['val'])} | {r['val'] / r['changed']:.2f} |"
        )
    r = at_1pct
    ok_af = r["ours"] / r["af"] <= TARGET_VS_ASTRAFLOW
    ok_bound = r["pos"] / r["bound"] <= TARGET_VS_BOUND
    lines += [
        "",
        f"- 1% density: ours/AstraFlow = **{r['ours'] / r['af']:.3f}** "
        f"(target <= {TARGET_VS_ASTRAFLOW}: {mark(ok_af)}); positions/bound = "
        f"**{r['pos'] / r['bound']:.3f}** (target <= {TARGET_VS_BOUND}: {mark(ok_bound)})",
    ]
    return "\n".join(lines), dict(old_flat=old_flat, ok=ok_af and ok_bound)


# -- B. real trace ---------------------------------------------------------------------------------
def bf16_weights(model) -> dict[str, torch.Tensor]:
    """The weights as published: the model's state_dict cast to bf16."""
    return {k: v.detach().to(torch.bfloat16) for k, v in model.state_dict().items()}


def run_trace(args) -> tuple[str, bool]:
    torch.set_num_threads(2)
    config = dict(hidden_size=256, num_layers=2, num_heads=4) if args.quick else TRACE_MODEL
    spec = tiny(**config)
    results, n_params, full = {}, 0, 0
    for lr in TRACE_LRS:
        model = spec.build().train()  # fp32 master weights, same init for every lr
        n_params = sum(p.numel() for p in model.parameters())
        vocab = model.config.vocab_size
        opt = torch.optim.AdamW(model.parameters(), lr=lr)
        gen = torch.Generator().manual_seed(args.seed)  # same batches for every lr
        prev = bf16_weights(model)
        steps, train_s, codec_s = [], 0.0, 0.0
        for step in range(1, args.steps + 1):
            start = time.perf_counter()
            batch = torch.randint(3, vocab, (args.batch, args.seq), generator=gen)
            loss = model(input_ids=batch, labels=batch).loss
            loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
            cur = bf16_weights(model)
            train_s += time.perf_counter() - start
            start = time.perf_counter()
            payload = codec.encode(prev, cur, policy="trace", base_version=step - 1, version=step)
            header = codec.peek(payload)
            verify(codec.decode(prev, payload), cur, codec.checksum(cur),
                   f"trace lr={lr:g} step {step}")
            codec_s += time.perf_counter() - start
            full = header.model_bytes
            steps.append(dict(step=step, loss=float(loss.detach()), changed=header.changed,
                              elements=header.elements, ours=len(payload),
                              af=astraflow_bytes(header.changed),
                              pos=header.section_bytes("positions"),
                              val=header.section_bytes("values")))
            prev = cur
        results[lr] = dict(steps=steps, train_s=train_s, codec_s=codec_s)
        del model, opt, prev
        gc.collect()
    elements = results[TRACE_LRS[0]]["steps"][0]["elements"]
    lines = [
        f"tiny({', '.join(f'{k}={v}' for k, v in config.items())}): "
        f"**{n_params:,} parameters** ({elements:,} elements in the bf16 state_dict, which lists "
        f"the tied embedding twice), full bf16 = {fmt_bytes(full)}. AdamW (betas 0.9/0.999, "
        f"weight decay 0.01) on fp32 master weights, batch {args.batch} x {args.seq} random "
        f"tokens, {args.steps} steps per lr, same init and batches; each step's bf16 weights are "
        "delta-encoded against the previous step's and decoded, checked bit for bit.",
        "",
        "| step | "
        + " | ".join(f"lr {lr:g}: changed | ours | AstraFlow | ours/AF" for lr in TRACE_LRS)
        + " |",
        "|---:|" + "---:|---:|---:|---:|" * len(TRACE_LRS),
    ]
    for i in range(args.steps):
        cells = []
        for lr in TRACE_LRS:
            s = results[lr]["steps"][i]
            cells.append(f"{s['changed'] / s['elements'] * 100:.3f}% | {fmt_bytes(s['ours'])} | "
                         f"{fmt_bytes(s['af'])} | {s['ours'] / s['af']:.3f}")
        lines.append(f"| {i + 1} | " + " | ".join(cells) + " |")
    lines.append("")
    all_ok = True
    for lr in TRACE_LRS:
        st = results[lr]["steps"]
        ratios = [s["ours"] / s["af"] for s in st]
        fracs = [s["changed"] / s["elements"] for s in st]
        bounds = [s["pos"] / entropy_bound(s["changed"], s["elements"]) for s in st if s["changed"]]
        vals = [s["val"] / s["changed"] for s in st if s["changed"]]
        ok = all(r <= TARGET_VS_ASTRAFLOW for r in ratios)
        all_ok &= ok
        lines.append(
            f"- lr {lr:g}: changed {min(fracs) * 100:.3f}%..{max(fracs) * 100:.3f}%; "
            f"ours/AstraFlow min **{min(ratios):.3f}**, max **{max(ratios):.3f}** "
            f"(target <= {TARGET_VS_ASTRAFLOW} at every step: {mark(ok)}); "
            f"positions/bound {min(bounds):.3f}..{max(bounds):.3f}; "
            f"values {min(vals):.2f}..{max(vals):.2f} B/change; "
            f"loss {st[0]['loss']:.3f} -> {st[-1]['loss']:.3f}; "
            f"train {results[lr]['train_s']:.1f}s, "
            f"encode+decode+checks {results[lr]['codec_s']:.1f}s"
        )
    return "\n".join(lines), all_ok


# -- C. throughput ---------------------------------------------------------------------------------
def memcpy_gbps(repeats: int) -> float:
    src = np.ones(100_000_000, dtype=np.uint16)  # 200 MB
    dst = np.zeros_like(src)
    seconds, _ = best_of(repeats, lambda _: np.copyto(dst, src))
    return src.nbytes / seconds / 1e9


def profile_call(fn) -> tuple[float, list[tuple[str, float, float]]]:
    """(total seconds, [(function, self seconds, cumulative seconds)] by self time) of one call."""
    prof = cProfile.Profile()
    prof.enable()
    fn()
    prof.disable()
    stats = pstats.Stats(prof)
    rows = []
    for (file, _line, func), (_, _, tottime, cumtime, _) in stats.stats.items():
        if file == "~":  # a C function: "<method 'nonzero' of 'numpy.ndarray' objects>"
            m = re.fullmatch(r"<method '(\w+)' of '([\w.]+)' objects>", func)
            label = f"{m[2]}.{m[1]}" if m else func.replace("<built-in method ", "").rstrip(">")
        else:
            label = f"{Path(file).stem}.{func}"
        rows.append((label, tottime, cumtime))
    rows.sort(key=lambda r: -r[1])
    return stats.total_tt, rows


def primitives(old, new, repeats: int) -> list[tuple[str, float]]:
    """The whole-tensor passes the codec makes, timed alone over all tensors (best of repeats)."""
    ob = {k: v.view(torch.int16).numpy().view(np.uint16) for k, v in old.items()}
    nb = {k: v.view(torch.int16).numpy().view(np.uint16) for k, v in new.items()}
    masks = {k: ob[k] != nb[k] for k in ob}
    timed = [
        ("old_bits != new_bits (all tensors)", lambda _: [ob[k] != nb[k] for k in ob]),
        ("np.flatnonzero(mask) (all tensors)",
         lambda _: [np.flatnonzero(m) for m in masks.values()]),
        ("checksum() of one side (xxh3)", lambda _: codec.checksum(old)),
        ("clone() of every tensor (torch, 1 thread)",
         lambda _: {k: v.clone() for k, v in old.items()}),
    ]
    return [(label, best_of(repeats, fn)[0]) for label, fn in timed]


def run_throughput(args, layout, old_flat: torch.Tensor) -> tuple[str, bool]:
    torch.set_num_threads(1)
    old = as_views(old_flat, layout)
    new_flat, changed = synthetic_new(old_flat, 0.01, args.seed + 1000)
    new = as_views(new_flat, layout)
    model_bytes = 2 * old_flat.numel()
    old_sum, new_sum = codec.checksum(old), codec.checksum(new)
    copy_gbps = memcpy_gbps(args.repeats)

    # as the weight store does: the base checksum is cached from the previous publish
    enc_s, payload = best_of(
        args.repeats, lambda _: codec.encode(old, new, policy="bench", base_checksum=old_sum)
    )
    verify(codec.decode(old, payload), new, new_sum, "throughput payload")

    def fresh_receiver(_=None):
        return as_views(old_flat.clone(), layout)

    receiver_holder = {}

    def do_apply(receiver):
        receiver_holder["r"] = receiver
        return codec.apply(receiver, payload, base_checksum=old_sum)

    app_s, _ = best_of(args.repeats, do_apply, setup=fresh_receiver)
    verify(receiver_holder.pop("r"), new, new_sum, "throughput apply")
    dec_s, decoded = best_of(args.repeats, lambda _: codec.decode(old, payload))
    verify(decoded, new, new_sum, "throughput decode")
    del decoded

    lines = [
        f"1% case (N = {old_flat.numel():,}, {changed:,} changed, "
        f"model bytes {fmt_bytes(model_bytes)}, "
        f"payload {fmt_bytes(len(payload))}), torch.set_num_threads(1), best of {args.repeats}; "
        f"memory copy (np.copyto, 200 MB, best of {args.repeats}): **{copy_gbps:.2f} GB/s**",
        "",
        "| operation | seconds | GB/s of model bytes | / memcpy | target |",
        "|---|---:|---:|---:|---:|",
    ]
    ok_all = True
    results = {}
    for label, secs in (("encode(old, new)", enc_s),
                        ("apply(copy_of_old, payload, base_checksum=...)", app_s),
                        ("decode(old, payload)", dec_s)):
        gbps = model_bytes / secs / 1e9
        ok = gbps >= TARGET_GBPS
        ok_all &= ok
        results[label] = gbps
        lines.append(f"| {label} | {secs:.3f} | {gbps:.2f} | {gbps / copy_gbps:.2f} | "
                     f">= {TARGET_GBPS:g} GB/s {mark(ok)} |")

    if ok_all and not args.profile:
        lines += ["", "All throughput targets met (run with --profile for the phase breakdown)."]
        return "\n".join(lines), ok_all

    lines += ["", "Phase profile (one call each under cProfile, one core; self time = time in the "
              "function itself, not in what it calls):", ""]
    receiver = fresh_receiver()
    calls = (("encode", lambda: codec.encode(old, new, policy="bench", base_checksum=old_sum)),
             ("apply", functools.partial(codec.apply, receiver, payload, base_checksum=old_sum)),
             ("decode", lambda: codec.decode(old, payload)))
    for name, fn in calls:
        total, rows = profile_call(fn)
        lines.append(f"- {name} ({total:.3f}s under the profiler):")
        for label, tottime, cumtime in rows[: args.profile_rows]:
            lines.append(f"  - {label}: self {tottime:.3f}s ({tottime / total * 100:.0f}%), "
                         f"cumulative {cumtime:.3f}s")
    verify(receiver, new, new_sum, "profiled apply")
    del receiver, calls  # free the receiver's copy of the weights
    lines += ["", "Element-wise passes over all tensors, timed alone (best of "
              f"{args.repeats}; {fmt_bytes(model_bytes)} per side):", ""]
    for label, secs in primitives(old, new, args.repeats):
        lines.append(f"  - {label}: {secs:.3f}s")
    return "\n".join(lines), ok_all


# -- main ------------------------------------------------------------------------------------------
def write_results(body: str, command: str, path: Path) -> None:
    """Replace (or append) this benchmark's section of bench/RESULTS.md."""
    section = f"{SECTION}\n\n```\n{command}\n```\n\n{body}\n"
    text = path.read_text() if path.exists() else "# Benchmark results\n"
    if SECTION in text:
        before, _, rest = text.partition(SECTION)
        after = rest[rest.find("\n## ") + 1 :] if "\n## " in rest else ""
        text = before + section + ("\n" + after if after else "")
    else:
        text = text.rstrip("\n") + "\n\n" + section
    path.write_text(text)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true",
                        help="1/16-size tensors, small model, 4 steps")
    parser.add_argument("--steps", type=int, default=None,
                        help="training steps per lr (default 20)")
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--seq", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=3, help="timing repeats (best counts)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--profile", action="store_true",
                        help="print the phase profile even when the throughput targets are met")
    parser.add_argument("--profile-rows", type=int, default=6)
    parser.add_argument("--no-write", action="store_true", help="do not update bench/RESULTS.md")
    args = parser.parse_args()
    if args.steps is None:
        args.steps = 4 if args.quick else 20
    layout = QUICK_LAYER if args.quick else LAYER
    command = " ".join([".venv/bin/python", "bench/delta.py", *sys.argv[1:]])

    load_before = os.getloadavg()
    started = time.perf_counter()
    print("A. synthetic ...", file=sys.stderr, flush=True)
    table_a, info = run_synthetic(args, layout)
    print(table_a + "\n", flush=True)
    print("B. training trace ...", file=sys.stderr, flush=True)
    table_b, ok_b = run_trace(args)
    print(table_b + "\n", flush=True)
    print("C. one-core throughput ...", file=sys.stderr, flush=True)
    table_c, ok_c = run_throughput(args, layout, info["old_flat"])
    print(table_c + "\n", flush=True)
    elapsed = time.perf_counter() - started

    verdict = (f"Targets: synthetic 1% {mark(info['ok'])}, trace every step {mark(ok_b)}, "
               f"throughput {mark(ok_c)}. All decodes bit-exact.")
    body = "\n\n".join([
        "2 shared cores, load average before the run "
        f"{', '.join(f'{x:.2f}' for x in load_before)}; "
        f"whole run {elapsed:.0f}s.",
        "### A. Synthetic bf16 deltas\n\n" + table_a,
        "### B. Real training trace\n\n" + table_b,
        "### C. One-core throughput\n\n" + table_c,
        verdict,
    ])
    print(verdict)
    if not args.no_write:
        write_results(body, command, ROOT / "bench" / "RESULTS.md")


if __name__ == "__main__":
    main()
