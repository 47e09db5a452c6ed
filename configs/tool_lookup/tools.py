"""The tool_lookup task's tool: `lookup(key)` reads the row's own table (its extra_info), which the prompt does not
show. A trajectory's first call with the prompt's key earns `first_call_reward`: answering with a guessed digit (1 in
10 right) would otherwise pay more than a call does before the policy has learnt to use its answer."""


class Lookup:
    schema = {"type": "function", "function": {
        "name": "lookup",
        "description": "The digit stored under a key in this question's table.",
        "parameters": {"type": "object", "properties": {"key": {"type": "string", "enum": ["a", "b", "c", "d"]}},
                       "required": ["key"]},
    }}

    def __init__(self, first_call_reward: float = 0.0):
        self.first_call_reward = first_call_reward

    async def create(self, context):
        context.state["called"] = False

    async def execute(self, args, context):
        table, key = context.extra_info["table"], args.get("key")
        right = not context.state["called"] and key == context.extra_info["key"]
        context.state["called"] = True
        if key not in table:
            return f"no key {key!r}", 0.0, {"lookup/misses": 1}
        return table[key], self.first_call_reward if right else 0.0, {"lookup/right_key": float(right)}
