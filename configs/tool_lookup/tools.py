"""The tool_lookup task's tool: `lookup(key)` reads the row's own table (its extra_info), which the prompt does not
show. The first call of a trajectory with the prompt's key earns a small reward delta, so a random policy finds the
call before it can profit from copying the answer; a call after the first costs as much, so calling again is never
better than answering."""


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
        if key not in table:
            return f"no key {key!r}; the keys are {', '.join(table)}", 0.0, {"lookup/misses": 1}
        again = context.state["called"]
        context.state["called"] = True
        right = not again and key == context.extra_info["key"]
        reward = -self.first_call_reward if again else self.first_call_reward if right else 0.0
        return table[key], reward, {"lookup/right_key": float(right), "lookup/again": float(again)}
