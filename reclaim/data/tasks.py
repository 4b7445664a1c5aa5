"""Training prompts: chat questions, small reasoning tasks made here, and reasoning-gym's datasets.

`tasks` draws reasoning-style problems from a few procedural families made here (arithmetic chains,
word problems, number sequences, unit conversion, comparisons), each with its answer; `add_word` is
an easy family for GRPO on a 135M model; `chat` fills templates of everyday requests with topics.
`rg:<dataset>` (several comma-separated: `rg:chain_sum,leg_counting`) draws from reasoning-gym's
datasets (the optional extra `reclaim[tasks]`) with `reasoning_gym.create_dataset`; each such Task
keeps reasoning-gym's entry and dataset options, so `rg_score` grades an answer with that dataset's
own `score_answer`. All are seeded and never repeat a prompt within one draw, so the first n
prompts of a draw can train and the rest stay held out.

    prompts = make_prompts("mixed", 128, seed=0)    # chat and tasks, alternating
    prompts = make_prompts("rg:leg_counting", 128, seed=0)
"""

from __future__ import annotations

import difflib
import itertools
import json
import random
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field
from functools import lru_cache
from pathlib import Path
from typing import Any

PROMPT_SOURCES = ("chat", "tasks", "mixed", "instruct", "broad")
RG_PREFIX = "rg:"  # a task or prompt source drawn from reasoning-gym: rg:<dataset>[,<dataset>...]


@dataclass(frozen=True)
class Task:
    """A generated problem: the question put to the model and its answer. A reasoning-gym task
    (family `rg:<dataset>`) also keeps its entry and the dataset's options, which its scorer needs."""

    question: str
    answer: str
    family: str
    entry: dict[str, Any] | None = field(default=None, compare=False)
    config: dict[str, Any] | None = field(default=None, compare=False)


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


# ---- reasoning-gym datasets --------------------------------------------------------------------

def _reasoning_gym() -> Any:
    try:
        import reasoning_gym
    except ImportError as e:
        raise ImportError(f"{RG_PREFIX}<dataset> needs reasoning-gym: pip install 'reclaim[tasks]' ({e})") from e
    return reasoning_gym


def rg_dataset_names() -> list[str]:
    """Every dataset name reasoning-gym registers (what `rg:<dataset>` may name)."""
    return sorted(_reasoning_gym().factory.DATASETS)


def rg_names(source: str) -> list[str]:
    """The reasoning-gym datasets `rg:a,b` names (an `rg:` on each name is allowed); unknown ones refused."""
    if not source.startswith(RG_PREFIX):
        raise ValueError(f"{source!r} does not name reasoning-gym datasets; write {RG_PREFIX}<dataset>[,<dataset>]")
    names = [n.strip().removeprefix(RG_PREFIX).strip() for n in source[len(RG_PREFIX):].split(",") if n.strip()]
    allowed = rg_dataset_names()
    unknown = [n for n in names if n not in allowed]
    if unknown or not names:
        near = sorted({m for n in unknown for m in difflib.get_close_matches(n, allowed, n=3)})
        examples = near or [n for n in ("basic_arithmetic", "chain_sum", "leg_counting", "gsm_symbolic") if n in allowed]
        raise ValueError(f"unknown reasoning-gym dataset {unknown or source!r}; allowed: {len(allowed)} names such as "
                         f"{', '.join(examples)} (all: python -c 'import reasoning_gym; "
                         "print(sorted(reasoning_gym.factory.DATASETS))')")
    return names


@lru_cache(maxsize=64)
def _rg_dataset(name: str, seed: int, size: int, options: str) -> Any:
    rg = _reasoning_gym()
    kwargs = json.loads(options)
    config_cls = rg.factory.DATASETS[name][1]
    allowed = sorted(f for f in config_cls.__dataclass_fields__ if f not in ("seed", "size"))
    bad = sorted(set(kwargs) - set(allowed))
    if bad:
        raise ValueError(f"reasoning-gym dataset {name!r} has no option(s) {bad}; allowed: {allowed}")
    try:
        return rg.create_dataset(name, seed=seed, size=size, **kwargs)
    except (AssertionError, TypeError, ValueError) as e:  # its configs validate with assert
        raise ValueError(f"reasoning-gym dataset {name!r} refused options {kwargs}: {e or type(e).__name__}") from e


def _options(config: Mapping[str, Any] | None) -> str:
    return json.dumps(dict(config or {}), sort_keys=True)


def rg_tasks(source: str, n: int, seed: int = 0, options: Mapping[str, Mapping[str, Any]] | None = None) -> list[Task]:
    """`n` distinct tasks from the reasoning-gym datasets `source` names (`rg:a,b`), taking their
    entries 0, 1, ... in turn, each dataset made with `seed` and its options in `options[name]`."""
    names = rg_names(source)
    unused = sorted(set(options or {}) - set(names))
    if unused:
        raise ValueError(f"options for reasoning-gym dataset(s) {unused}, which {source!r} does not name")
    size = max(n, 1)
    while True:  # an entry depends on (seed, index), not on the size: a bigger draw only adds entries
        sets = [(name, _rg_dataset(name, seed, size, _options((options or {}).get(name)))) for name in names]
        drawn = (Task(e["question"], str(e["answer"]), RG_PREFIX + name, e, dict((options or {}).get(name) or {}))
                 for i in range(size) for name, d in sets for e in (d[i],))
        out = _distinct(drawn, n, key=lambda t: t.question)
        if len(out) == n or size >= 64 * max(n, 1):
            break
        size *= 4
    if len(out) < n:
        raise ValueError(f"{source!r} gave only {len(out)} distinct questions in {size} entries per dataset; {n} asked")
    return out


def rg_score(family: str, answer: str | None, entry: Mapping[str, Any], config: Mapping[str, Any] | None = None) -> float:
    """reasoning-gym's own grade (0..1) of `answer` for `entry` of dataset `family` (`rg:<dataset>`),
    by the dataset made with the options the task was drawn with."""
    names = rg_names(family)
    if len(names) != 1:
        raise ValueError(f"a task's family names one reasoning-gym dataset, got {family!r}")
    name = names[0]
    return float(_rg_dataset(name, 0, 1, _options(config)).score_answer(answer, dict(entry)))


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


# Broader requests than `chat`'s: many kinds of instruction (code, recipes, letters, lists,
# comparisons, stories, rewriting, planning), each a template with one or two slots.
INSTRUCT_KINDS: list[tuple[str, dict[str, list[str]]]] = [
    ("Write a Python function that {code_task}.", {}),
    ("Write a {lang} program that {code_task}, with a short explanation.", {}),
    ("Explain what this does: `{snippet}`", {}),
    ("What is the difference between {pair} in {lang}?", {}),
    ("How do I {howto}? Give numbered steps.", {}),
    ("Give me a recipe for {dish}.", {}),
    ("List {k} {listable}, one per line.", {}),
    ("Compare {a} and {b} in a short table.", {}),
    ("Summarise the story of {story} in {k} sentences.", {}),
    ("Write a short {genre} about {subject}.", {}),
    ("Write an email to {whom} about {matter}.", {}),
    ("Rewrite this sentence to sound more formal: \"{casual}\"", {}),
    ("Translate into French: \"{casual}\"", {}),
    ("Plan a {length} trip to {place}: what should I see each day?", {}),
    ("Why does {phenomenon}? Answer in a paragraph.", {}),
    ("What would happen if {whatif}?", {}),
    ("Give me {k} ideas for {occasion}.", {}),
    ("Describe {subject} to someone who has never seen it.", {}),
    ("What are the rules of {game}?", {}),
    ("Define {term} and give an example.", {}),
]
INSTRUCT_SLOTS: dict[str, list[str]] = {
    "code_task": ["reverses a linked list", "counts the words in a file", "returns the n-th Fibonacci number",
                  "merges two sorted lists", "removes duplicates from a list", "finds the largest number in a list",
                  "converts Celsius to Fahrenheit", "checks whether a number is prime", "sorts a dictionary by value",
                  "flattens a nested list", "parses a date string", "computes the average of a list",
                  "finds the most common letter in a string", "validates an email address"],
    "lang": ["Python", "JavaScript", "C", "Java", "Rust", "Go", "SQL", "Bash"],
    "snippet": ["[x * x for x in range(5)]", "sorted(d, key=d.get)", "a, b = b, a", "' '.join(reversed(s.split()))",
                "for i, x in enumerate(xs): print(i, x)", "set(a) & set(b)", "lambda x: x % 2 == 0"],
    "pair": ["a class and an object", "a function and a method", "a stack and a queue", "an array and a set",
             "compiling and interpreting", "a loop and recursion", "a string and a character"],
    "howto": ["change a flat tyre", "set up a budget", "plant tomatoes", "write a cover letter",
              "clean a laptop keyboard", "prepare for a job interview", "train for a 5 km run", "fold a paper crane",
              "back up my phone", "make a paper airplane", "start a compost heap", "learn to juggle"],
    "dish": ["pancakes", "tomato soup", "fried rice", "banana bread", "a green salad", "guacamole", "lentil curry",
             "scrambled eggs", "pizza dough", "oatmeal cookies", "lemonade", "a vegetable omelette"],
    "k": ["three", "four", "five", "six"],
    "listable": ["fruits that are high in vitamin C", "famous painters", "board games for families",
                 "ways to save energy at home", "countries in South America", "books for teenagers",
                 "indoor plants that are easy to keep", "habits of good writers", "uses of vinegar"],
    "a": ["tea", "cats", "trains", "summer", "e-books", "running", "solar power", "cities"],
    "b": ["coffee", "dogs", "planes", "winter", "paper books", "swimming", "wind power", "the countryside"],
    "story": ["Cinderella", "Hamlet", "The Odyssey", "Little Red Riding Hood", "Frankenstein",
              "The Three Little Pigs", "Moby-Dick", "Snow White", "Macbeth", "Alice in Wonderland"],
    "genre": ["poem", "story", "limerick", "song verse", "diary entry", "news report", "dialogue"],
    "subject": ["a rainy morning", "the ocean", "a lost key", "a mountain village", "a robot learning to paint",
                "the first day of school", "a snowstorm", "a busy market", "a lighthouse", "the night sky"],
    "whom": ["my landlord", "a colleague", "my manager", "a customer", "my neighbour", "a teacher"],
    "matter": ["a broken heater", "a missed deadline", "a schedule change", "a refund", "a noisy party",
               "a thank-you for their help", "a meeting next week"],
    "casual": ["hey, can you send me that file?", "we're gonna be late, sorry", "that movie was super good",
               "I can't make it tomorrow", "thanks a lot for the help", "where's the nearest station?"],
    "length": ["two-day", "three-day", "week-long", "weekend"],
    "place": ["Rome", "Kyoto", "Lisbon", "New York", "Cape Town", "Istanbul", "Mexico City", "Prague"],
    "phenomenon": ["ice float on water", "bread rise", "the moon change shape", "metal feel cold",
                   "a rainbow appear after rain", "the ocean taste salty", "leaves change colour in autumn"],
    "whatif": ["the Earth stopped spinning", "everyone spoke the same language", "there were no bees",
               "cars could fly", "we had no internet for a week", "the moon were closer"],
    "occasion": ["a birthday party", "a rainy weekend", "a team-building day", "a school science fair",
                 "a picnic", "a small wedding"],
    "game": ["chess", "tic-tac-toe", "volleyball", "poker", "checkers", "cricket", "sudoku"],
    "term": ["photosynthesis", "inflation", "a metaphor", "an algorithm", "democracy", "friction",
             "a prime number", "an ecosystem", "irony", "compound interest"],
}


def instruct_prompts(n: int, seed: int = 0) -> list[str]:
    """`n` distinct requests of many kinds (INSTRUCT_KINDS with INSTRUCT_SLOTS filled at random)."""
    r = random.Random(seed)

    def draw() -> Iterator[str]:
        while True:
            template, _ = r.choice(INSTRUCT_KINDS)
            yield template.format(**{k: r.choice(v) for k, v in INSTRUCT_SLOTS.items()})

    return _distinct(draw(), n, key=lambda s: s)


# `broad`: a drafter's training mix. Instruct and chat requests (up to the distinct ones their
# templates give), then reasoning-gym questions from these datasets in equal shares, every other
# one asking for worked steps as bench spec's reasoning prompts do; shuffled by the seed.
BROAD_RG = ("aiw", "base_conversion", "basic_arithmetic", "bitwise_arithmetic", "caesar_cipher",
            "calendar_arithmetic", "chain_sum", "coin_flip", "count_bits", "decimal_arithmetic", "dice",
            "family_relationships", "fraction_simplification", "gcd", "gsm_symbolic", "lcm", "leg_counting",
            "letter_counting", "letter_jumble", "number_filtering", "number_sorting", "palindrome_generation",
            "power_function", "prime_factorization", "products", "propositional_logic", "sentence_reordering",
            "simple_equations", "spell_backward", "syllogism", "time_intervals", "word_sorting",
            "word_sequence_reversal", "string_manipulation")
BROAD_SHARES = (("instruct", 0.115, 560), ("chat", 0.125, 600))  # (source, share of n, at most)
WORKED_STEPS = " Think step by step."


def broad_prompts(n: int, seed: int = 0) -> list[str]:
    """`n` distinct prompts of the `broad` mix (above)."""
    out = []
    for source, share, cap in BROAD_SHARES:
        out += make_prompts(source, min(round(share * n), cap), seed)
    rest = n - len(out)
    for i, name in enumerate(BROAD_RG):
        m = rest // len(BROAD_RG) + (i < rest % len(BROAD_RG))
        qs = [t.question.strip() for t in rg_tasks(RG_PREFIX + name, m, seed + i)]
        out += [q + (WORKED_STEPS if j % 2 else "") for j, q in enumerate(qs)]
    random.Random(seed).shuffle(out)
    return out


# ---- one entry point ---------------------------------------------------------------------------

def make_prompts(source: str, n: int, seed: int = 0) -> list[str]:
    """`n` user prompts from `source`: "chat", "tasks", "mixed" (both, alternating), "instruct"
    (many kinds of request), "broad" (instruct, chat and 34 reasoning-gym datasets),
    reasoning-gym's datasets (`rg:<dataset>[,<dataset>]`), a file (one prompt per line, or JSON
    lines with a "prompt" field), or several of these joined by "+" (taken in turn:
    "instruct+rg:chain_sum")."""
    if n < 0:
        raise ValueError(f"number of prompts must be >= 0, got {n}")
    check_source(source)
    if "+" in source:
        parts = source.split("+")
        drawn = [make_prompts(part, (n - i + len(parts) - 1) // len(parts), seed)
                 for i, part in enumerate(parts)]
        return [p for group in itertools.zip_longest(*drawn) for p in group if p is not None]
    if source == "instruct":
        return instruct_prompts(n, seed)
    if source == "broad":
        return broad_prompts(n, seed)
    if source == "chat":
        return chat_prompts(n, seed)
    if source == "tasks":
        return [t.question for t in tasks(n, seed)]
    if source == "mixed":
        chat, task = chat_prompts((n + 1) // 2, seed), [t.question for t in tasks(n // 2, seed)]
        return [p for pair in zip(chat, task) for p in pair] + chat[len(task):]
    if source.startswith(RG_PREFIX):
        return [t.question for t in rg_tasks(source, n, seed)]
    path = Path(source).expanduser()
    lines = [ln for ln in path.read_text().splitlines() if ln.strip()]
    out = [json.loads(ln)["prompt"] if ln.lstrip().startswith("{") else ln for ln in lines]
    if len(out) < n:
        raise ValueError(f"prompts file {str(path)!r} has {len(out)} prompts; {n} are asked for")
    return out[:n]


def check_source(source: str) -> None:
    """Refuse a prompt source that is none of PROMPT_SOURCES, `rg:<dataset>`, a file, or several
    of these joined by "+"."""
    if "+" in source:
        for part in source.split("+"):
            check_source(part)
    elif source.startswith(RG_PREFIX):
        rg_names(source)
    elif source not in PROMPT_SOURCES and not Path(source).expanduser().is_file():
        raise ValueError(f"prompts {source!r} is neither one of {list(PROMPT_SOURCES)}, "
                         f"{RG_PREFIX}<reasoning-gym dataset>, nor a file")


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
