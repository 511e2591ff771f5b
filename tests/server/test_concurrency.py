"""Many concurrent streaming clients: each gets exactly what offline generation gives its own prompt."""
from __future__ import annotations

import asyncio

import openai

from latentserve.sampling_params import SamplingParams
from tests.server.conftest import API_KEY, MODEL_NAME

NUM_CLIENTS = 64


async def _stream_one(client: openai.AsyncOpenAI, prompt: str, max_tokens: int) -> tuple[str, str, int]:
    stream = await client.completions.create(model=MODEL_NAME, prompt=prompt, max_tokens=max_tokens, temperature=0,
                                             stream=True, stream_options={"include_usage": True})
    text, finish, tokens = "", None, None
    async for chunk in stream:
        if chunk.choices:
            text += chunk.choices[0].text
            finish = chunk.choices[0].finish_reason or finish
        if chunk.usage is not None:
            tokens = chunk.usage.completion_tokens
    return text, finish, tokens


async def _run_all(url: str, prompts: list[str], max_tokens: list[int]) -> list[tuple[str, str, int]]:
    client = openai.AsyncOpenAI(base_url=f"{url}/v1", api_key=API_KEY, max_retries=0, timeout=60)
    try:
        return await asyncio.gather(*(_stream_one(client, p, m) for p, m in zip(prompts, max_tokens)))
    finally:
        await client.close()


def test_64_concurrent_streams_each_get_their_own_text(server, offline):
    prompts = [f"client {i}: {'abcdefghij'[i % 10] * (1 + i % 5)} go" for i in range(NUM_CLIENTS)]
    max_tokens = [4 + i % 9 for i in range(NUM_CLIENTS)]  # different lengths, so requests end at different steps
    refs = offline.generate(prompts, [SamplingParams(temperature=0.0, max_tokens=m) for m in max_tokens])
    running = []
    original_step = server.engine.step

    def spy():  # the engine thread's batch sizes: the requests really ran together
        running.append(len(server.engine.scheduler.running))
        return original_step()

    server.engine.step = spy
    try:
        results = asyncio.run(_run_all(server.url, prompts, max_tokens))
    finally:
        del server.engine.step
    for ref, (text, finish, tokens) in zip(refs, results):
        completion = ref.outputs[0]
        assert (text, finish, tokens) == (completion.text, completion.finish_reason, len(completion.token_ids))
    assert max(running) >= NUM_CLIENTS // 2
    server.wait_idle()
    assert server.engine.scheduler.block_manager.usage == 0
