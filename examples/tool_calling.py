"""A two-turn tool loop with engine.chat on the bundled m3-tiny: the first turn must call a tool
(tool_choice="required" constrains decoding to a valid call with schema-valid arguments), the application runs
it, and the second turn answers from the result. m3-tiny is a tiny model trained on novels: its arguments are
valid but not wise, which is the point of the grammar."""

import asyncio
import json

from m3sdk import Engine

TOOLS = [{"type": "function", "function": {
    "name": "get_weather",
    "description": "Today's weather in a city",
    "parameters": {"type": "object", "properties": {
        "city": {"type": "string", "maxLength": 10},
        "unit": {"enum": ["celsius", "fahrenheit"]}},
        "required": ["city", "unit"]}}}]


def get_weather(city: str, unit: str) -> dict:
    """The application's side of the tool (a real one would ask a weather service)."""
    degrees = 18 if unit == "celsius" else 64
    return {"city": city, "temperature": degrees, "unit": unit, "sky": "clear"}


async def main() -> None:
    async with Engine() as engine:
        messages = [{"role": "system", "content": "You answer questions about the weather."},
                    {"role": "user", "content": "Is it warm in Bath today?"}]
        first = await engine.chat(messages, tools=TOOLS, tool_choice="required", parallel_tool_calls=False,
                                  temperature=0.7, seed=0, max_tokens=300)
        print(f"turn 1: finish_reason={first.finish_reason}")
        messages.append(first.message.to_dict())
        for call in first.message.tool_calls:
            arguments = json.loads(call.function.arguments)
            result = get_weather(**arguments)
            print(f"  {call.function.name}({arguments}) -> {result}")
            messages.append({"role": "tool", "tool_call_id": call.id, "content": json.dumps(result)})

        second = await engine.chat(messages, tools=TOOLS, tool_choice="none", temperature=0.7, seed=0,
                                   max_tokens=40, chat_template_kwargs={"thinking_mode": "disabled"})
        print(f"turn 2: finish_reason={second.finish_reason}\n  {second.message.content!r}")
        print(f"usage: {first.usage.total_tokens + second.usage.total_tokens} tokens over two turns")


if __name__ == "__main__":
    asyncio.run(main())
