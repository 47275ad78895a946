"""Cells of notebooks/05_weight_delta.ipynb."""

from nbformat.v4 import new_code_cell, new_markdown_cell

NAME = "05_weight_delta"

CELLS = [
    new_markdown_cell(
        "# Anatomy of a weight delta\n\n"
        "After every train step the trainer publishes its weights in bf16, and every rollout "
        "engine needs them before it samples again. Sending the whole model each time is what "
        "a naive system does. But between two steps most bf16 numbers do not change at all: the "
        "trainer keeps fp32 master weights, and an update smaller than half a bf16 step (ulp) "
        "rounds away when they are published. So astranb sends a **delta**: which elements "
        "changed and their new bits, compressed, checked end to end, and bit-exact.\n\n"
        "This notebook takes a few optimizer steps on a small model, encodes one step's "
        "delta with `astranb.weights`, looks inside it, decodes it, and shows what happens "
        "when it is applied to the wrong weights or arrives damaged. Run All finishes within 3 "
        "minutes on 2 CPU cores."
    ),
    new_code_cell(
        "# Parameters (papermill can override any of them)\n"
        "hidden_size = 256\n"
        "num_layers = 4\n"
        "num_heads = 4\n"
        "lr = 1e-6  # the scale of RL fine-tuning of large models\n"
        "steps = 5\n"
        "batch_size = 16\n"
        "seed = 0",
        metadata={"tags": ["parameters"]},
    ),
    new_code_cell(
        "import os\n\n"
        "if os.environ.get(\"ASTRANB_SMOKE\"):"
            "  # the test suite runs this notebook small and fast\n"
        "    hidden_size, num_layers, steps = 64, 2, 2"
    ),
    new_markdown_cell(
        "## A model and a few optimizer steps\n\n"
        "A tiny Qwen3-architecture model built locally, trained with AdamW on fp32 weights. Any "
        "optimizer step will do to make a delta; here it is a next-token loss on sums such as "
        "`3+4=7` (an RL step of `session.train` publishes its weights the same way). After each "
        "step we keep the bf16 copy a trainer would publish."
    ),
    new_code_cell(
        "import torch\n\n"
        "import astranb as ab\n"
        "from astranb import weights\n\n"
        "torch.manual_seed(seed)\n"
        "spec = ab.models.tiny(hidden_size=hidden_size, num_layers=num_layers,"
            " num_heads=num_heads)\n"
        "tokenizer = spec.tokenizer()\n"
        "model = spec.build().train()  # fp32 master weights\n"
        "optimizer = torch.optim.AdamW(model.parameters(), lr=lr)\n\n\n"
        "def published() -> dict[str, torch.Tensor]:\n"
        '    """The bf16 copy of the weights a trainer publishes."""\n'
        "    state = model.state_dict()\n"
        "    return {name: t.detach().to(torch.bfloat16, copy=True)"
            " for name, t in state.items()}\n\n\n"
        "def sums_batch(n: int) -> torch.Tensor:\n"
        '    """n strings like "3+4=7" as padded token ids."""\n'
        "    a, b = torch.randint(0, 10, (2, n))\n"
        '    rows = [tokenizer.encode(f"{x}+{y}={x + y}")'
            ' for x, y in zip(a.tolist(), b.tolist())]\n'
        "    width = max(map(len, rows))\n"
        "    return torch.tensor([r + [tokenizer.pad_token_id] * (width - len(r))"
            " for r in rows])\n\n\n"
        "snapshots = [published()]  # snapshots[v] = the weights of version v\n"
        "for step in range(steps):\n"
        "    ids = sums_batch(batch_size)\n"
        "    pad = ids == tokenizer.pad_token_id\n"
        "    labels = ids.masked_fill(pad, -100)  # no loss on padding\n"
        "    loss = model(input_ids=ids, attention_mask=(~pad).long(), labels=labels).loss\n"
        "    loss.backward()\n"
        "    optimizer.step()\n"
        "    optimizer.zero_grad(set_to_none=True)\n"
        "    snapshots.append(published())\n\n"
        "parameters = sum(p.numel() for p in model.parameters())\n"
        'print(f"{spec.name}: {parameters:,} parameters, {len(snapshots[0])} tensors; "\n'
        '      f"{steps} steps at lr {lr:g}, last loss {loss.item():.3f}")'
    ),
    new_markdown_cell(
        "## One delta per version\n\n"
        "`weights.encode(old, new)` compares raw bits and encodes what changed; "
        "`weights.encode_full(new)` is a full snapshot in the same frame. For comparison, "
        "AstraFlow's sparse format spends a 4-byte index and a 2-byte value on every change."
    ),
    new_code_cell(
        "import pandas as pd\n\n"
        "full = weights.encode_full(snapshots[-1], policy=\"demo\", version=steps)\n"
        "rows = []\n"
        "for version in range(1, steps + 1):\n"
        "    delta = weights.encode(snapshots[version - 1], snapshots[version], policy=\"demo\",\n"
        "                           base_version=version - 1, version=version)\n"
        "    header = weights.peek(delta)\n"
        "    rows.append({\n"
        '        "version": version,\n'
        '        "changed": header.changed,\n'
        '        "changed_fraction": header.changed / header.elements,\n'
        '        "delta_bytes": len(delta),\n'
        '        "full_bytes": len(full),\n'
        '        "delta/full": len(delta) / len(full),\n'
        '        "astraflow_bytes": 16 + 6 * header.changed,\n'
        "    })\n"
        'pd.DataFrame(rows).set_index("version")'
    ),
    new_markdown_cell(
        "Adam's first update moves every weight by about `lr` (with one gradient seen, "
        "m/√v = ±1); later ones average noisy gradients and are smaller, so the deltas get "
        "sparser.\n\n"
        "## Inside the last delta\n\n"
        "A payload is a small fixed prefix, a compressed JSON header, one or more byte "
        "sections per tensor, and a hash of everything. `weights.peek` checks the frame and "
        "reads the header without decoding any tensor:"
    ),
    new_code_cell(
        "old, new = snapshots[-2], snapshots[-1]\n"
        "payload = weights.encode(old, new, policy=\"demo\", base_version=steps - 1,"
            " version=steps)\n"
        "header = weights.peek(payload)\n"
        "{\n"
        '    "kind": header.kind,\n'
        '    "policy": header.policy,\n'
        '    "base_version": header.base_version,\n'
        '    "version": header.version,\n'
        '    "base_checksum": header.base_checksum,  # xxh3 of the weights it applies to\n'
        '    "checksum": header.checksum,  # xxh3 of the weights it makes\n'
        '    "total_bytes": header.total_bytes,\n'
        '    "tensors": len(header.tensors),\n'
        '    "elements": header.elements,\n'
        '    "changed": header.changed,\n'
        '    "position_bytes": header.section_bytes("positions"),\n'
        '    "value_bytes": header.section_bytes("values"),\n'
        '    "model_bytes": header.model_bytes,\n'
        "}"
    ),
    new_markdown_cell(
        "Each tensor gets whichever scheme is smallest: `same` (nothing changed, no bytes), "
        "`rice` (positions as Rice-coded gaps between changes: two sections, the unary "
        "quotients and the remainders), `bitmap` (one zstd-compressed bit per element, for "
        "dense changes) or `dense` (every value, no positions). Values are the zstd-compressed "
        "difference of new and old bits, or the new bits when those compress better; the last "
        "section of each tensor."
    ),
    new_code_cell(
        "tensors = pd.DataFrame(header.tensors)\n"
        'tensors["elements"] = [int(torch.Size(s).numel()) for s in tensors["shape"]]\n'
        'tensors["changed_fraction"] = tensors["changed"] / tensors["elements"]\n'
        'tensors["name"] = tensors["name"].str.replace("model.layers.", "L", regex=False)\n'
        'columns = ["shape", "scheme", "elements", "changed", "changed_fraction", "positions",'
            ' "values",\n'
        '           "sections"]\n'
        'tensors = tensors.set_index("name")[columns]\n'
        'tensors.style.format({"changed_fraction": "{:.2%}"})'
    ),
    new_code_cell(
        "import matplotlib.pyplot as plt\n\n"
        "fig, ax = plt.subplots(figsize=(7, 0.18 * len(tensors) + 1))\n"
        "ax.barh(tensors.index, 100 * tensors[\"changed_fraction\"], color=\"tab:blue\")\n"
        "ax.invert_yaxis()\n"
        "ax.set_xlabel(\"elements whose bf16 bits changed (%)\")\n"
        "ax.set_title(f\"delta {steps - 1} -> {steps}: changed fraction per tensor\")\n"
        "ax.tick_params(axis=\"y\", labelsize=7)\n"
        "fig.tight_layout()\n"
        "plt.show()"
    ),
    new_markdown_cell(
        "Norm weights sit near 1.0, where a bf16 step is 2⁻⁷ ≈ 0.008: a small update never "
        "moves them. Projection weights are small numbers with small steps, so some of them "
        "do move. (`lm_head` and `embed_tokens` are one tied tensor that the state dict lists "
        "twice.)\n\n"
        "## Decode: bit for bit\n\n"
        "`decode(old, payload)` checks the frame hash, checks that `old` is the base the delta "
        "was made for (its checksum), rebuilds the new tensors and checks their checksum. We "
        "check again here, on raw bits (NaN payloads and the sign of zero included) for every "
        "tensor:"
    ),
    new_code_cell(
        "decoded = weights.decode(old, payload)\n"
        "bits = {2: torch.int16, 4: torch.int32}\n"
        "assert decoded.keys() == new.keys()\n"
        "for name, tensor in new.items():\n"
        "    same_bits = torch.equal(decoded[name].view(bits[tensor.element_size()]),\n"
        "                            tensor.view(bits[tensor.element_size()]))\n"
        "    assert same_bits and decoded[name].dtype == tensor.dtype, name\n"
        "assert weights.checksum(decoded) == weights.checksum(new) == header.checksum\n"
        'print(f"all {len(new)} tensors equal bit for bit; checksum {header.checksum}")'
    ),
    new_markdown_cell(
        "## When a delta cannot apply\n\n"
        "A trainer's `WeightStore` keeps the latest version and the delta from the one before. "
        "A receiver asks with the version and checksum it holds: exactly the previous version "
        "gets the delta, anything else a full snapshot. A receiver (`weights.Mirror`, what "
        "engines hold) that fails to apply a payload asks again for a full snapshot; `receive` "
        "below does what a rollout service does:"
    ),
    new_code_cell(
        "from astranb.weights.store import WeightStore\n\n"
        "store = WeightStore(\"demo\", full_every=0)  # 0: no forced periodic full snapshots\n"
        "store.publish(steps - 1, old)\n"
        "store.publish(steps, new)\n\n\n"
        "def receive(mirror, have_version, have_checksum=None, damage=None) -> str:\n"
        '    """Bring a receiver to the store\'s version; on any failure,'
            ' fall back to a full snapshot."""\n'
        "    claimed = mirror.checksum if have_checksum is None else have_checksum\n"
        "    payload = store.pull(have_version, claimed)\n"
        "    if damage is not None:\n"
        "        payload = damage(payload)  # what the network did to it\n"
        "    try:\n"
        "        mirror.apply(payload)\n"
        '        return f"{weights.peek(payload).kind} ({len(payload):,} bytes)"\n'
        "    except weights.WeightTransferError as error:\n"
        '        print(f"  {type(error).__name__}: {error}")\n'
        "        full = store.pull_full()\n"
        "        mirror.apply(full)\n"
        '        return f"full snapshot after the failure ({len(full):,} bytes)"\n\n\n'
        "good = weights.Mirror()\n"
        "good.set(old)  # holds the previous version exactly\n"
        'print("up-to-date receiver got a", receive(good, steps - 1))\n'
        "assert good.checksum == store.checksum"
    ),
    new_markdown_cell(
        "**Wrong base.** This receiver holds weights that differ from the previous version in "
        "one element (it missed something). Asking with its own checksum, it gets a full "
        "snapshot straight away. If it claims the right base anyway (stale bookkeeping, or a "
        "delta pushed to it), the delta checks the base's checksum, refuses before writing "
        "anything, and the receiver falls back to a full snapshot:"
    ),
    new_code_cell(
        "drifted = {name: t.clone() for name, t in old.items()}\n"
        "first = next(iter(drifted))\n"
        "drifted[first].view(-1)[0] += 1\n"
        "wrong = weights.Mirror()\n"
        "wrong.set(drifted)\n"
        'print("asking with its own checksum:",'
            ' weights.peek(store.pull(steps - 1, wrong.checksum)).kind)\n'
        'print("claiming the right base:")\n'
        'print("  ->", receive(wrong, steps - 1, have_checksum=header.base_checksum))\n'
        "assert wrong.checksum == store.checksum"
    ),
    new_markdown_cell(
        "**Corrupted payload.** One flipped bit anywhere fails the frame's hash before anything "
        "is decoded, and a truncated payload fails its length check; again the receiver falls "
        "back to a full snapshot:"
    ),
    new_code_cell(
        "def flip_one_bit(payload: bytes) -> bytes:\n"
        "    damaged = bytearray(payload)\n"
        "    damaged[len(damaged) // 2] ^= 0x01\n"
        "    return bytes(damaged)\n\n\n"
        "for label, damage in ((\"one bit flipped\", flip_one_bit),"
            " (\"truncated\", lambda p: p[:-100])):\n"
        "    receiver = weights.Mirror()\n"
        "    receiver.set(old)\n"
        '    print(f"{label}:")\n'
        '    print("  ->", receive(receiver, steps - 1, damage=damage))\n'
        "    assert receiver.checksum == store.checksum"
    ),
    new_markdown_cell(
        "A weight payload therefore never leaves wrong weights behind silently: it applies "
        "bit for bit, or it fails with an error that says why, and a full snapshot replaces "
        "it. In a run these numbers appear per version in `run.metrics` (`changed_fraction`, "
        "`transfer_bytes`, `transfer_ratio`, `transfer_kind`); `bench/delta.py` measures the "
        "codec on larger models."
    ),
]
