"""Cells of notebooks/07_environments.ipynb."""

from _cells import Cells

NAME = "07_environments"

cells = Cells()
CELLS = cells.list
md, code = cells.md, cells.code


md("""# The agent environments: code in a sandbox, search, recursive TextCraft, AgentBench

A tour of the four environment packages under `environments/`. Each one is shown the way it
grades (hand-made answers, a scripted player), then wired to a policy and trained for a few
steps with held-out evaluation before and after. The recipe follows the machine: where CUDA is
available the "gpu" recipe (a Qwen3-class chat model, longer runs), elsewhere the "cpu" recipe,
which Run All finishes within 10 minutes on 2 CPU cores. The "cpu" recipe uses the tiny
chat model, whose numbers show the plumbing, not learning: untrained, it scores 0 on nearly
every task, so every group of episodes ties, and with `filter_groups=True` (the GPU recipe's
setting) every group would be dropped and no step taken (the run says so: `run.status` becomes
"stalled", with the reason). The "cpu" recipe trains on them anyway (`filter_groups=False`).
The recipe cell prints the recipe it chose; set `recipe` to choose yourself.""")

code("""# Parameters (papermill can override any of them)
recipe = None  # None: "gpu" where CUDA is available, else "cpu"
#               "gpu": Qwen3-0.6B on a CUDA host; "cpu": the tiny chat model
model = None    # None: the recipe's; a Hugging Face name or directory, or "tiny-chat"
device = None
steps = None
batch_size = None
group_size = 4
filter_groups = None  # drop groups whose rewards are all equal (None: the recipe's)
max_new_tokens = None
eval_n = None
controller = None  # an AgentBench controller ("http://127.0.0.1:5000/api"); None: the fake
agentbench_task = "guess-std"  # with a real controller: "alfworld-std", "webshop-std", ...
run_dir = "../runs/environments"
""", metadata={"tags": ["parameters"]})

code("""import os
import tempfile

import torch

RECIPES = {
    "gpu": dict(model="Qwen/Qwen3-0.6B", device="cuda", steps=100, batch_size=64,
                max_new_tokens=512, eval_n=200, filter_groups=True),
    # the untrained tiny model ties on every group: train on them anyway (see above)
    "cpu": dict(model="tiny-chat", device="cpu", steps=4, batch_size=16, max_new_tokens=48,
                eval_n=32, filter_groups=False),
}
if recipe is None:  # follow the machine
    recipe = "gpu" if torch.cuda.is_available() else "cpu"
    why = "CUDA is available" if recipe == "gpu" else "CUDA is not available"
else:
    why = "chosen by the recipe parameter"
if recipe not in RECIPES:
    raise ValueError(f"recipe must be one of {sorted(RECIPES)}, got {recipe!r}")
print(f"recipe {recipe!r} ({why})")
if os.environ.get("ASTRANB_SMOKE"):  # the test suite runs it small and fast
    recipe, steps, batch_size, group_size, eval_n = "cpu", 1, 4, 2, 4
    run_dir = tempfile.mkdtemp(prefix="astranb-smoke-")
given = dict(model=model, device=device, steps=steps, batch_size=batch_size,
             max_new_tokens=max_new_tokens, eval_n=eval_n, filter_groups=filter_groups)
settings = {**RECIPES[recipe], **{k: v for k, v in given.items() if v is not None}}
globals().update(settings)
settings""")

code("""import astranb as ab

spec = ab.models.tiny_chat() if model == "tiny-chat" else ab.models.hf(model)
session = ab.Session(run_dir, device=device)
sampling = {"max_new_tokens": max_new_tokens}
algorithm = ab.GRPO(filter_groups=filter_groups)


def train_and_evaluate(env, **wiring):
    \"\"\"Held-out avg@1 of the first role before and after `steps` steps of GRPO.\"\"\"
    session.wire(env, **wiring)
    role = env.roles[0]
    before = session.evaluate(env, split="test", n=eval_n)[role].avg_at_k
    session.train(steps=steps, batch_size=batch_size, group_size=group_size,
                  max_staleness=2).wait(progress=False)
    after = session.evaluate(env, split="test", n=eval_n)[role].avg_at_k
    return {"before": before, "after": after}""")

md("""## Code in a sandbox

`Code` asks for a program and runs the task's tests against it in `Sandbox`: a process group of
its own, resource limits, a wall-clock kill, network and PID namespaces where the kernel allows
them, an audit hook. A hostile program ends only its own job:""")

code("""from astranb_code import Code, Limits, Sandbox, synthetic_tasks

sandbox = Sandbox(Limits(wall_seconds=5, cpu_seconds=2))
tests = ["assert add(2, 3) == 5", "assert add(-1, 1) == 0"]
programs = {
    "right": "def add(a, b):\\n    return a + b",
    "partial": "def add(a, b):\\n    return 5",
    "fork bomb": "import os\\nwhile True:\\n    os.fork()",
    "signal the parent": "import os\\nos.kill(os.getppid(), 9)",
}
for name, program in programs.items():
    result = await sandbox.run(program, tests)
    print(f"{name:18s} passed {result.passed}/{result.total}  {result.error or ''}"[:110])
print("isolation:", result.isolation)""")

code("""tasks = synthetic_tasks(400, seed=0)
code_env = Code({"train": tasks[:300], "test": tasks[300:]}, sandbox=sandbox,
                sampling=sampling)
coder = session.policy("coder", spec, algorithm=algorithm)
code_result = train_and_evaluate(code_env, coder=coder)
code_result""")

md("""## Search over a BM25 index

`Search` gives the model `<search>query</search>` (the top passages come back in
`<information>`) and `<answer>…</answer>`, scored by F1. Here the corpus is an invented world
(`facts`); the same environment takes a `datasets` object and a Search-R1 / ASearcher retrieval
server (`HTTPRetriever(url)`).""")

code("""from astranb_search import BM25Retriever, Search, facts

passages, questions = facts(2000, seed=0)
retriever = BM25Retriever(passages)
print(questions[0]["question"], "->", questions[0]["answers"])
for p in await retriever.search(questions[0]["question"], 2):
    print(f"  {p.score:5.2f} {p.text}")
search_env = Search({"train": questions[:1800], "test": questions[1800:]}, retriever, k=2,
                    max_turns=3, sampling=sampling)
searcher = session.policy("searcher", spec, algorithm=algorithm)
search_result = train_and_evaluate(search_env, searcher=searcher)
search_result""")

md("""## Recursive TextCraft

A crafting world generated from a seed. The agent acts with `<action
type="...">{json}</action>`; `spawn` starts sub-agents through `ctx.spawn`, each with its own
conversation, targets and steps, on the shared inventory. A scripted player that knows the
recipes shows an episode with sub-agents; the record shows the tree:""")

code("""from astranb_textcraft import TextCraft, oracle_policy

craft_env = TextCraft(seed=0, spawn=True, targets=2, spare=3, test_tasks=eval_n,
                      sampling=sampling)
oracle = oracle_policy(craft_env.world, spawn=True)  # a "model" that plays the best action
task = next(iter(craft_env.samples()))
trajectory = await ab.play_episode(craft_env, {"crafter": oracle}, task)
print("reward", trajectory.rewards, "turns by agent:",
      {a or "root": sum(t.agent == a for t in trajectory.turns)
       for a in sorted({t.agent for t in trajectory.turns})})
print(ab.Episode.from_trajectory(
    trajectory, tokenizers={"oracle": oracle.tokenizer}).render()[:1500])""")

code("""crafter = session.policy("crafter", spec, algorithm=algorithm)
craft_result = train_and_evaluate(craft_env, crafter=crafter)
craft_result""")

md("""## AgentBench task servers

`AgentBench` drives a task of AgentBench's controller (ALFWorld, WebShop, OS, ...) turn by turn
over its HTTP protocol. Without a `controller`, it talks to the package's stand-in
(`astranb_agentbench.fake`, a number-guessing task with the same protocol).""")

code("""import httpx
from astranb_agentbench import AgentBench
from astranb_agentbench.fake import FakeController

if controller is None:
    fake = FakeController()
    bench_env = AgentBench(agentbench_task, controller="http://fake/api", indices=range(8),
                           test_indices=[8, 9], max_turns=5, sampling=sampling,
                           transport=httpx.ASGITransport(fake.app))
else:
    bench_env = AgentBench(agentbench_task, controller=controller, sampling=sampling)
agent = session.policy("agent", spec, algorithm=algorithm)
bench_result = train_and_evaluate(bench_env, agent=agent)
bench_result""")

md("## Summary")
code("""summary = {"code": code_result, "search": search_result, "textcraft": craft_result,
           "agentbench": bench_result}
session.close()
summary""")

