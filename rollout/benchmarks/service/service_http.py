"""`rollout-bench service --path http`: the cpu-small workload through the worker's OpenAI-compatible HTTP API with
the official `openai` client (asyncio, every prompt's request in flight at once), whole answers and streamed ones,
greedy, token ids in and out."""

from __future__ import annotations

import asyncio
import time


async def _answers(base_url: str, prompts: list[list[int]], max_new: list[int], stream: bool) -> list[list[int]]:
    import openai

    async with openai.AsyncOpenAI(base_url=base_url, api_key="unused", max_retries=0, timeout=600) as client:

        async def one(prompt: list[int], max_tokens: int) -> list[int]:
            settings = dict(model="tiny", prompt=prompt, max_tokens=max_tokens, temperature=0)
            body = {"return_token_ids": True, "ignore_eos": True}
            if not stream:
                answer = await client.completions.create(**settings, extra_body=body)
                return answer.choices[0].model_extra["token_ids"]
            tokens: list[int] = []
            async for chunk in await client.completions.create(**settings, stream=True, extra_body=body):
                tokens += chunk.choices[0].model_extra["token_ids"]
            return tokens

        return await asyncio.gather(*(one(p, m) for p, m in zip(prompts, max_new)))


def measure(base_url: str, prompts: list[list[int]], max_new: list[int]) -> tuple[dict[str, float], list[list[int]]]:
    """({"http_results": seconds, "http_stream": seconds}, the whole answers' token ids in prompt order).

    Args:
        base_url: the worker's OpenAI API ("http://host:port/v1").
        prompts: the workload's prompts.
        max_new: tokens to generate per prompt (no stop tokens).
    """
    timings: dict[str, float] = {}
    start = time.perf_counter()
    tokens = asyncio.run(_answers(base_url, prompts, max_new, stream=False))
    timings["http_results"] = time.perf_counter() - start
    start = time.perf_counter()
    streamed = asyncio.run(_answers(base_url, prompts, max_new, stream=True))
    timings["http_stream"] = time.perf_counter() - start
    if streamed != tokens:
        raise AssertionError("streamed HTTP answers differ from the whole ones")
    return timings, tokens
