"""Run from the repository root: python reports/scripts/distractor_items.py.
A recall set unlike the agent sets (dev text: Northanger Abbey): two similar facts (one distractor),
pasted pages between, a question about one, an answer prefix."""

import json
import random

text = open("confkv/data/austen_northangerabbey.txt").read().split()
rng = random.Random(7)
items = []
kinds = [
    ("locker code", lambda: str(rng.randint(1000, 9999))),
    (
        "gate word",
        lambda: rng.choice(["amber", "falcon", "cobalt", "juniper", "saffron", "quartz", "tundra", "marble"]),
    ),
    ("room number", lambda: str(rng.randint(100, 999))),
]
for i in range(12):
    name, gen = kinds[i % 3]
    mine, other = gen(), gen()
    while other == mine:
        other = gen()
    ask_mine = i % 2 == 0
    words = rng.choice([2000, 2400, 2700])
    start = rng.randint(0, len(text) - 3 * words - 10)
    pages = [" ".join(text[start + k * words // 3 : start + (k + 1) * words // 3]) for k in range(3)]
    msgs = [
        {"role": "system", "content": "You are a helpful assistant. Remember what the user tells you."},
        {
            "role": "user",
            "content": f"Please remember two things. My {name} is {mine}. My brother's {name} is {other}.",
        },
        {"role": "assistant", "content": "Noted, I will remember both."},
    ]
    for k, p in enumerate(pages):
        msgs.append({"role": "user", "content": f"Here is page {k + 1} of a story I am reading:\n{p}"})
        msgs.append({"role": "assistant", "content": "Thank you, I have read it."})
    who = "my" if ask_mine else "my brother's"
    msgs.append({"role": "user", "content": f"What is {who} {name}? Answer with the {name} only."})
    ans = mine if ask_mine else other
    items.append(
        {
            "id": f"distractor-{i:02d}",
            "messages": msgs,
            "answer": ans,
            "answer_prefix": f"{'Your' if ask_mine else 'Your brother' + chr(39) + 's'} {name} is",
        }
    )
with open("reports/data/distractor_dev.jsonl", "w") as f:
    for it in items:
        f.write(json.dumps(it) + "\n")
print(len(items))
