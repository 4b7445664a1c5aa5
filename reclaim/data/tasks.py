"""Training prompts made here: chat questions and small reasoning tasks with known answers.

`reasoning-gym` is not installable here, so `tasks` draws reasoning-style problems from a few
procedural families (arithmetic chains, word problems, number sequences, unit conversion,
comparisons), each with its answer; `add_word` is an easy family for GRPO on a 135M model; `chat` fills templates of everyday requests with topics. Both
are seeded and never repeat a prompt within one draw, so the first n prompts of a draw can train
and the rest stay held out.

    prompts = make_prompts("mixed", 128, seed=0)    # chat and tasks, alternating
"""

from __future__ import annotations

import itertools
import json
import random
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

PROMPT_SOURCES = ("chat", "tasks", "mixed")


@dataclass(frozen=True)
class Task:
    """A generated problem: the question put to the model and its answer."""

    question: str
    answer: str
    family: str


# ---- reasoning tasks ---------------------------------------------------------------------------

NAMES = ["Ana", "Ben", "Chloe", "David", "Emma", "Farid", "Grace", "Hiro", "Ines", "Jamal", "Kira",
         "Liam", "Maya", "Noah", "Olga", "Pablo", "Quinn", "Rosa", "Sam", "Tara"]
ITEMS = ["apples", "books", "marbles", "pencils", "stickers", "cookies", "coins", "cards",
         "shells", "stamps", "eggs", "flowers"]


def _arithmetic(r: random.Random) -> Task:
    n = r.randint(2, 4)
    nums = [r.randint(2, 60) for _ in range(n + 1)]
    ops = [r.choice("+-*") if nums[i + 1] <= 12 else r.choice("+-") for i in range(n)]
    expr = str(nums[0]) + "".join(f" {o} {x}" for o, x in zip(ops, nums[1:]))
    return Task(f"Compute {expr}. Show your steps.", str(eval(expr)), "arithmetic")  # digits and + - * only


def _word_problem(r: random.Random) -> Task:
    a, b = r.sample(NAMES, 2)
    item = r.choice(ITEMS)
    x, y, z = r.randint(3, 40), r.randint(2, 25), r.randint(1, 9)
    kind = r.randrange(3)
    if kind == 0:
        q = f"{a} has {x} {item}. {b} gives {a} {y} more, then {a} gives away {z}. How many {item} does {a} have now?"
        ans = x + y - z
    elif kind == 1:
        q = f"{a} buys {z} boxes of {item} with {y} {item} in each box. How many {item} does {a} have in total?"
        ans = y * z
    else:
        total = y * (z + 1)
        q = f"{a} shares {total} {item} equally among {z + 1} friends. How many {item} does each friend get?"
        ans = y
    return Task(q + " Explain your reasoning.", str(ans), "word_problem")


def _sequence(r: random.Random) -> Task:
    start, step, n = r.randint(1, 30), r.randint(2, 12), r.randint(4, 6)
    if r.random() < 0.5:
        seq = [start + step * i for i in range(n + 1)]
    else:
        base, ratio = r.randint(1, 5), r.randint(2, 3)
        seq = [base * ratio ** i for i in range(n + 1)]
    shown = ", ".join(map(str, seq[:-1]))
    return Task(f"What is the next number in the sequence {shown}? Explain the pattern.", str(seq[-1]),
                "sequence")


CONVERSIONS = [("meters", "centimeters", 100), ("kilograms", "grams", 1000), ("hours", "minutes", 60),
               ("minutes", "seconds", 60), ("kilometers", "meters", 1000), ("days", "hours", 24),
               ("liters", "milliliters", 1000), ("weeks", "days", 7)]


def _conversion(r: random.Random) -> Task:
    big, small, factor = r.choice(CONVERSIONS)
    x = r.randint(2, 40)
    return Task(f"How many {small} are there in {x} {big}? Explain how you convert.", str(x * factor),
                "conversion")


def _comparison(r: random.Random) -> Task:
    a, b, c = r.sample(NAMES, 3)
    ages = r.sample(range(8, 70), 3)
    q = (f"{a} is {ages[0]} years old, {b} is {ages[1]} and {c} is {ages[2]}. Who is the oldest, "
         f"and by how many years is that person older than the youngest?")
    people = dict(zip((a, b, c), ages))
    oldest = max(people, key=people.get)
    return Task(q, f"{oldest}, {max(ages) - min(ages)}", "comparison")


def _add_word(r: random.Random) -> Task:
    """One addition of small numbers in words. SmolLM2-135M-Instruct answers about 20% of these
    right when sampling at temperature 0.7 (about half greedily), so most GRPO groups have a reward
    spread to learn from; its answers run from a few tokens to rambling ones, a long-tailed spread."""
    name, item = r.choice(NAMES), r.choice(ITEMS)
    a, b = r.randint(2, 15), r.randint(2, 15)
    verb = r.choice(["gets", "finds", "buys"])
    return Task(f"{name} has {a} {item} and {verb} {b} more. How many {item} does {name} have now?", str(a + b),
                "add_word")


# The families `tasks` (and so `make_prompts`, and the drafter's training prompts) cycle through.
REASONING_FAMILIES: dict[str, Callable[[random.Random], Task]] = {
    "arithmetic": _arithmetic, "word_problem": _word_problem, "sequence": _sequence,
    "conversion": _conversion, "comparison": _comparison,
}
# Every family a GRPO config may name.
TASK_FAMILIES: dict[str, Callable[[random.Random], Task]] = {**REASONING_FAMILIES, "add_word": _add_word}


def tasks(n: int, seed: int = 0) -> list[Task]:
    """`n` distinct tasks, cycling through the reasoning families, from a seeded generator."""
    r = random.Random(seed)
    families = list(REASONING_FAMILIES.values())
    return _distinct((families[i % len(families)](r) for i in itertools.count()), n, key=lambda t: t.question)


# ---- chat prompts ------------------------------------------------------------------------------

CHAT_TEMPLATES = [
    "Explain {topic} in simple terms.",
    "What are the main ideas behind {topic}?",
    "Give me three interesting facts about {topic}.",
    "Write a short paragraph introducing {topic} to a beginner.",
    "What is a common misconception about {topic}?",
    "Why does {topic} matter in everyday life?",
    "Summarize the history of {topic} in a few sentences.",
    "How would you teach {topic} to a ten-year-old?",
    "List the pros and cons of {topic}.",
    "Write a haiku about {topic}.",
]
TOPICS = [
    "photosynthesis", "the water cycle", "gravity", "volcanoes", "the moon", "black holes",
    "electricity", "magnets", "rainbows", "earthquakes", "the human heart", "sleep", "vaccines",
    "recycling", "climate change", "the internet", "computers", "programming", "machine learning",
    "encryption", "the stock market", "saving money", "inflation", "democracy", "the Roman Empire",
    "the printing press", "the Renaissance", "music", "jazz", "chess", "soccer", "running",
    "gardening", "bread baking", "coffee", "tea", "honey bees", "dolphins", "elephants", "cats",
    "dogs", "forests", "deserts", "oceans", "the solar system", "Mars", "time zones", "maps",
    "libraries", "public speaking", "learning a language", "meditation", "friendship", "cities",
    "trains", "bicycles", "airplanes", "bridges", "solar power", "wind energy",
]
CHAT_QUESTIONS = [
    "What is the capital of France?",
    "Give me three tips for staying focused.",
    "How do I make a cup of tea?",
    "Suggest a name for a pet turtle.",
    "What should I pack for a weekend camping trip?",
    "How can I get better at remembering names?",
    "Write a short thank-you note to a teacher.",
    "What is the difference between weather and climate?",
    "Recommend a simple breakfast that is healthy.",
    "How do I start learning to play the guitar?",
    "Write a two-line poem about autumn.",
    "What are some good habits for a productive morning?",
    "How do plants know which way is up?",
    "Describe a sunset to someone who has never seen one.",
    "What is a good way to apologize to a friend?",
    "Give me a fun fact about octopuses.",
]


def chat_prompts(n: int, seed: int = 0) -> list[str]:
    """`n` distinct everyday requests: the fixed questions, then templates filled with topics."""
    r = random.Random(seed)

    def draw() -> Iterator[str]:
        fixed = CHAT_QUESTIONS[:]
        r.shuffle(fixed)
        yield from fixed
        while True:
            yield r.choice(CHAT_TEMPLATES).format(topic=r.choice(TOPICS))

    return _distinct(draw(), n, key=lambda s: s)


# ---- one entry point ---------------------------------------------------------------------------

def make_prompts(source: str, n: int, seed: int = 0) -> list[str]:
    """`n` user prompts from `source`: "chat", "tasks", "mixed" (both, alternating), or a file
    (one prompt per line, or JSON lines with a "prompt" field)."""
    if n < 0:
        raise ValueError(f"number of prompts must be >= 0, got {n}")
    if source == "chat":
        return chat_prompts(n, seed)
    if source == "tasks":
        return [t.question for t in tasks(n, seed)]
    if source == "mixed":
        chat, task = chat_prompts((n + 1) // 2, seed), [t.question for t in tasks(n // 2, seed)]
        return [p for pair in zip(chat, task) for p in pair] + chat[len(task):]
    path = Path(source).expanduser()
    if not path.is_file():
        raise ValueError(f"prompts {source!r} is neither one of {list(PROMPT_SOURCES)} nor a file")
    lines = [ln for ln in path.read_text().splitlines() if ln.strip()]
    out = [json.loads(ln)["prompt"] if ln.lstrip().startswith("{") else ln for ln in lines]
    if len(out) < n:
        raise ValueError(f"prompts file {str(path)!r} has {len(out)} prompts; {n} are asked for")
    return out[:n]


def _distinct(items: Iterator, n: int, key: Callable, max_tries: int = 100_000) -> list:
    out, seen = [], set()
    for i, item in enumerate(items):
        if len(out) == n:
            break
        if i >= max_tries:
            raise ValueError(f"could not draw {n} distinct prompts (got {len(out)})")
        if key(item) not in seen:
            seen.add(key(item))
            out.append(item)
    return out
