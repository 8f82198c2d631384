"""Agents that differ, sharing one engine: four workers run their own multi-turn loops concurrently, each with its
own system prompt and its own way of constraining the model, and the engine batches whatever is in flight.

- the planner asks for a JSON plan (response_format with a JSON schema) and then works through its steps;
- the clerk must call a tool every turn (tool_choice="required"), and gets the tool's result back;
- the critic grades each of the planner's steps with one word from a fixed set (structured_output choice);
- the storyteller writes free text, streamed, continuing its own story.
m3-tiny is a tiny model trained on novels: the constraints make its output usable, not wise."""

import asyncio
import json

from m3sdk import Engine, SamplingParams

PLAN = {"type": "object", "properties": {
    "goal": {"type": "string", "maxLength": 16},
    "steps": {"type": "array", "items": {"type": "string", "maxLength": 12}, "minItems": 2, "maxItems": 3}},
    "required": ["goal", "steps"], "additionalProperties": False}
LEDGER = [{"type": "function", "function": {
    "name": "record_sale", "description": "Record a sale in the ledger",
    "parameters": {"type": "object", "properties": {
        "item": {"enum": ["tea", "cake", "ribbon"]},
        "quantity": {"type": "integer", "minimum": 1, "maximum": 9}},
        "required": ["item", "quantity"]}}}]
GRADES = ["good", "fair", "poor"]


async def planner(engine: Engine, log: list[str]) -> list[str]:
    messages = [{"role": "system", "content": "You plan a picnic. Answer in JSON."},
                {"role": "user", "content": "Make a plan."}]
    reply = await engine.chat(messages, response_format={"type": "json_schema", "json_schema": {
        "name": "plan", "schema": PLAN}}, seed=1, max_tokens=120)
    plan = json.loads(reply.message.content)
    log.append(f"planner: plan {plan}")
    for step in plan["steps"]:  # one more turn per step, free text
        messages += [reply.message.to_dict(), {"role": "user", "content": f"How do we do '{step}'?"}]
        reply = await engine.chat(messages, seed=2, max_tokens=16, chat_template_kwargs={"thinking_mode": "disabled"})
        log.append(f"planner: {step!r} -> {reply.message.content!r}")
    return plan["steps"]


async def clerk(engine: Engine, log: list[str]) -> None:
    messages = [{"role": "system", "content": "You keep the shop's ledger. Record every sale with the tool."},
                {"role": "user", "content": "Two cakes were sold, then some tea."}]
    for turn in range(2):
        reply = await engine.chat(messages, tools=LEDGER, tool_choice="required", parallel_tool_calls=False,
                                  seed=10 + turn, max_tokens=240)
        messages.append(reply.message.to_dict())
        for call in reply.message.tool_calls:
            log.append(f"clerk: {call.function.name} {call.function.arguments}")
            messages.append({"role": "tool", "tool_call_id": call.id, "content": '{"ok": true}'})
        messages.append({"role": "user", "content": "Record the next sale."})


async def critic(engine: Engine, steps: asyncio.Future, log: list[str]) -> None:
    for step in await steps:
        grade = await engine.generate(f"A picnic step: {step}. Grade:", SamplingParams(
            max_tokens=4, seed=3, structured_output={"choice": GRADES}))
        log.append(f"critic: {step!r} is {grade.text}")


async def storyteller(engine: Engine, log: list[str]) -> None:
    story = "Once upon a time there was a picnic by the river."
    for turn in range(2):
        text = ""
        async for chunk in engine.stream(story, max_tokens=20, temperature=0.8, seed=turn):
            text += chunk.text
        story += text
    log.append(f"storyteller: {story!r}")


async def main() -> None:
    log: list[str] = []
    async with Engine() as engine:
        steps: asyncio.Future = asyncio.get_running_loop().create_future()

        async def plan_then_share() -> None:
            steps.set_result(await planner(engine, log))

        await asyncio.gather(plan_then_share(), clerk(engine, log), critic(engine, steps, log),
                             storyteller(engine, log))
        print("\n".join(log))
        stats = engine.stats()
        print(f"{stats['requests_finished']} requests, {stats['generation_tokens']} tokens, {stats['steps']} steps")


if __name__ == "__main__":
    asyncio.run(main())
