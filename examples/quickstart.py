"""Quickstart: one completion and one stream from the bundled m3-tiny model."""

import asyncio

from m3sdk import Engine, SamplingParams


async def main() -> None:
    async with Engine() as engine:
        done = await engine.generate("Once upon a time", SamplingParams(max_tokens=40, temperature=0))
        print(f"{done.text!r}\nfinish_reason={done.finish_reason} usage={done.usage}")

        async for chunk in engine.stream("The little fox", max_tokens=40, temperature=0.8, seed=7):
            print(chunk.text, end="", flush=True)
        print()


if __name__ == "__main__":
    asyncio.run(main())
