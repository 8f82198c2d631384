"""An agent-style loop: several workers share one engine and fire concurrent requests, each turn building on the
previous answer. The engine batches whatever is in flight; the event loop stays free for the workers."""

import asyncio

from m3sdk import Engine, SamplingParams

TOPICS = ["a brave cat", "a lost boat", "the old tree", "a small robot"]


async def worker(engine: Engine, topic: str, turns: int) -> list[str]:
    story: list[str] = []
    prompt = f"Once upon a time there was {topic}."
    for turn in range(turns):
        done = await engine.generate(prompt, SamplingParams(max_tokens=24, temperature=0.8, seed=turn))
        story.append(done.text)
        prompt = f"{prompt}{done.text}"  # the next turn continues the story so far
    return story


async def main() -> None:
    async with Engine() as engine:
        stories = await asyncio.gather(*(worker(engine, topic, turns=3) for topic in TOPICS))
        for topic, story in zip(TOPICS, stories, strict=True):
            print(f"## {topic}\n{''.join(story)}\n")
        print(engine.stats())


if __name__ == "__main__":
    asyncio.run(main())
