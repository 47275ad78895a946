"""Cells of notebooks/10_ecosystem.ipynb."""

from _cells import Cells

NAME = "10_ecosystem"

cells = Cells()
CELLS = cells.list
md, code = cells.md, cells.code


md("""# Other libraries' environments, and an agent written against the openai client

Researchers rarely start from astranb's own environments. This notebook trains, for a few steps
each: a reasoning-gym task, a Gymnasium game, a two-policy TextArena match (with its win rates
and Elo), and an agent loop written against the official `openai` client, trained unchanged
through the episode's OpenAI-compatible endpoint. Every section has its own session folder under
`run_dir`. The model is the project's tiny chat model with random weights: the numbers show the
plumbing (episodes played, rewards recorded, steps taken), not learning; for that, give `model`
a local chat model directory on a GPU host. Untrained, nearly every group of episodes ties, so
the runs train on tied groups too (`filter_groups=False`). Run All finishes within 8 minutes
on 2 CPU cores.""")

code("""# Parameters (papermill can override any of them)
steps = 12
batch_size = 16
group_size = 4
model = None  # None: the tiny chat model; or a local chat model's directory
trainer = None  # None: the Session's default; "thread" or "process"
run_dir = "../runs/ecosystem\"""", metadata={"tags": ["parameters"]})

code("""import os
import tempfile

if os.environ.get("ASTRANB_SMOKE"):  # the test suite runs this notebook small and fast
    steps = 2 if steps == 12 else steps
    batch_size = 8 if batch_size == 16 else batch_size
    trainer = trainer or "thread"  # no child process to start for each section
    run_dir = tempfile.mkdtemp(prefix="astranb-smoke-") if run_dir == "../runs/ecosystem" \\
        else run_dir

import astranb as ab

algorithm = ab.GRPO(filter_groups=False, entropy_coef=0.05)


def chat_model(seed=0):
    return ab.models.tiny_chat(seed=seed) if model is None else ab.models.local(model)


def train(folder, wire, **policies):
    \"\"\"A session of its own: make the policies, wire them, train, return the run.\"\"\"
    with ab.Session(f"{run_dir}/{folder}", trainer=trainer) as session:
        made = {name: session.policy(name, chat_model(seed), algorithm=algorithm)
                for name, seed in policies.items()}
        wire(session, **made)
        run = session.train(steps=steps, batch_size=batch_size, group_size=group_size)
        run.wait(progress=False)
    return run""")

md("""## reasoning-gym: any of its tasks, scored by the task's own scorer

`ab.environments.load("reasoning_gym", task=..., size=..., seed=...)` generates the task's entries
locally (no hub), the "test" split from another seed with no question shared with "train". The
reward is the task's `score_answer`, partial credit included, run in a contained worker.""")

code("""gym_task = ab.environments.load("reasoning_gym", task="basic_arithmetic", size=200, seed=0)
run = train("reasoning_gym", lambda s, solver: s.wire(gym_task, solver=solver), solver=0)
run.metrics[["step", "reward", "episodes", "loss"]].tail(3)""")

md("""## Gymnasium: a game whose observations are text

FrozenLake without slipping, rendered as text with the agent's cell marked; the reply names an
action (left, down, right, up), a reply that names none is counted `invalid_action` and told the
allowed names.""")

code("""lake = ab.environments.load("gymnasium", id="FrozenLake-v1",
                            make_kwargs={"is_slippery": False}, max_turns=8)
run = train("gymnasium", lambda s, agent: s.wire(lake, agent=agent), agent=0)
df = run.metrics
print("invalid actions per step:",
      list(df["count/invalid_action"]) if "count/invalid_action" in df else "none")
df[["step", "reward", "episodes"]].tail(3)""")

md("""## TextArena: two policies, each a player; win rates and Elo

Each player is a role. Alice and Bob each take the first seat in one of two seatings (an
untrained first player loses by two invalid moves before the second moves), and one `League`
holds both seatings' Elo. The run's dashboard adds a win-rate and an Elo panel (each policy over
its steps, from the win/draw/loss and Elo counts in its metrics rows), and `standings(run.rows)`
adds up each policy's games the same way.""")

code("""from astranb_textarena import League, standings

league = League()


def seatings(session, alice, bob):
    for first, second in ((alice, bob), (bob, alice)):
        env = ab.environments.load("textarena", game="TicTacToe-v0", league=league)
        session.wire(env, player0=first, player1=second)


run = train("textarena", seatings, alice=0, bob=1)
for name, s in standings(run.rows).items():
    print(f"{name}: {s.games} role-games, win rate {s.win_rate:.2f}, Elo {s.elo:.1f}")
print(league.table())
run.dashboard()  # the win-rate and Elo panels come last""")

md("""## An agent written against the openai client, trained unchanged

The agent below is ordinary OpenAI-client code: it keeps a message list, calls
`chat.completions.create`, appends the answer and asks again. Inside an episode,
`ctx.openai_client(role)` is an `openai.AsyncOpenAI` whose calls reach the role's engine and are
recorded like `ctx.chat`'s: the ids as sampled, their logprobs and versions, and token-in/token-out
kept across the calls (`count/retokenized` stays 0).""")

code("""import random


async def agent(client, question):
    \"\"\"Any agent loop: two turns, the second asking to confirm.\"\"\"
    messages = [{"role": "user", "content": question}]
    for follow_up in ("Are you sure? Answer again with the digit only.", None):
        answer = await client.chat.completions.create(model="agent", messages=messages,
                                                      max_tokens=4, temperature=1.0)
        messages.append({"role": "assistant", "content": answer.choices[0].message.content or ""})
        if follow_up:
            messages.append({"role": "user", "content": follow_up})
    return messages[-1]["content"]


class Sums(ab.Environment):
    roles = ("agent",)
    sampling = ab.SamplingParams(max_new_tokens=4)

    def samples(self, seed=0):
        rng = random.Random(seed)
        while True:
            a, b = rng.randrange(10), rng.randrange(10)
            yield {"question": f"{a}+{b}=", "answer": str((a + b) % 10)}

    async def episode(self, ctx, sample):
        reply = await agent(ctx.openai_client("agent"), sample["question"])
        digits = [c for c in reply if c.isdigit()]
        return float(bool(digits) and digits[0] == sample["answer"])


run = train("openai_agent", lambda s, agent: s.wire(Sums(), agent=agent), agent=0)
df = run.metrics
print("turns tokenized afresh:",
      int(df["count/retokenized"].sum()) if "count/retokenized" in df else 0)
df[["step", "reward", "episodes"]].tail(3)""")
