"""A training loop of a researcher's own, in plain PyTorch: it uses none of astranb's trainer
classes, only `ab.TrainerLink` to get batches and send weights. tests/test_external_trainer.py
runs it as a subprocess (and kills it).

    python tests/external_loop.py <session folder>/external/<policy>.json [lr]

The loss is PPO's clipped surrogate with an entropy bonus, token-mean over the batch, written
here from the batch's tensors (the engine's logprobs, the advantages the session computed).
"""

from __future__ import annotations

import sys

import torch

from astranb import TrainerLink


def loss_of(model: torch.nn.Module, batch, low: float, high: float, entropy_coef: float
            ) -> torch.Tensor:
    logits = model(input_ids=batch.input_ids_B_T,
                   attention_mask=batch.attention_mask_B_T).logits[:, :-1].float()
    logp_all = (logits / batch.temperature_B[:, None, None]).log_softmax(-1)
    logp = logp_all.gather(-1, batch.input_ids_B_T[:, 1:, None])[..., 0]
    mask = batch.loss_mask_B_T[:, 1:].float()  # token t is predicted at position t - 1
    advantages, old = batch.advantages_B_T[:, 1:], batch.old_logp_B_T[:, 1:]
    ratio = (logp - old).exp()
    surrogate = torch.min(ratio * advantages, ratio.clamp(1 - low, 1 + high) * advantages)
    entropy = -(logp_all.exp() * logp_all).sum(-1)
    return -((surrogate + entropy_coef * entropy) * mask).sum() / mask.sum().clamp(min=1)


def main() -> int:
    torch.set_num_threads(1)
    link = TrainerLink.from_file(sys.argv[1])
    lr = float(sys.argv[2]) if len(sys.argv) > 2 else 1e-3
    settings = link.algorithm or {}
    low, high = settings.get("clip_low", 0.2), settings.get("clip_high", 0.2)
    entropy_coef = settings.get("entropy_coef", 0.0)
    model = link.spec.build(dtype=torch.float32)
    model.load_state_dict(link.weights())  # batches(model) would too; the version is printed
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.0)
    print(f"external loop: from version {link.version}", flush=True)
    for batch in link.batches(model):
        loss = loss_of(model, batch, low, high, entropy_coef)
        optimizer.zero_grad()
        loss.backward()
        norm = torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        link.publish(model.state_dict(), metrics={"loss": loss.item(), "grad_norm": float(norm)})
    print(f"external loop: session closed at version {link.version}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
