"""Command line: `astranb serve rollout|trainer ...` (services for remote sessions),
`astranb run NOTEBOOK` (a notebook executed headless, with an HTML export) and
`astranb sweep NOTEBOOK` (the notebook run once per point of a parameter grid; see sweep.py).

    astranb serve rollout --engine hf --port 8100                  # loopback, no token needed
    ASTRANB_TOKEN=s3cret astranb serve rollout --host 0.0.0.0 --port 8100
    astranb serve trainer --nproc 2 --port 8200 --checkpoint-dir ckpt   # FSDP over torchrun
    astranb run notebooks/01_quickstart.ipynb -p steps 50 -o results
    astranb sweep notebooks/01_quickstart.ipynb -p steps 200 400 -p lr 1e-3 3e-3 --jobs 2

The token is read from --token or, better (it stays out of the process list), ASTRANB_TOKEN.
"""

from __future__ import annotations

import argparse
import os
import signal
import subprocess
import sys
from pathlib import Path

from .lifeline import follow_parent
from .papermill_run import cell_label, check_parameters, import_papermill, parse_value

__all__ = ["main"]

INTERRUPTED = "stopped by Ctrl-C"
EXIT_INTERRUPTED = 130  # what a shell reports for a program ended by SIGINT


def main(argv: list[str] | None = None) -> int:
    """Run the `astranb` command line.

    Args:
        argv: arguments without the program name (default: sys.argv[1:]).

    Returns:
        The exit status: 0 on success, 1 when a notebook cell failed, 2 for bad arguments,
        130 when Ctrl-C stopped the notebook.
    """
    parser = argparse.ArgumentParser(prog="astranb", description=__doc__.split("\n")[0])
    commands = parser.add_subparsers(dest="command", required=True)
    _add_run_parser(commands)
    _add_sweep_parser(commands)
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
    rollout.add_argument("--engine", choices=("hf", "sglang", "vllm", "instant"), default="hf")
    rollout.add_argument("--max-inflight", type=int, default=512, help="episodes played at once")
    rollout.add_argument("--environment", action="append", default=[], metavar="NAME=module:Class",
                         help="also allow this environment class (repeatable)")
    rollout.add_argument("--sglang-url", help="attach to a running SGLang server")
    rollout.add_argument("--vllm-url", help="attach to a running vLLM server (see README)")
    rollout.add_argument("--region", default="", metavar="NAME",
                         help="the region this service runs in; the services of one region pull "
                              "each version from the trainer once, through a relay among them")
    rollout.add_argument("--trainer-url", metavar="URL",
                         help="how this service reaches the trainer, when that differs from the "
                              "URL the session uses (a gateway or tunnel between regions)")
    trainer.add_argument("--nproc", type=int, default=1,
                         help="processes (FSDP over torchrun if > 1)")
    trainer.add_argument("--checkpoint-dir",
                         help="checkpoints go here; a restart resumes from them")
    trainer.add_argument("--checkpoint-every", type=int, default=1,
                         help="steps between checkpoints")
    trainer.add_argument("--allow-code", action="store_true",
                         help="import algorithms given by reference (module:qualname): their code "
                              "runs in this service. Without it a user's own loss still trains "
                              "here, computed by the caller (only its gradient is sent)")
    args = parser.parse_args(argv)
    follow_parent()  # a service launched by a notebook ends with it (astranb/lifeline.py)
    try:
        if args.command == "run":
            return _run_notebook(args)
        if args.command == "sweep":
            from .sweep import run_sweep

            return run_sweep(args)
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
                           service_config(args), region=args.region, trainer_url=args.trainer_url,
                           vllm_url=args.vllm_url)
    return serve(create_app(config), config.service, "rollout")


def _serve_trainer(args) -> int:
    config = service_config(args)
    if args.nproc > 1:
        return _torchrun(args)
    from .services.server import serve
    from .services.trainer_app import LocalBackend, TrainerConfig, create_app

    trainer = TrainerConfig(args.checkpoint_dir, args.checkpoint_every, config,
                            allow_code=args.allow_code)
    return serve(create_app(trainer, LocalBackend(args.device)), config, "trainer")


def _torchrun(args) -> int:
    """Start the FSDP trainer: rank 0 serves HTTP, the other ranks follow its commands."""
    from .services.http import free_port

    forwarded = ["--host", args.host, "--port", str(args.port or free_port(args.host)),
                 "--device", args.device, "--max-body-mb", str(args.max_body_mb),
                 "--checkpoint-every", str(args.checkpoint_every)]
    if args.checkpoint_dir:
        forwarded += ["--checkpoint-dir", args.checkpoint_dir]
    if args.allow_code:
        forwarded.append("--allow-code")
    env = dict(os.environ, ASTRANB_TOKEN=args.token or "")  # not on the command line
    command = [sys.executable, "-m", "torch.distributed.run", f"--nproc-per-node={args.nproc}",
               f"--master-port={free_port()}", "-m", "astranb.services.trainer_main", *forwarded]
    return subprocess.call(command, env=env)


# -- astranb run NOTEBOOK ------------------------------------------------------------------------
def _add_run_parser(commands) -> None:
    run = commands.add_parser(
        "run", help="execute a notebook headless (papermill) and export it as HTML",
        description="Execute NOTEBOOK with papermill, overriding values of its `parameters` cell, "
                    "and write the executed notebook and an HTML export of it into OUTDIR.")
    run.add_argument("notebook", metavar="NOTEBOOK", help="the .ipynb file to execute")
    run.add_argument("-p", "--parameter", nargs=2, action="append", default=[],
                     metavar=("NAME", "VALUE"), dest="parameters",
                     help="override a parameter (repeatable); VALUE is read as int, float, "
                          "True/False, None, or else a string")
    run.add_argument("-o", "--output-dir", default="results", metavar="OUTDIR",
                     help="where the executed notebook and its HTML go (default: results/)")
    run.add_argument("--cwd", metavar="DIR",
                     help="working directory of the kernel (default: the notebook's folder, "
                          "as in Jupyter)")
    run.add_argument("--timeout", type=float, metavar="S",
                     help="seconds any one cell may run (default: no limit)")
    run.add_argument("--name", metavar="STEM",
                     help="file names of the outputs: OUTDIR/STEM.ipynb and OUTDIR/STEM.html "
                          "(default: the notebook's name)")


def _add_sweep_parser(commands) -> None:
    sweep = commands.add_parser(
        "sweep", help="execute a notebook once per point of a parameter grid, with one table",
        description="Execute NOTEBOOK for every combination of the -p values (the full grid), "
                    "each point as `astranb run` does, and write one table of the points' "
                    "parameters, outcomes and final numbers (OUTDIR/sweep.csv and "
                    "sweep.parquet). Exit status: 0 when every point ran, 1 when one or more "
                    "failed (the others still run; see the table's error column), 2 for bad "
                    "arguments.")
    sweep.add_argument("notebook", metavar="NOTEBOOK", help="the .ipynb file to execute")
    sweep.add_argument("-p", "--parameter", nargs="+", action="append", default=[],
                       metavar=("NAME", "V"), dest="parameters",
                       help="a parameter and its values: -p NAME V1 V2 ... (repeatable); values "
                            "are read as `astranb run -p` reads them")
    sweep.add_argument("-o", "--output-dir", metavar="OUTDIR",
                       help="where the points' notebooks, HTML, runs and the table go "
                            "(default: sweeps/<notebook>-<date>-<time>)")
    sweep.add_argument("--jobs", type=int, default=1, metavar="N",
                       help="points executed at once, each in its own process (default 1)")
    sweep.add_argument("--resume", action="store_true",
                       help="finish the sweep in OUTDIR: points already done are kept, the "
                            "others (failed, never started) are executed")
    sweep.add_argument("--cwd", metavar="DIR",
                       help="working directory of the kernels (default: the notebook's folder)")
    sweep.add_argument("--timeout", type=float, metavar="S",
                       help="seconds any one cell may run (default: no limit)")


def _run_notebook(args) -> int:
    papermill = import_papermill()
    notebook = Path(args.notebook)
    if not notebook.is_file():
        raise ValueError(f"notebook {str(notebook)!r} not found (looked in {Path.cwd()}); "
                         "give the path to an .ipynb file")
    parameters = {name: parse_value(value) for name, value in args.parameters}
    check_parameters(papermill, notebook, parameters)
    out = Path(args.output_dir)
    stem = args.name or notebook.stem
    executed, exported = out / f"{stem}.ipynb", out / f"{stem}.html"
    if executed.resolve() == notebook.resolve():
        raise ValueError(f"-o {args.output_dir} would overwrite {notebook} itself; "
                         "pick another output folder")
    cwd = Path(args.cwd) if args.cwd else notebook.parent
    if not cwd.is_dir():
        raise ValueError(f"--cwd {args.cwd!r} is not a folder")
    out.mkdir(parents=True, exist_ok=True)
    failure = _execute(papermill, notebook, executed, parameters, cwd, args.timeout)
    if executed.is_file():
        _export_html(executed, exported)
        print(f"executed notebook: {executed}\nHTML export:       {exported}")
    if failure and failure.startswith(INTERRUPTED):
        print(f"astranb: {notebook} {failure}; the executed notebook holds the cells that ran",
              file=sys.stderr)
        return EXIT_INTERRUPTED
    if failure:
        print(f"astranb: {notebook} failed: {failure}", file=sys.stderr)
        return 1
    return 0


def _execute(papermill, notebook: Path, executed: Path, parameters: dict, cwd: Path,
             timeout: float | None) -> str | None:
    """Run the notebook into `executed`; None on success, else what failed (the cell, the error).

    The kernel runs on IPC transport where it can (no warning about unencrypted TCP), and Ctrl-C
    interrupts the running cell and stops the notebook there (see astranb/_kernel.py)."""
    from jupyter_client.kernelspec import NoSuchKernel
    from nbclient.exceptions import CellTimeoutError, DeadKernelError

    from ._kernel import Interrupted, KernelWatch, interrupt_on_ctrl_c, kernel_manager_class

    watch = KernelWatch()
    try:  # absolute paths: papermill saves the output while the kernel's cwd is in effect
        with interrupt_on_ctrl_c(watch):
            papermill.execute_notebook(
                str(notebook.resolve()), str(executed.resolve()), parameters=parameters,
                cwd=str(cwd.resolve()), progress_bar=True, execution_timeout=timeout,
                kernel_manager_class=kernel_manager_class(watch), on_cell_start=watch.before_cell)
    except NoSuchKernel as error:
        raise ValueError(f"{notebook} asks for the Jupyter kernel {error.name!r}, which is not "
                         "installed; install ipykernel in this environment or change the "
                         "notebook's kernel") from None
    except papermill.PapermillExecutionError as error:
        cell = cell_label(error.exec_count, error.source)
        if watch.pressed:
            return f"{INTERRUPTED} in cell {cell}"
        return f"cell {cell} raised {error.ename}: {error.evalue}"
    except Interrupted:
        last = watch.last_cell
        if last is None:
            return f"{INTERRUPTED} before the first cell"
        return f"{INTERRUPTED} after cell {cell_label(last.get('execution_count'), last.source)}"
    except KeyboardInterrupt:  # the second Ctrl-C: papermill was stopped wherever it was
        watch.signal_kernels(signal.SIGKILL)
        return (f"{INTERRUPTED} twice, in cell {_last_started(executed)}: the kernel was "
                "killed (and what it started with it)")
    except CellTimeoutError:
        return f"cell {_last_started(executed)} ran longer than --timeout {timeout:g} s"
    except DeadKernelError as error:
        return f"the kernel died in cell {_last_started(executed)} ({error}); out of memory?"
    if watch.pressed:  # pressed during the last cell, which ended without an error
        return f"{INTERRUPTED} in the last cell"
    return None


def _last_started(executed: Path) -> str:
    """The last cell papermill started, named as `cell_label` does ("?" if unknown)."""
    import nbformat

    try:
        cells = nbformat.read(executed, as_version=4).cells
    except (OSError, ValueError):
        return "?"
    started = [c for c in cells if c.metadata.get("papermill", {}).get("start_time")]
    return cell_label(started[-1].get("execution_count"), started[-1].source) if started else "?"


def _export_html(executed: Path, exported: Path) -> None:
    from nbconvert import HTMLExporter

    body, _ = HTMLExporter().from_filename(str(executed))
    exported.write_text(body, encoding="utf-8")


if __name__ == "__main__":
    sys.exit(main())
