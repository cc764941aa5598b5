"""Does the default model call a tool on its own (`tool_choice: "auto"`)? Four prompt styles.

    .venv/bin/python scripts/probe_auto_tool_call.py

SmolLM2-135M-Instruct's template does not render tools, so jaxserve describes them in a system
message (engine/tool_calls.py). This tries that, the SmolLM2-1.7B model card's exact tool
prompt, a system prompt with a worked example of another tool, and a few-shot conversation
(a currency call and a prose answer as earlier turns), on weather/time questions that a tool
answers and on two that none does; greedy. It prints each reply and whether it is a call.
"""

from __future__ import annotations

import json

from jaxserve import LLM, SamplingParams
from jaxserve.engine.tool_calls import FAMILIES, ToolRequest, system_prompt


def fn(name: str, desc: str, props: dict) -> dict:
    params = {"type": "object", "properties": props, "required": list(props)}
    return {"type": "function", "function": {"name": name, "description": desc, "parameters": params}}


TOOLS = [
    fn("get_weather", "Get the current weather in a city", {"city": {"type": "string"}}),
    fn("get_time", "Get the current time in a time zone", {"timezone": {"type": "string"}}),
]
EXAMPLE = fn("convert_currency", "Convert an amount", {"amount": {"type": "number"}, "to": {"type": "string"}})
CALL = '<tool_call>[\n{"name": "convert_currency", "arguments": {"amount": 100, "to": "EUR"}}\n]</tool_call>'
QUESTIONS = [
    "What's the weather like in Paris today?",
    "Is it raining in London right now?",
    "What time is it in Tokyo?",
    "What is the capital of France?",
    "Write a Python function that reverses a string.",
]
CARD = (
    "You are an expert in composing functions. You are given a question and a set of possible functions. \n"
    "Based on the question, you will need to make one or more function/tool calls to achieve the purpose. \n"
    "If none of the functions can be used, point it out and refuse to answer. \n"
    "If the given question lacks the parameters required by the function, also point it out.\n\n"
    "You have access to the following tools:\n<tools>{tools}</tools>\n\n"
    "The output MUST strictly adhere to the following format, and NO other text MUST be included.\n"
    "The example format is as follows. Please make sure the parameter type is correct. If no function call is "
    "needed, please make the tool calls an empty list '[]'.\n"
    '<tool_call>[\n{{"name": "func_name1", "arguments": {{"argument1": "value1", "argument2": "value2"}}}},\n'
    "... (more tool calls as required)\n]</tool_call>"
)


def styles() -> dict[str, list[dict]]:
    tools_json = "\n".join(json.dumps(t) for t in TOOLS)
    worked = (
        "When a tool answers the user's question, reply only with a call, else answer normally.\n"
        f"Example: with convert_currency, 'How much is 100 dollars in euros?' is answered with:\n{CALL}\n\n"
        f"You have access to the following tools:\n<tools>\n{tools_json}\n</tools>"
    )
    shots = [
        {"role": "user", "content": "How much is 100 dollars in euros?"},
        {"role": "assistant", "content": CALL},
        {"role": "user", "content": "Who wrote Hamlet?"},
        {"role": "assistant", "content": "William Shakespeare wrote Hamlet."},
    ]
    return {
        "jaxserve": [{"role": "system", "content": system_prompt(FAMILIES["smollm2"], ToolRequest.of(TOOLS))}],
        "model card": [{"role": "system", "content": CARD.format(tools=json.dumps([t["function"] for t in TOOLS]))}],
        "worked example": [{"role": "system", "content": worked}],
        "few-shot": [{"role": "system", "content": f"<tools>\n{tools_json}\n{json.dumps(EXAMPLE)}\n</tools>"}, *shots],
    }


def main() -> None:
    llm = LLM()
    params = SamplingParams(temperature=0.0, max_tokens=50)
    for name, head in styles().items():
        for q in QUESTIONS:
            text = llm.tokenizer.apply_chat_template(
                [*head, {"role": "user", "content": q}], tokenize=False, add_generation_prompt=True
            )
            reply = llm.generate([text], params)[0].text
            print(f"{name:>14} | {'CALL' if '<tool_call>' in reply else 'prose':5} | {q} -> {reply[:80]!r}")


if __name__ == "__main__":
    main()
