"""Entry point of each torchrun process of `astranb serve trainer --nproc N` (N > 1).

Rank 0 serves the trainer app over an FSDPBackend; the other ranks follow its commands
(astranb.training.fsdp.main_worker). The token comes from $ASTRANB_TOKEN, never argv.
"""

from __future__ import annotations

import argparse
import os
import sys

from ..training.fsdp import main_worker
from .http import ServiceConfig
from .server import serve
from .trainer_app import TrainerConfig, create_app


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="astranb-trainer-worker")
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--max-body-mb", type=int, default=1024)
    parser.add_argument("--checkpoint-dir")
    parser.add_argument("--checkpoint-every", type=int, default=1)
    parser.add_argument("--allow-code", action="store_true")
    args = parser.parse_args(argv)
    service = ServiceConfig(args.host, args.port, os.environ.get("ASTRANB_TOKEN") or None,
                            args.max_body_mb << 20)
    config = TrainerConfig(args.checkpoint_dir, args.checkpoint_every, service,
                           allow_code=args.allow_code)
    main_worker(lambda backend: serve(create_app(config, backend), service, "trainer (FSDP)"))
    return 0


if __name__ == "__main__":
    sys.exit(main())
