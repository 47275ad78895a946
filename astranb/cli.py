"""Command line: `astranb serve rollout|trainer ...` (services for remote sessions).

    astranb serve rollout --engine hf --port 8100                  # loopback, no token needed
    ASTRANB_TOKEN=s3cret astranb serve rollout --host 0.0.0.0 --port 8100
    astranb serve trainer --nproc 2 --port 8200 --checkpoint-dir ckpt   # FSDP over torchrun

The token is read from --token or, better (it stays out of the process list), ASTRANB_TOKEN.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys

__all__ = ["main"]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="astranb", description=__doc__.split("\n")[0])
    commands = parser.add_subparsers(dest="command", required=True)
    serve = commands.add_parser("serve", help="run a rollout or trainer service")
    kinds = serve.add_subparsers(dest="kind", required=True)
    rollout = kinds.add_parser("rollout", help="play episodes on rollout engines")
    trainer = kinds.add_parser("trainer", help="train policies (FSDP with --nproc > 1)")
    for p in (rollout, trainer):
        p.add_argument("--host", default="127.0.0.1", help="bind address (default loopback)")
        p.add_argument("--port", type=int, default=0, help="TCP port (default: a free one)")
        p.add_argument("--token", default=os.environ.get("ASTRANB_TOKEN"),
                       help="bearer token (default $ASTRANB_TOKEN); required off loopback")
        p.add_argument("--device", default="cpu", help="torch device (cpu, cuda)")
        p.add_argument("--max-body-mb", type=int, default=1024, help="largest request body")
    rollout.add_argument("--engine", choices=("hf", "sglang", "instant"), default="hf")
    rollout.add_argument("--max-inflight", type=int, default=512, help="episodes played at once")
    rollout.add_argument("--environment", action="append", default=[], metavar="NAME=module:Class",
                         help="also allow this environment class (repeatable)")
    rollout.add_argument("--sglang-url", help="attach to a running SGLang server")
    trainer.add_argument("--nproc", type=int, default=1, help="processes (FSDP over torchrun if > 1)")
    trainer.add_argument("--checkpoint-dir", help="checkpoints go here; a restart resumes from them")
    trainer.add_argument("--checkpoint-every", type=int, default=1, help="steps between checkpoints")
    args = parser.parse_args(argv)
    try:
        if args.kind == "rollout":
            return _serve_rollout(args)
        return _serve_trainer(args)
    except ValueError as error:  # bad settings: say what and how to fix, no traceback
        print(f"astranb: error: {error}", file=sys.stderr)
        return 2


def service_config(args):
    from .services.http import ServiceConfig

    return ServiceConfig(args.host, args.port, args.token, args.max_body_mb << 20)


def _serve_rollout(args) -> int:
    from .services.rollout_app import RolloutConfig, create_app
    from .services.server import serve

    envs = {}
    for item in args.environment:
        name, sep, target = item.partition("=")
        if not sep or ":" not in target:
            raise ValueError(f"--environment {item!r}: write NAME=module:Class")
        envs[name] = target
    config = RolloutConfig(args.engine, args.device, args.max_inflight, envs, args.sglang_url,
                           service_config(args))
    return serve(create_app(config), config.service, "rollout")


def _serve_trainer(args) -> int:
    config = service_config(args)
    if args.nproc > 1:
        return _torchrun(args)
    from .services.server import serve
    from .services.trainer_app import LocalBackend, TrainerConfig, create_app

    trainer = TrainerConfig(args.checkpoint_dir, args.checkpoint_every, config)
    return serve(create_app(trainer, LocalBackend(args.device)), config, "trainer")


def _torchrun(args) -> int:
    """Start the FSDP trainer: rank 0 serves HTTP, the other ranks follow its commands."""
    from .services.http import free_port

    forwarded = ["--host", args.host, "--port", str(args.port or free_port(args.host)),
                 "--device", args.device, "--max-body-mb", str(args.max_body_mb),
                 "--checkpoint-every", str(args.checkpoint_every)]
    if args.checkpoint_dir:
        forwarded += ["--checkpoint-dir", args.checkpoint_dir]
    env = dict(os.environ, ASTRANB_TOKEN=args.token or "")  # not on the command line
    command = [sys.executable, "-m", "torch.distributed.run", f"--nproc-per-node={args.nproc}",
               f"--master-port={free_port()}", "-m", "astranb.services.trainer_main", *forwarded]
    return subprocess.call(command, env=env)


if __name__ == "__main__":
    sys.exit(main())
