"""A tool-calling agent's multi-turn rollouts over the official `openai` client, token in and token out.

    python examples/agent_openai.py [--episodes 4] [--turns 3] [--base-url http://127.0.0.1:8000/v1]

Without --base-url it starts its own `rollout-worker --model tiny --http` and stops it at the end.

Each episode: the task and the tool list are rendered once with the tokenizer's chat template; then every turn sends
the whole conversation as token ids (`prompt=[ids]`, never re-tokenized text), the model's turn comes back as token
ids (`return_token_ids`) with their logprobs and policy versions, the tool runs on the model's text, and the tool's
turn is appended as token ids. The episode ends up as one GRPO row: `completion_ids` (every turn after the prompt),
`logprobs` (0 for tool tokens), `completion_mask` (1 on the model's tokens, 0 on the tool's), and the policy version
of every model token (so an off-policy loss can weigh or drop stale turns).

The built-in tiny model is random, so its "tool calls" are noise: the tool here reads any turn as a call (it counts
the letters of the turn's text). Swap `run_tool` for a real parser and tools.

With --tool-calls, the worker parses the calls instead (it must run with `--tool-call-parser hermes` or
`llama3_json`, and serve a model that writes tool calls, e.g. Qwen3): each turn is a chat request with `tools`, the
calls come back in `message.tool_calls`, each is run and its result sent back as a `tool` message, and each model turn
is kept as its own row (the chat template re-renders the conversation, so turns are not concatenated as token ids).
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import openai  # noqa: E402
from grpo_toy import free_port  # noqa: E402

from rollout.presets import tiny_tokenizer  # noqa: E402

TOKENIZER = tiny_tokenizer()
END_OF_TURN = TOKENIZER.convert_tokens_to_ids("<|im_end|>")
TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "count_letters",
            "description": "Count the letters in a text",
            "parameters": {"type": "object", "properties": {"text": {"type": "string"}}},
        },
    }
]


@dataclass
class Episode:
    """One agent conversation as a training row."""

    prompt_ids: list[int]
    completion_ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    completion_mask: list[int] = field(default_factory=list)  # 1: the model's token; 0: the tool's
    policy_versions: list[int] = field(default_factory=list)  # per model token
    turns: int = 0

    def add_model_turn(self, token_ids: list[int], logprobs: list[float], version_runs: list[list[int]]) -> None:
        """Append a model turn: its tokens count in the loss."""
        self.completion_ids += token_ids
        self.logprobs += logprobs
        self.completion_mask += [1] * len(token_ids)
        self.policy_versions += expand_versions(version_runs, len(token_ids))
        self.turns += 1

    def add_tool_turn(self, token_ids: list[int]) -> None:
        """Append the tool's turn: context for the next model turn, masked out of the loss."""
        self.completion_ids += token_ids
        self.logprobs += [0.0] * len(token_ids)
        self.completion_mask += [0] * len(token_ids)


def expand_versions(runs: list[list[int]], count: int) -> list[int]:
    """Run-length encoded [version, first index] pairs -> one version per token."""
    versions = []
    for i, (version, first) in enumerate(runs):
        end = runs[i + 1][1] if i + 1 < len(runs) else count
        versions += [version] * (end - first)
    return versions


def run_tool(turn_text: str) -> str:
    """The tool call a turn makes, answered (here: every turn calls count_letters on its own text)."""
    return json.dumps({"letters": sum(c.isalpha() for c in turn_text)})


def tool_turn_ids(result: str, model_closed_its_turn: bool) -> list[int]:
    """The tokens of a tool turn and the next assistant header (ChatML), closing the model's turn if it did not."""
    text = ("" if model_closed_its_turn else "<|im_end|>\n") + f"<|im_start|>tool\n{result}<|im_end|>\n"
    return TOKENIZER(text + "<|im_start|>assistant\n", add_special_tokens=False)["input_ids"]


def run_episode(client: openai.OpenAI, model: str, task: str, turns: int, seed: int, max_tokens: int) -> Episode:
    """One conversation of `turns` model turns with a tool turn between each two."""
    messages = [{"role": "user", "content": task}]
    prompt = TOKENIZER.apply_chat_template(messages, tools=TOOLS, add_generation_prompt=True)["input_ids"]
    episode = Episode(list(prompt))
    for turn in range(turns):
        answer = client.completions.create(
            model=model,
            prompt=episode.prompt_ids + episode.completion_ids,  # token ids in: nothing is re-tokenized
            max_tokens=max_tokens,
            temperature=1.0,
            seed=seed * 1000 + turn,
            logprobs=0,
            extra_body={"return_token_ids": True, "stop_token_ids": [END_OF_TURN]},
        )
        choice = answer.choices[0]
        extra = choice.model_extra
        episode.add_model_turn(extra["token_ids"], choice.logprobs.token_logprobs, extra["policy_versions"])
        if turn + 1 < turns:
            closed = bool(extra["token_ids"]) and extra["token_ids"][-1] == END_OF_TURN
            episode.add_tool_turn(tool_turn_ids(run_tool(choice.text), closed))
    return episode


@dataclass
class ToolTurn:
    """One model turn of a --tool-calls episode: its own prompt (the rendered conversation) and completion."""

    prompt_ids: list[int]
    completion_ids: list[int]
    logprobs: list[float]
    tool_calls: list[dict]  # {"name", "arguments"} of each call the model made
    tool_results: list[str]


def run_tool_calls_episode(client: openai.OpenAI, model: str, task: str, turns: int, max_tokens: int) -> list[ToolTurn]:
    """A conversation whose tool calls the worker parses (`--tool-call-parser`): up to `turns` model turns, each
    call run by `call_tool` and answered with a `tool` message; it ends when the model answers without a call."""
    messages: list[dict] = [{"role": "user", "content": task}]
    rows = []
    for _ in range(turns):
        answer = client.chat.completions.create(
            model=model,
            messages=messages,
            tools=TOOLS,
            max_tokens=max_tokens,
            logprobs=True,
            extra_body={"return_token_ids": True},
        )
        choice = answer.choices[0]
        calls = choice.message.tool_calls or []
        results = [call_tool(call.function.name, call.function.arguments) for call in calls]
        rows.append(
            ToolTurn(
                answer.model_extra["prompt_token_ids"],
                choice.model_extra["token_ids"],
                [entry.logprob for entry in choice.logprobs.content],
                [{"name": call.function.name, "arguments": json.loads(call.function.arguments)} for call in calls],
                results,
            )
        )
        if not calls:
            break
        messages.append(choice.message.model_dump(include={"role", "content", "tool_calls"}))
        for call, result in zip(calls, results):
            messages.append({"role": "tool", "tool_call_id": call.id, "content": result})
    return rows


def call_tool(name: str, arguments: str) -> str:
    """Run one parsed tool call (only count_letters exists here)."""
    if name != "count_letters":
        return json.dumps({"error": f"no tool named {name}"})
    return run_tool(json.loads(arguments).get("text", ""))


def start_worker(port: int) -> subprocess.Popen:
    """A tiny-preset rollout-worker serving HTTP on `port`; returns once /health answers."""
    command = [sys.executable, "-m", "rollout.service.launch.cli", "--model", "tiny", "--device", "cpu"]
    command += ["--bind", f"tcp://127.0.0.1:{free_port()}", "--http", f"127.0.0.1:{port}", "--log-level", "WARNING"]
    worker = subprocess.Popen([*command, "--num-blocks", "512"])
    client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="unused", max_retries=0, timeout=2)
    deadline = time.monotonic() + 120
    while True:
        try:
            client.models.list()
            return worker
        except openai.APIConnectionError:
            if worker.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError("the rollout-worker did not start") from None
            time.sleep(0.5)


def main(argv: list[str] | None = None) -> list[Episode] | list[list[ToolTurn]]:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--episodes", type=int, default=4, help="conversations to roll out (default: 4)")
    parser.add_argument("--turns", type=int, default=3, help="model turns per conversation (default: 3)")
    parser.add_argument("--max-tokens", type=int, default=12, help="most tokens per model turn (default: 12)")
    parser.add_argument("--base-url", default=None, help="a running worker's OpenAI API (default: start one)")
    parser.add_argument("--model", default="tiny", help="the served model's name (default: tiny)")
    parser.add_argument(
        "--tool-calls",
        action="store_true",
        help="let the worker parse tool calls (it needs --tool-call-parser and a model that writes them)",
    )
    args = parser.parse_args(argv)
    if args.turns < 2:
        parser.error("--turns must be at least 2 (a tool turn sits between two model turns)")
    worker = None
    if args.base_url is None:
        port = free_port()
        worker = start_worker(port)
        args.base_url = f"http://127.0.0.1:{port}/v1"
    try:
        with openai.OpenAI(base_url=args.base_url, api_key="unused", timeout=120) as client:
            tasks = [f"count the letters of word {i}" for i in range(args.episodes)]
            if args.tool_calls:
                conversations = [
                    run_tool_calls_episode(client, args.model, t, args.turns, args.max_tokens) for t in tasks
                ]
                for i, rows in enumerate(conversations):
                    calls = [call["name"] for row in rows for call in row.tool_calls]
                    print(f"episode {i}: {len(rows)} model turns, tool calls {calls}")
                return conversations
            episodes = [
                run_episode(client, args.model, task, args.turns, i, args.max_tokens) for i, task in enumerate(tasks)
            ]
    finally:
        if worker is not None:
            worker.terminate()
            worker.wait(30)
    for i, episode in enumerate(episodes):
        model_tokens = sum(episode.completion_mask)
        print(
            f"episode {i}: {episode.turns} model turns, {model_tokens} model tokens, "
            f"{len(episode.completion_ids) - model_tokens} tool tokens, policy versions {sorted(set(episode.policy_versions))}"
        )
    return episodes


if __name__ == "__main__":
    main()
