"""Cells of notebooks/08_scale_out.ipynb."""

from nbformat.v4 import new_code_cell, new_markdown_cell

NAME = "08_scale_out"

CELLS = [
    new_markdown_cell(
        "# Scale out on a Ray cluster\n\n"
        "`launch_ray` starts the same `astranb serve rollout|trainer` processes as "
        "`04_services`, but asks Ray to place and supervise them: each service gets a "
        "placement group with the CPUs, GPUs and region its spec asks for, and a small actor "
        "that keeps its process running (Ray restarts it on the same node and port if it "
        "dies). That is all Ray does. Episodes, batches and weights never go through Ray: "
        "they flow over astranb's own HTTP wire, between this notebook and the services and "
        "from the trainer to the rollout services, and every service requires a bearer token "
        "(`services.token`).\n\n"
        "On a real cluster you run this notebook on one of its nodes, connect with "
        "`ray_address=\"auto\"` (or the head's `HOST:PORT`) and ask for GPUs, e.g.\n\n"
        "```python\n"
        "rollout=[{\"engine\": \"sglang\", \"gpus\": 1, \"count\": 4, \"region\": \"us\"}],\n"
        "trainer={\"nproc\": 8, \"gpus_per_proc\": 1}\n"
        "```\n\n"
        "Here it starts a small Ray instance on this machine, CPU only: two rollout services "
        "(the `hf` engine) and one trainer service train a tiny model on digit arithmetic, "
        "and we check that at every version each rollout service holds exactly the trainer's "
        "weights. Both rollout services declare the region `lab`: one of them (the relay) "
        "pulls each version from the trainer, the other pulls it from the relay, so a region "
        "far from the trainer sends each version across its link once. Run All finishes "
        "within 6 minutes on 2 CPU cores."
    ),
    new_code_cell(
        "# Parameters (papermill can override any of them)\n"
        "steps = 20\n"
        "batch_size = 32\n"
        "group_size = 8\n"
        "max_staleness = 1\n"
        "lr = 1e-3\n"
        "rollout_services = 2\n"
        "ray_address = None  # None: Ray on this machine; \"auto\" or \"HOST:PORT\": a cluster\n"
        "run_dir = \"../runs/scale_out\"",
        metadata={"tags": ["parameters"]},
    ),
    new_code_cell(
        "import os\nimport tempfile\n\n"
        'if os.environ.get("ASTRANB_SMOKE"):  # the test suite runs this notebook small and fast\n'
        "    steps, batch_size = 6, 16\n"
        "    run_dir = tempfile.mkdtemp(prefix=\"astranb-smoke-\")"
    ),
    new_markdown_cell(
        "## Connect to Ray\n\n"
        "Without an address, `ray.init` starts a Ray instance on this machine. It is sized "
        "for a laptop: 4 logical CPUs (each service takes one), no dashboard, and the workers' "
        "output stays in Ray's logs instead of this notebook. The node offers the custom "
        "resource `region:lab`, which marks it as a node of region `lab` (on a cluster: "
        "`ray start ... --resources '{\"region:us\": 1000}'`). It is shut down in the last "
        "cell."
    ),
    new_code_cell(
        "import ray\n\n"
        "if ray_address is None:\n"
        "    ray.init(num_cpus=4, resources={\"region:lab\": 1000}, include_dashboard=False,\n"
        "             log_to_driver=False)\n"
        "else:\n"
        "    ray.init(address=ray_address, log_to_driver=False)\n"
        "ray.cluster_resources()"
    ),
    new_markdown_cell(
        "## Launch the services\n\n"
        "Each rollout spec starts `count` services; the trainer spec starts one trainer "
        "service with `nproc` processes on one node. Unknown keys, or more CPUs/GPUs than the "
        "cluster has, are refused before anything starts. `launch_ray` returns once every "
        "service answers `/health`; its value lists their URLs, and `services.info()` where "
        "each runs and where its log is."
    ),
    new_code_cell(
        "import pandas as pd\n\n"
        "import astranb as ab\n"
        "from astranb.services import launch_ray\n\n"
        "services = launch_ray(\n"
        "    rollout=[{\"engine\": \"hf\", \"count\": rollout_services, \"region\": \"lab\"}],\n"
        "    trainer={\"nproc\": 1}, timeout=180)\n"
        'display(pd.DataFrame(services.info())[["name", "url", "pid", "starts", "log"]])\n'
        "services"
    ),
    new_markdown_cell(
        "## Train through the services\n\n"
        "The session takes the services' URLs and token, exactly as for hosts started by "
        "hand. The environment is named in the registry (`arithmetic`), so each rollout "
        "service builds its own copy."
    ),
    new_code_cell(
        "session = ab.Session(run_dir, rollout=services.rollout_urls,\n"
        "                     trainer=services.trainer_url, token=services.token)\n"
        "policy = session.policy(\"solver\", model=ab.models.tiny(),\n"
        "                        optimizer=ab.AdamWConfig(lr=lr))\n"
        "session.wire(ab.environments.load(\"arithmetic\"), solver=policy)\n"
        "run = session.train(steps=steps, batch_size=batch_size, group_size=group_size,\n"
        "                    max_staleness=max_staleness)\n"
        "run.wait()\n"
        "run.metrics[[\"step\", \"version\", \"reward\", \"transfer_kind\", \"transfer_bytes\",\n"
        "             \"transfer_bytes_relayed\", \"rollout_checksums\",\n"
        "             \"weights_checksum\"]].tail()"
    ),
    new_markdown_cell(
        "## Every rollout service holds the trainer's weights\n\n"
        "After each step the trainer publishes the new version and every rollout service pulls "
        "it over HTTP. The metrics record, per version, the checksum (xxh3 of the raw bits) "
        "each rollout service reports after the pull (`rollout_checksums`, one per service) "
        "and the trainer's (`weights_checksum`). `run.accounting` keeps the books of every "
        "episode sent to a service: `lost` and `trained_twice` must be 0."
    ),
    new_code_cell(
        "df = run.metrics\n"
        "assert len(df) == steps, f\"{len(df)} of {steps} steps\"\n"
        "for _, row in df.iterrows():\n"
        "    held = row[\"rollout_checksums\"].split(\",\")\n"
        "    assert held == [str(row[\"weights_checksum\"])] * len(services.rollout), row\n"
        "print(f\"{len(df)} versions, {len(services.rollout)} services, \"\n"
        "      \"all checksums equal the trainer's\")\n"
        "books = run.accounting\n"
        "assert books[\"lost\"] == 0 and books[\"trained_twice\"] == 0, books\n"
        "print(f\"lost: {books['lost']}, trained twice: {books['trained_twice']}\")\n"
        "from_trainer = (df[\"transfer_bytes\"] - df[\"transfer_bytes_relayed\"]).sum()\n"
        "print(f\"bytes pulled from the trainer: {from_trainer:,}; from the relay: \"\n"
        "      f\"{df['transfer_bytes_relayed'].sum():,} (relays: {session.relays})\")\n"
        "assert df[\"transfer_bytes_relayed\"].iloc[1:].gt(0).all()"
    ),
    new_markdown_cell(
        "## Shut everything down\n\n"
        "`services.shutdown()` stops every service and frees its placement group (`with "
        "launch_ray(...) as services:` does the same at the end of the block in a script); "
        "`ray.shutdown()` then stops the local Ray instance, or disconnects from the cluster."
    ),
    new_code_cell(
        "session.close()\n"
        "services.shutdown()\n"
        "ray.shutdown()\n"
        "services"
    ),
]
