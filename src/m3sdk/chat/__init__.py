"""Chat with MiniMax-M3: messages in, the reply's content, reasoning and tool calls out.

`validate_messages` checks what a caller sends; `render_tool_call` writes a call in the model's markup (the chat
template and the tool-call grammar use the same shape); `parse_assistant` and `AssistantStreamParser` split a
reply, whole or streamed, in the M3 and the older M2 formats."""

from m3sdk.chat.markup import (
    NS,
    THINKING_MODES,
    prompt_opens_reasoning,
    render_invoke,
    render_tool_call,
    render_tool_calls,
    render_value,
    reply_prefix,
    starts_in_reasoning,
)
from m3sdk.chat.messages import (
    AssistantDelta,
    AssistantMessage,
    FunctionCall,
    ToolCall,
    ToolCallDelta,
    join_deltas,
    tool_schemas,
    validate_messages,
    validate_tools,
)
from m3sdk.chat.stream import AssistantStreamParser, parse_assistant

__all__ = [
    "NS", "THINKING_MODES", "AssistantDelta", "AssistantMessage", "AssistantStreamParser", "FunctionCall",
    "ToolCall", "ToolCallDelta", "join_deltas", "parse_assistant", "prompt_opens_reasoning", "render_invoke",
    "render_tool_call", "render_tool_calls", "render_value", "reply_prefix", "starts_in_reasoning", "tool_schemas",
    "validate_messages", "validate_tools",
]
