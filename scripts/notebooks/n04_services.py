"""Cells of notebooks/04_services.ipynb."""

from nbformat.v4 import new_code_cell, new_markdown_cell

NAME = "04_services"

CELLS = [
    new_markdown_cell(
        "# Services: remote GPU hosts, simulated on one machine\n\n"
        "In a real deployment, rollout services run on GPU hosts (`astranb serve rollout "
        "--engine sglang ...`), the trainer on others (`astranb serve trainer --nproc 8 ...`), "
        "and the notebook connects to them over HTTP. Here the same services run as separate "
        "processes on this machine, on loopback: two rollout services and one trainer service. "
        "The session code is exactly what you would write for real hosts; only the URLs "
        "differ. We train a short run, check that every service holds the trainer's weights "
        "bit for bit, then kill a rollout service in the middle of a run and watch the run "
        "finish on the other one. Run All finishes within 5 minutes on 2 CPU cores."
    ),
    new_code_cell(
        "# Parameters (papermill can override any of them)\n"
        "steps = 100\n"
        "batch_size = 64\n"
        "group_size = 8\n"
        "max_staleness = 2\n"
        "lr = 1e-3\n"
        "rollout_services = 2\n"
        "service_threads = 1  # torch threads per service process\n"
        "kill_one_rollout = True  # demonstrate failover in a second run\n"
        "failover_steps = 20\n"
        'run_dir = "../runs/services"',
        metadata={"tags": ["parameters"]},
    ),
    new_code_cell(
        "import os\nimport tempfile\n\n"
        "if os.environ.get(\"ASTRANB_SMOKE\"):"
            "  # the test suite runs this notebook small and fast\n"
        "    steps, batch_size, failover_steps = 3, 16, 6\n"
        "    run_dir = tempfile.mkdtemp(prefix=\"astranb-smoke-\")"
    ),
    new_markdown_cell(
        "## Start the services\n\n"
        "`launch_local` starts each service as its own process (`astranb serve ...` on "
        "127.0.0.1, a free port each) and waits until they answer `/health`. The last column "
        "shows the command a host would run. They are stopped in the last cell, and also when "
        "this kernel exits, so a failed cell does not leave them running. Each service writes "
        "its log under `run_dir/services/`."
    ),
    new_code_cell(
        "import astranb as ab\n"
        "from astranb.services.local import launch_local\n\n"
        "services = launch_local(rollout=rollout_services, trainer=True,\n"
        '                        log_dir=os.path.join(run_dir, "services"),'
            ' threads=service_threads)\n'
        "services"
    ),
    new_markdown_cell(
        "## Connect a session\n\n"
        "With `rollout=` and `trainer=` the session plays every episode on the rollout services "
        "and trains on the trainer service; this process only orchestrates. Creating the policy "
        "builds its model on every service (each starts from the same bits). `failure_timeout` "
        "is how long a silent rollout service is given before its episodes go to the others."
    ),
    new_code_cell(
        "session = ab.Session(run_dir, rollout=services.rollout_urls,"
            " trainer=services.trainer_url,\n"
        "                     failure_timeout=2.0)\n"
        "policy = session.policy(\n"
        '    "solver",\n'
        "    model=ab.models.tiny(),\n"
        "    algorithm=ab.GRPO(entropy_coef=0.05),\n"
        "    optimizer=ab.AdamWConfig(lr=lr),\n"
        ")\n"
        'session.wire(ab.environments.load("arithmetic"), solver=policy)\n'
        "print(session)\n"
        "print(session.rollout_services)\n"
        "session.wiring"
    ),
    new_markdown_cell(
        "## Train\n\n"
        "After each step the trainer service publishes the new weights; each rollout service "
        "pulls them from the trainer (a delta when it holds exactly the previous version, else a "
        "full snapshot) before it gets more work."
    ),
    new_code_cell(
        "run = session.train(steps=steps, batch_size=batch_size, group_size=group_size,\n"
        "                    max_staleness=max_staleness)\n"
        "await run"
    ),
    new_code_cell(
        'run.metrics[["step", "version", "reward", "staleness_max", "transfer_kind",'
            ' "transfer_bytes",\n'
        '             "rollout_services", "rollout_versions"]].tail()'
    ),
    new_markdown_cell(
        "`run.accounting` keeps the books of every episode sent to a service: each one is "
        "completed, abandoned when the run ended first, or still awaited. `lost` (sent and "
        "never accounted for) and `trained_twice` must be 0."
    ),
    new_code_cell("run.accounting"),
    new_markdown_cell(
        "## Every service holds the trainer's weights\n\n"
        "Each service's `/v1/status` reports the version and checksum (xxh3 of the raw bf16 "
        "bits) of the weights it holds:"
    ),
    new_code_cell(
        "import pandas as pd\n\n"
        "held = pd.DataFrame([\n"
        '    {"service": s.kind, "url": s.url, **s.status()["policies"]["solver"]}\n'
        "    for s in services.all\n"
        ']).set_index("url")[["service", "version", "checksum"]]\n'
        'trainer_held = held[held.service == "trainer"].iloc[0]\n'
        "assert (held.version == trainer_held.version).all(), held\n"
        "assert (held.checksum == trainer_held.checksum).all(), held\n"
        "held"
    ),
    new_markdown_cell(
        "## A rollout service dies in the middle of a run\n\n"
        "A second run; once it has taken two steps, the last rollout service gets `kill -9` "
        "(no clean shutdown, as when a host crashes). Its in-flight episodes are resubmitted "
        "to the other service after `failure_timeout`, results are deduplicated by episode id, "
        "and the run trains on to its last step."
    ),
    new_code_cell(
        "import asyncio\n\n"
        "if kill_one_rollout and len(services.rollout) > 1:\n"
        "    run = session.train(steps=failover_steps, batch_size=batch_size,"
            " group_size=group_size,\n"
        "                        max_staleness=max_staleness)\n"
        "    while len(run.metrics) < 2 and not run.done:\n"
        "        await asyncio.sleep(0.1)\n"
        "    victim = services.rollout[-1]\n"
        "    victim.kill()\n"
        '    print(f"killed {victim.url} after {len(run.metrics)} steps")\n'
        "    await run\n"
        "    books = run.accounting\n"
        '    assert books["lost"] == 0 and books["trained_twice"] == 0, books\n'
        '    assert len(run.metrics) == failover_steps, "the run did not finish its steps"\n'
        "    print(session.rollout_services)\n"
        '    keys = ("failovers", "resubmitted", "duplicates", "lost", "trained_twice")\n'
        "    print({key: books[key] for key in keys})"
    ),
    new_code_cell(
        "if kill_one_rollout and len(services.rollout) > 1:\n"
        '    display(run.metrics[["step", "version", "reward", "staleness_max",'
            ' "rollout_services"]])'
    ),
    new_markdown_cell("## Shut everything down"),
    new_code_cell("session.close()\nservices.close()\nservices"),
]
