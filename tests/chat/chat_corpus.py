"""Assistant replies and what they parse into: MiniMax-M3 and M2 tool calls (parallel, nested, every schema type,
unicode, text around them), reasoning in every thinking mode, and malformed or cut-off markup, which stays
content. Each case: id, text, tools, starts_in_reasoning, content, reasoning, calls [(name, arguments)]."""

from m3sdk.chat import NS, render_invoke, render_tool_call, render_tool_calls

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Weather for a city",
    "parameters": {"type": "object", "properties": {
        "city": {"type": "string"}, "days": {"type": "integer"}, "metric": {"type": "boolean"},
        "hours": {"type": "array", "items": {"type": "number"}},
        "where": {"type": "object", "properties": {"lat": {"type": "number"}, "label": {"type": ["string", "null"]}}},
    }}}}
ORDER = {"type": "function", "function": {
    "name": "create_order",
    "parameters": {"type": "object", "properties": {
        "user_id": {"type": "integer"},
        "items": {"type": "array", "items": {"type": "object", "properties": {
            "sku": {"type": "string"}, "qty": {"type": "integer"}, "gift": {"type": "boolean"}}}},
        "note": {"type": "string"}, "priority": {"type": "number"},
        "meta": {"type": "object", "additionalProperties": {"type": "string"}},
        "coupon": {"anyOf": [{"type": "string"}, {"type": "null"}]}, "mode": {"enum": ["fast", "slow", 3]},
        "empty_list": {"type": "array"}, "empty_obj": {"type": "object"},
    }}}}
SEARCH = {"type": "function", "function": {"name": "search", "parameters": {
    "type": "object", "properties": {"query": {"type": "string"}, "limit": {"type": "integer"}}}}}
NOW = {"type": "function", "function": {"name": "now"}}
TOOLS = [WEATHER, ORDER, SEARCH, NOW]


def _m2(name: str, **params: str) -> str:
    body = "".join(f'<parameter name="{k}">{v}</parameter>\n' for k, v in params.items())
    return f'<invoke name="{name}">\n{body}</invoke>\n'


def case(id, text, content=None, reasoning=None, calls=(), tools=TOOLS, starts_in_reasoning=False):
    return {"id": id, "text": text, "content": content, "reasoning": reasoning, "calls": list(calls),
            "tools": tools, "starts_in_reasoning": starts_in_reasoning}


PARIS = ("get_weather", {"city": "Paris"})
ORDER_ARGS = {"user_id": 42, "items": [{"sku": "book-001", "qty": 2, "gift": True}, {"sku": "pen", "qty": 1}],
              "note": "leave at the door", "priority": 0.5, "meta": {"channel": "web", "ref": "7"}}
INVOKE_CUT = f'{NS}<tool_call>\n{NS}<invoke name="get_weather">\n{NS}<city>Par'

CORPUS = [
    # ---- plain text and reasoning ----------------------------------------------------------------------------
    case("plain", "Hello there.", "Hello there."),
    case("whitespace_around", "  \n Hi there \n\n", "Hi there"),
    case("empty", "", None),
    case("reasoning_then_answer", "<mm:think>\nFirst, think.\n</mm:think>\n\nThe answer.", "The answer.",
         "First, think."),
    case("enabled_mode", "Plan it.</mm:think>Done.", "Done.", "Plan it.", starts_in_reasoning=True),
    case("enabled_mode_unclosed", "Still thinking about it", None, "Still thinking about it",
         starts_in_reasoning=True),
    case("enabled_mode_repeated_open", "\n<mm:think>\nPlan.</mm:think>Done.", "Done.", "Plan.",
         starts_in_reasoning=True),
    case("enabled_mode_immediate_close", "</mm:think>Direct.", "Direct.", None, starts_in_reasoning=True),
    case("stray_closer_dropped", "</mm:think>\nJust the answer.", "Just the answer."),
    case("stray_closer_after_newline", "\n</think>\nAnswer.", "Answer."),
    case("late_closer_kept", "Use </mm:think> to end a block.", "Use </mm:think> to end a block."),
    case("empty_reasoning", "<mm:think></mm:think>Hi", "Hi", None),
    case("unclosed_reasoning", "<mm:think>I was cut o", None, "I was cut o"),
    case("interleaved_reasoning", "<mm:think>a</mm:think>One.<mm:think>b</mm:think>Two.", "One.\nTwo.", "ab"),
    case("partial_open_at_end", "Look: <mm:thi", "Look: <mm:thi"),
    case("unicode_reasoning", "<mm:think>東京は晴れ？🌸</mm:think>はい、晴れです。", "はい、晴れです。",
         "東京は晴れ？🌸"),
    # ---- M3 tool calls ---------------------------------------------------------------------------------------
    case("single_call", render_tool_call(*PARIS), None, None, [PARIS]),
    case("text_before_call", "Let me check.\n" + render_tool_call(*PARIS), "Let me check.", None, [PARIS]),
    case("text_around_call", "Checking. " + render_tool_call(*PARIS) + "\nWill report.", "Checking.\nWill report.",
         None, [PARIS]),
    case("parallel_calls", render_tool_calls([PARIS, ("get_weather", {"city": "Rome", "days": 2}),
                                              ("search", {"query": "umbrella", "limit": 3})]), None, None,
         [PARIS, ("get_weather", {"city": "Rome", "days": 2}), ("search", {"query": "umbrella", "limit": 3})]),
    case("every_scalar_type", render_tool_call("get_weather", {
        "city": "Oslo", "days": 3, "metric": False, "hours": [6, 12.5, -1e-3], "where": {"lat": 59.9, "label": "c"}}),
         None, None, [("get_weather", {"city": "Oslo", "days": 3, "metric": False, "hours": [6, 12.5, -0.001],
                                       "where": {"lat": 59.9, "label": "c"}})]),
    case("nested_objects_and_lists", render_tool_call("create_order", ORDER_ARGS), None, None,
         [("create_order", ORDER_ARGS)]),
    case("null_and_enum", f'{NS}<tool_call>\n{NS}<invoke name="create_order">\n{NS}<coupon>null{NS}</coupon>\n'
         f'{NS}<mode>3{NS}</mode>\n{NS}<empty_list>{NS}</empty_list>{NS}<empty_obj>{NS}</empty_obj>\n'
         f'{NS}</invoke>\n{NS}</tool_call>', None, None,
         [("create_order", {"coupon": None, "mode": 3, "empty_list": [], "empty_obj": {}})]),
    case("string_kept_verbatim", render_tool_call("get_weather", {"city": "007"}) + render_tool_call(
        "create_order", {"note": "a < b\n> c <b>bold</b> & \"q\""}), None, None,
         [("get_weather", {"city": "007"}), ("create_order", {"note": "a < b\n> c <b>bold</b> & \"q\""})]),
    case("schema_coercions", f'{NS}<tool_call>{NS}<invoke name="get_weather">{NS}<days> 7 {NS}</days>'
         f'{NS}<metric>YES{NS}</metric>{NS}<hours>{NS}<item>1e3{NS}</item>{NS}</hours>{NS}</invoke>{NS}</tool_call>',
         None, None, [("get_weather", {"days": 7, "metric": True, "hours": [1000.0]})]),
    case("wrong_type_kept_as_text", render_tool_call("get_weather", {"days": "soon", "metric": "maybe"}), None,
         None, [("get_weather", {"days": "soon", "metric": "maybe"})]),
    case("repeated_element_is_a_list", f'{NS}<tool_call>{NS}<invoke name="get_weather">{NS}<hours>1{NS}</hours>'
         f'{NS}<hours>2{NS}</hours>{NS}</invoke>{NS}</tool_call>', None, None,
         [("get_weather", {"hours": [1, 2]})]),
    case("untyped_tool", render_tool_call("now", {"x": 1, "y": "a b", "z": [True, None], "w": {"k": "v"}}), None,
         None, [("now", {"x": 1, "y": "a b", "z": [True, None], "w": {"k": "v"}})]),
    case("no_tools_given", render_tool_call("search", {"query": "42", "limit": 5}), None, None,
         [("search", {"query": 42, "limit": 5})], tools=None),
    case("odd_property_names", render_tool_call("now", {"2fa": "on", "my key": 1, "ключ": "значение", "a.b-c": []}),
         None, None, [("now", {"2fa": "on", "my key": 1, "ключ": "значение", "a.b-c": ""})]),
    case("unknown_tool_untyped", render_tool_call("teleport", {"to": "Mars", "fast": True}), None, None,
         [("teleport", {"to": "Mars", "fast": True})]),
    case("unicode_arguments", "天気を調べます。" + render_tool_call("get_weather", {"city": "東京 🌸", "days": 1}),
         "天気を調べます。", None, [("get_weather", {"city": "東京 🌸", "days": 1})]),
    case("closers_without_namespace", f'{NS}<tool_call>\n{NS}<invoke name="search">{NS}<query>rain</query>'
         f'{NS}<limit>6</limit>{NS}</invoke>\n{NS}</tool_call>', None, None,
         [("search", {"query": "rain", "limit": 6})]),
    case("whitespace_after_namespace", f'{NS} <tool_call>\n{NS}\n<invoke name="search">\n{NS} <query>x{NS} </query>'
         f'\n{NS}</invoke>\n{NS}</tool_call>', None, None, [("search", {"query": "x"})]),
    case("quoted_and_unquoted_names", f"{NS}<tool_call>{NS}<invoke name='search'>{NS}</invoke>"
         f"{NS}<invoke name=now>{NS}</invoke>{NS}</tool_call>", None, None, [("search", {}), ("now", {})]),
    case("reasoning_then_call", "<mm:think>Need weather.</mm:think>\n" + render_tool_call(*PARIS), None,
         "Need weather.", [PARIS]),
    case("enabled_mode_call", "Need weather.</mm:think>" + render_tool_call(*PARIS), None, "Need weather.",
         [PARIS], starts_in_reasoning=True),
    case("two_blocks", render_tool_call(*PARIS) + "\nand\n" + render_tool_call("search", {"query": "q"}), "and",
         None, [PARIS, ("search", {"query": "q"})]),
    case("block_not_closed", f"{NS}<tool_call>\n" + render_invoke(*PARIS), None, None, [PARIS]),
    # ---- malformed or cut off: content, never an exception --------------------------------------------------
    case("namespace_in_text", f"The marker {NS} is plain here.", f"The marker {NS} is plain here."),
    case("namespace_at_end", f"Ends with {NS}", f"Ends with {NS}"),
    case("invoke_without_name", f"{NS}<tool_call>\n{NS}<invoke>{NS}<a>1{NS}</a>{NS}</invoke>\n{NS}</tool_call>",
         f"{NS}<invoke>{NS}<a>1{NS}</a>{NS}</invoke>"),
    case("element_not_closed", f'{NS}<tool_call>{NS}<invoke name="search">{NS}<query>rain{NS}</invoke>'
         f'{NS}</tool_call>', f'{NS}<invoke name="search">{NS}<query>rain{NS}</invoke>'),
    case("text_inside_invoke", f'{NS}<tool_call>{NS}<invoke name="search">oops{NS}<query>q{NS}</query>'
         f'{NS}</invoke>{NS}</tool_call>', f'{NS}<invoke name="search">oops{NS}<query>q{NS}</query>{NS}</invoke>'),
    case("cut_mid_invoke", "Checking. " + INVOKE_CUT, "Checking.\n" + INVOKE_CUT[len(f"{NS}<tool_call>\n"):]),
    case("cut_after_one_call", f"{NS}<tool_call>\n" + render_invoke(*PARIS) + f'{NS}<invoke name="se',
         f'{NS}<invoke name="se', None, [PARIS]),
    case("junk_in_block", f"{NS}<tool_call>\nI changed my mind.{NS}</tool_call>",
         f"I changed my mind.{NS}</tool_call>"),
    case("bad_then_good_invoke", f'{NS}<tool_call>{NS}<invoke name="x">{NS}<a>{NS}</invoke>'
         + render_invoke(*PARIS) + f"{NS}</tool_call>", f'{NS}<invoke name="x">{NS}<a>{NS}</invoke>', None, [PARIS]),
    case("only_block_open", f"Calling {NS}<tool_call>", "Calling"),
    # ---- MiniMax-M2 ------------------------------------------------------------------------------------------
    case("m2_call", "<minimax:tool_call>\n" + _m2("get_weather", city="San Francisco, CA", days="\n2\n")
         + "</minimax:tool_call>", None, None, [("get_weather", {"city": "San Francisco, CA", "days": 2})]),
    case("m2_think_and_parallel", "<think>\nTwo lookups.\n</think>\n\nOn it.\n<minimax:tool_call>\n"
         + _m2("search", query="a", limit="1") + _m2("search", query="b") + "</minimax:tool_call>", "On it.",
         "Two lookups.", [("search", {"query": "a", "limit": 1}), ("search", {"query": "b"})]),
    case("m2_json_values", "<minimax:tool_call>" + _m2("create_order", items='[{"sku": "x", "qty": 1}]',
                                                       meta='{"a": "b"}', coupon="null", note="\nhi\n")
         + "</minimax:tool_call>", None, None,
         [("create_order", {"items": [{"sku": "x", "qty": 1}], "meta": {"a": "b"}, "coupon": None, "note": "hi"})]),
    case("m2_starts_in_reasoning", "hmm</think>ok", "ok", "hmm", starts_in_reasoning=True),
    case("m2_parameter_not_closed", '<minimax:tool_call><invoke name="search"><parameter name="query">x</invoke>'
         "</minimax:tool_call>", '<invoke name="search"><parameter name="query">x</invoke>'),
]
