"""Streaming with cancellation: leaving the `async for` early, or cancelling the task, aborts the request and
frees its KV pages at once."""

import asyncio

from m3sdk import Engine


async def main() -> None:
    async with Engine() as engine:
        # 1. Stop reading after a few chunks: the request is aborted when the iterator closes.
        received = 0
        async for chunk in engine.stream("Once upon a time", max_tokens=200, temperature=0.7, seed=1):
            print(chunk.text, end="", flush=True)
            received += 1
            if received == 8:
                break
        print("\n[stopped reading after 8 chunks]")

        # 2. Cancel a task that awaits a long generation.
        task = asyncio.create_task(engine.generate("There was a king", max_tokens=400, ignore_eos=True))
        await asyncio.sleep(0.2)
        task.cancel()
        try:
            await task
        except asyncio.CancelledError:
            print("[generation task cancelled]")

        await asyncio.sleep(0.1)  # the engine thread frees the pages on its next step
        stats = engine.stats()
        print(f"running={stats['running']} waiting={stats['waiting']} "
              f"pages_free={stats['pages_free']}/{stats['pages_total']}")


if __name__ == "__main__":
    asyncio.run(main())
