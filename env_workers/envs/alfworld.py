"""alfworld: the real ALFWorld text engine (alfworld 0.4.2 + textworld 1.7.0) as function calls.

Each sample is one shipped `game.tw-pddl`, played offline as the data README shows (TextWorld's gym
API with ALFWorld's AlfredDemangler and AlfredInfos wrappers). AgentBench's task
(src/server/tasks/alfworld/task.py) sets the rules kept here: the prompt is its instruction, then
"Here is your task. " with the room description (the welcome banner dropped) and the AVAILABLE
ACTIONS; an action is lowercased, stripped and cut at its first line; an observation starting
"You arrive at loc N." loses that clause; the same action three times in a row ends the task as
`agent_invalid_action` (checked after the step, before the win, as upstream); winning ends it with
reward 1. Tool `take_action(action)`, or AgentBench's text form `ACTION: ...`; 20 steps.
Upstream snaps an action that is not admissible to the closest admissible one by BLEU; here it is
played as written and the engine answers "Nothing happened.".

TextWorld is synchronous and slow to start a game (0.7 s to 2 s a reset, mostly translating the PDDL
problem), so every engine call runs in a worker thread (asyncio.to_thread; one at a time per process,
as fast-downward's translator is not thread-safe), and finished sessions
leave their game environment in a per-process pool keyed by game file: the next session of that
game restarts it without loading the file again (about half the cost).

Oracle: the game's walkthrough. No-op: "look", repeated, which the three-repeats rule ends.
"""

from __future__ import annotations

import asyncio
import json
import random
import re
import threading
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from pydantic import BaseModel, ConfigDict

from env_workers.envs.base import (
    EnvSettings,
    Environment,
    Family,
    Opened,
    Outcome,
    Policy,
    Session,
    Status,
    ToolCall,
    assistant_call,
    scripted,
    tool,
)


class AlfworldSettings(BaseModel):
    """The ALFWorld family's limits and its per-process pool of game environments."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    rounds: int = 20
    """AgentRL's ALFWorld: 20 steps (AgentBench's default is 50)."""
    repeat_limit: int = 3
    """AgentBench: the same action three times in a row is a failure (agent invalid action)."""
    pool_size: int = 16
    """Idle game environments kept per process for reuse (no paper default)."""
    simple_seed: int = 7
    """Seed of the simple tier's train/held-out draw (the data README's Random(7) convention)."""
    simple_dev_share: float = 1 / 3
    """Share of each simple game type's shipped games held out in simple-dev (no paper default)."""


GAMES_DIR = "alfworld_games"
SPLIT_DIR = "agentbench/alfworld"
TASK_TYPES = {  # AgentBench's split keys -> ALFWorld's game directory prefixes
    "pick_and_place": "pick_and_place_simple",
    "pick_clean_then_place": "pick_clean_then_place_in_recep",
    "pick_heat_then_place": "pick_heat_then_place_in_recep",
    "pick_cool_then_place": "pick_cool_then_place_in_recep",
    "look_at_obj": "look_at_obj_in_light",
    "pick_two_obj": "pick_two_obj_and_place",
}

INSTRUCTION = (  # AgentBench's get_task_instruction, with its ACTION format replaced by the tool
    "Interact with a household to solve a task. Imagine you are an intelligent agent in a household environment "
    "and your target is to perform actions to complete the task goal. At the beginning of your interactions, you "
    "will be given the detailed description of the current environment and your goal to accomplish. For each of "
    "your turn, you will be given a list of actions which you can choose one to perform in this turn. You should "
    "call take_action with the action you choose. After your each turn, the environment will give you immediate "
    "feedback based on which you plan your next few steps. if the environment output \"Nothing happened\", that "
    "means the previous action is invalid and you should try more options.\n Reminder: \n1. the action must be "
    "chosen from the given available actions. Any actions except provided available actions will be regarded as "
    "illegal. \n2. Try to act directly more in the process.\n3. Repeating the same action three times in a row "
    "ends the task as a failure."
)
TOOLS = [tool("take_action", "Perform one action in the household.",
              {"action": {"type": "string", "description": "One of the available actions, e.g. 'go to desk 1'."}})]
TEXT_ACTION = re.compile(r"ACTION:(.*)")  # AgentBench's process_action pattern


def available_actions(commands: Sequence[str]) -> str:
    """AgentBench's get_available_actions."""
    return " AVAILABLE ACTIONS: " + "\n".join(commands) + "\n"


def clean_observation(text: str) -> str:
    """AgentBench's process_ob: drop a leading "You arrive at loc N." clause."""
    return text[text.find(". ") + 2:] if text.startswith("You arrive at loc ") else text


def clean_action(text: str) -> str:
    """AgentBench's action normalisation: stripped, lowercased, first line only."""
    return text.strip().lower().split("\n")[0]


def repeated(actions: Sequence[str], limit: int) -> bool:
    """The last `limit` actions are one and the same (AgentBench's failure test)."""
    return len(actions) >= limit and len(set(actions[-limit:])) == 1


# --- games ----------------------------------------------------------------------------------------

def _task_type(game: Path) -> str:
    return game.parent.parent.name.split("-")[0]


def _sample(game: Path) -> dict[str, Any]:
    return {"id": f"{game.parent.parent.name}/{game.parent.name}", "game": str(game), "task_type": _task_type(game)}


def load(path: Path) -> list[dict[str, Any]]:
    """A directory of games (every **/game.tw-pddl under it), or an AgentBench split file (its games present
    under the shipped `alfworld_games/` beside `agentbench/`, in the file's order)."""
    if path.is_dir():
        return [_sample(game) for game in sorted(path.rglob("game.tw-pddl"))]
    games_root = path.resolve().parents[2] / GAMES_DIR
    split = json.loads(path.read_text(encoding="utf-8"))
    games = [games_root / relative for paths in split.values() for relative in paths]
    return [_sample(game) for game in games if game.is_file()]


# The easy tier: the two game types of shortest walkthroughs (3 to 6 steps; the others take 4 to 9).
SIMPLE_TYPES = ("pick_and_place_simple", "look_at_obj_in_light")
SIMPLE_SPLITS = ("simple-train", "simple-dev")


def generate(split: str, settings: EnvSettings, alfworld: AlfworldSettings | None = None) -> list[dict[str, Any]]:
    """The simple tier: every shipped game of SIMPLE_TYPES, split per type into train and held-out dev by a
    seeded shuffle (the same in every process), each part in path order."""
    alfworld = alfworld or AlfworldSettings()
    games = load(settings.data_root / GAMES_DIR)
    chosen: list[dict[str, Any]] = []
    for task_type in SIMPLE_TYPES:
        of_type = [g for g in games if g["task_type"] == task_type]
        order = list(range(len(of_type)))
        random.Random(f"alfworld-simple/{alfworld.simple_seed}/{task_type}").shuffle(order)
        held_out = set(order[:round(len(of_type) * alfworld.simple_dev_share)])
        chosen += [g for i, g in enumerate(of_type) if (i in held_out) == (split == "simple-dev")]
    return chosen


class GamePool:
    """Idle TextWorld environments by game file, reused across sessions in this process."""

    def __init__(self, size: int) -> None:
        self.size = size
        self._idle: dict[str, list[Any]] = {}
        self._count = 0
        self._lock = threading.Lock()  # sessions take and return games from worker threads

    def take(self, game: str) -> tuple[Any, bool]:
        """An environment for the game and whether it is new (never loaded)."""
        with self._lock:
            idle = self._idle.get(game)
            if idle:
                self._count -= 1
                return idle.pop(), False
        return _engine(_make_game_env, game), True

    def give(self, game: str, env: Any) -> None:
        with self._lock:
            if self._count < self.size:
                self._idle.setdefault(game, []).append(env)
                self._count += 1
                return
        _engine(env.close)


# One engine call at a time per process: fast-downward's PDDL translator swaps sys.stdout (and sys.argv)
# for the whole process while it runs, and keeps module-level state, so two threads translating at
# once lose stdout and fail. The calls hold the GIL anyway; the thread keeps the event loop free.
_ENGINE_LOCK = threading.Lock()


def _engine(call: Callable[..., Any], *args: Any) -> Any:
    with _ENGINE_LOCK:
        return call(*args)


def _make_game_env(game: str) -> Any:
    """A TextWorld gym environment for one game file, exactly as the data README loads it offline."""
    import textworld
    import textworld.gym
    from alfworld.agents.environment.alfred_tw_env import AlfredDemangler, AlfredInfos

    infos = textworld.EnvInfos(won=True, admissible_commands=True, extras=["gamefile"])
    env_id = textworld.gym.register_games([game], infos, batch_size=1, asynchronous=False, max_episode_steps=1000,
                                          wrappers=[AlfredDemangler(shuffle=False), AlfredInfos])
    return textworld.gym.make(env_id)


def reset_game(env: Any, new: bool) -> tuple[list[str], dict[str, Any]]:
    """Starts the game over. A new environment loads its game file; a reused one (textworld 1.7.0's
    TextworldBatchGymEnv) restarts its loaded game, skipping the reload that the gym reset repeats
    (the PDDL translation, about half of a reset's cost)."""
    if new:
        return env.reset()
    env.last_commands = [None] * env.batch_size
    env.obs, infos = env.batch_env.reset()
    return env.obs, infos


@dataclass
class AlfworldState:
    game: str
    env: Any
    admissible: list[str]
    actions: list[str] = field(default_factory=list)


class AlfworldEnvironment(Environment):
    family = "alfworld"

    def __init__(self, settings: AlfworldSettings) -> None:
        super().__init__(settings.rounds)
        self.settings = settings
        self.pool = GamePool(settings.pool_size)

    async def open(self, sample: Mapping[str, Any]) -> Opened:
        game = sample["game"]
        env, new = await asyncio.to_thread(self.pool.take, game)
        try:
            observations, info = await asyncio.to_thread(_engine, reset_game, env, new)
        except BaseException:
            await asyncio.to_thread(_engine, env.close)
            raise
        admissible = list(info["admissible_commands"][0])
        room = "\n".join(observations[0].split("\n\n")[1:])  # AgentBench drops the welcome banner
        task = "Here is your task. " + room + available_actions(admissible)
        messages = [{"role": "system", "content": INSTRUCTION}, {"role": "user", "content": task}]
        return Opened(messages, TOOLS, AlfworldState(game, env, admissible))

    async def call_tool(self, session: Session, call: ToolCall) -> Outcome:
        return await self._act(session, call.arguments["action"])

    async def on_text(self, session: Session, content: str) -> Outcome | None:
        found = TEXT_ACTION.search(content)
        return None if found is None else await self._act(session, found.group(1))

    async def _act(self, session: Session, raw_action: str) -> Outcome:
        state: AlfworldState = session.state
        action = clean_action(raw_action)
        observations, _, dones, info = await asyncio.to_thread(_engine, state.env.step, [action])
        state.actions.append(action)
        state.admissible = list(info["admissible_commands"][0])
        text = clean_observation(observations[0]) + available_actions(state.admissible)
        if repeated(state.actions, self.settings.repeat_limit):
            return Outcome(text + f"\nThe same action {self.settings.repeat_limit} times in a row: task failed.",
                           Status.AGENT_INVALID_ACTION)
        if info["won"][0]:
            return Outcome(text, Status.COMPLETED, 1.0)
        if dones[0]:
            return Outcome(text, Status.COMPLETED, 0.0)
        return Outcome(text)

    async def close(self, session: Session) -> None:
        state: AlfworldState | None = session.state
        if state is None:
            return
        if session.status == Status.TASK_ERROR:  # the engine failed mid-step: do not hand it to another session
            await asyncio.to_thread(_engine, state.env.close)
        else:
            await asyncio.to_thread(self.pool.give, state.game, state.env)


# --- family ---------------------------------------------------------------------------------------

def make(settings: EnvSettings, alfworld: AlfworldSettings | None = None) -> AlfworldEnvironment:
    return AlfworldEnvironment(alfworld or AlfworldSettings())


def golden(sample: Mapping[str, Any]) -> Policy:
    """Replays the game's walkthrough (every shipped game's walkthrough wins, in 3 to 9 steps)."""
    walkthrough = json.loads(Path(sample["game"]).read_text(encoding="utf-8"))["walkthrough"]
    return scripted([assistant_call("take_action", {"action": a}, f"call_{i}") for i, a in enumerate(walkthrough)])


def noop(sample: Mapping[str, Any]) -> Policy:
    """"look", over and over: AgentBench's three-repeats rule ends it as agent_invalid_action."""
    return scripted([assistant_call("take_action", {"action": "look"})])


FAMILY = Family(
    name="alfworld",
    make=make,
    load=load,
    splits={**{split: (f"{SPLIT_DIR}/{split}.json",) for split in ("dev", "standard", "new_std")},
            **{split: () for split in SIMPLE_SPLITS}},
    golden=golden,
    noop=noop,
    generate=generate,
)
