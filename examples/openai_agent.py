"""A tool-using agent written with nothing but the official `openai` client, trained by rollstream through
`rollstream proxy` (the protocol: env_workers/proxy.py; ARCHITECTURE.md "The recording proxy").

The agent's loop is its own: it asks the model, runs the tool calls it gets back in the environment, appends
the results and asks again, until the environment says the task is done. rollstream sees only the
chat-completions calls and, at the end, the reward. The environment is used through its Python API
(env_workers/envs/base.py: start -> prompt and tools, observation -> tool results and reward, end), as any
outside environment would be through its own.

    rollstream proxy --run r1 --port 8300 &
    python examples/openai_agent.py --proxy http://127.0.0.1:8300 --task calc --split dev --samples 0 1 --group-size 2

Prints one JSON line per episode (its id, status, reward, turns).
"""

from __future__ import annotations

import argparse
import asyncio
import json
from typing import Any

import openai
from openai import AsyncOpenAI

from env_workers.envs import registry
from env_workers.envs.base import EnvSettings


async def run_episode(proxy: AsyncOpenAI, task: str, split: str, sample_index: int, member: int, group_size: int,
                      *, max_turns: int, max_tokens: int, settings: EnvSettings) -> dict[str, Any]:
    """One episode: opened on the proxy, rolled out by the agent's own loop, ended with the environment's reward.
    `proxy` is a client of the proxy's root, used for its two episode routes (the client's generic `post`)."""
    opened = await proxy.post("/episodes", cast_to=object, body={
        "task": task, "split": split, "sample_index": sample_index, "member": member, "group_size": group_size})
    root = str(proxy.base_url).rstrip("/")
    model = AsyncOpenAI(base_url=f"{root}{opened['base_path']}", api_key="unused", max_retries=0, timeout=proxy.timeout)
    env = registry.environment(task, settings)
    session = await env.start(registry.sample(task, split, sample_index, settings))
    messages: list[dict[str, Any]] = list(session.messages)
    end: dict[str, Any] = {"reward": 0.0, "status": "task_limit_reached"}
    try:
        for _ in range(max_turns):
            try:
                reply = await model.chat.completions.create(model="policy", messages=messages, tools=session.tools,
                                                            max_tokens=max_tokens)
            except openai.BadRequestError as error:  # the proxy's turn or context limit: the episode is over
                end = {"reward": 0.0, "status": "agent_context_limit" if "context" in str(error) else "task_limit_reached"}
                break
            assistant = reply.choices[0].message.model_dump(exclude_none=True)
            messages.append(assistant)
            observation = await env.observation(session, assistant)
            if observation.finish:
                end = {"reward": observation.reward, "status": str(observation.status),
                       "metrics": dict(observation.metrics)}
                break
            messages.extend(observation.messages)
    finally:
        await env.end(session)
    result = await proxy.post(f"/episodes/{opened['episode_id']}/end", cast_to=object, body=end)
    return {"episode_id": opened["episode_id"], "task": task, "sample_index": sample_index, "member": member, **result}


async def main(arguments: argparse.Namespace) -> list[dict[str, Any]]:
    proxy = AsyncOpenAI(base_url=arguments.proxy, api_key="unused", max_retries=0, timeout=arguments.timeout)
    settings = EnvSettings() if arguments.data_root is None else EnvSettings(data_root=arguments.data_root)
    episodes = [run_episode(proxy, arguments.task, arguments.split, index, member, arguments.group_size,
                            max_turns=arguments.max_turns, max_tokens=arguments.max_tokens, settings=settings)
                for index in arguments.samples for member in range(arguments.group_size)]
    results = await asyncio.gather(*episodes)
    for result in results:
        print(json.dumps(result), flush=True)
    return list(results)


def parse(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--proxy", required=True, help="the proxy's base URL, e.g. http://127.0.0.1:8300")
    parser.add_argument("--task", default="calc", help="task family (env_workers/envs/registry.py)")
    parser.add_argument("--split", default="dev")
    parser.add_argument("--samples", type=int, nargs="+", default=[0], help="sample indices, one group each")
    parser.add_argument("--group-size", type=int, default=2, help="members per group (GRPO's n)")
    parser.add_argument("--max-turns", type=int, default=4)
    parser.add_argument("--max-tokens", type=int, default=64, help="tokens per answer")
    parser.add_argument("--timeout", type=float, default=600.0, help="seconds per request")
    parser.add_argument("--data-root", default=None, help="task data root (default: ../shared/data)")
    return parser.parse_args(argv)


if __name__ == "__main__":
    asyncio.run(main(parse()))
