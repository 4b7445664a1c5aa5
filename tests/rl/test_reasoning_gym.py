"""reasoning-gym tasks (`rg:<dataset>`): prompts are its own questions for the seed, the accuracy
reward is its own scorer, and bad names or options are refused with what is allowed."""

from __future__ import annotations

import importlib.util
import sys

import pytest

from reclaim.config import ConfigError, load_config
from reclaim.data.tasks import make_prompts, rg_tasks, tasks
from reclaim.rl.data import build_dataset
from reclaim.rl.grpo_config import GRPOConfig
from reclaim.rl.rewards import accuracy_reward, format_reward, score


if importlib.util.find_spec("reasoning_gym") is None:
    pytest.skip("reasoning_gym is not installed (the `tasks` extra)", allow_module_level=True)


@pytest.fixture
def rg():
    """reasoning_gym, imported by the tests that use it, not at collection: its tasks import
    matplotlib and more, a second of every test worker's start."""
    import reasoning_gym

    return reasoning_gym

EASY = {"min_terms": 2, "max_terms": 2, "max_digits": 2, "operators": ["+", "-"], "allow_parentheses": False,
        "allow_negation": False}


def test_prompts_are_reasoning_gyms_questions_for_the_seed(rg):
    want = [e["question"] for e in rg.create_dataset("leg_counting", seed=3, size=6)]
    assert make_prompts("rg:leg_counting", 6, seed=3) == want
    assert make_prompts("rg:leg_counting", 6, seed=4) != want
    # several datasets: their entries 0, 1, ... in turn
    a, c = rg.create_dataset("basic_arithmetic", seed=5, size=3), rg.create_dataset("chain_sum", seed=5, size=3)
    drawn = rg_tasks("rg:basic_arithmetic,chain_sum", 6, seed=5)
    assert [t.question for t in drawn] == [e["question"] for i in range(3) for e in (a[i], c[i])]
    assert [t.answer for t in drawn] == [e["answer"] for i in range(3) for e in (a[i], c[i])]
    assert [t.family for t in drawn] == ["rg:basic_arithmetic", "rg:chain_sum"] * 3


def test_grpo_rows_carry_reasoning_gyms_entries_with_the_configs_options(rg):
    cfg = load_config(GRPOConfig, None, {"task": "rg:basic_arithmetic", "task_config": {"basic_arithmetic": EASY},
                                         "num_prompts": 8, "seed": 7})
    rows = build_dataset(cfg)
    ds = rg.create_dataset("basic_arithmetic", seed=7, size=8, **EASY)
    assert [r["entry"] for r in rows] == [ds[i] for i in range(8)]
    assert [r["question"] for r in rows] == [ds[i]["question"] for i in range(8)]
    for r in rows:  # the user message is the config's template around reasoning-gym's question
        assert r["prompt"] == [{"role": "user", "content": cfg.prompt_template.format(question=r["question"])}]
        assert r["task"] == "rg:basic_arithmetic" and r["answer"] == r["entry"]["answer"]
    # the bundled config loads and draws its prompts
    bundled = load_config(GRPOConfig, "grpo-smollm2-rg", {"num_prompts": 4})
    assert bundled.task == "rg:basic_arithmetic" and len(build_dataset(bundled)) == 4
    cot = load_config(GRPOConfig, "grpo-smollm2-rg-cot", {"num_prompts": 4})
    assert cot.task == "rg:chain_sum" and len(build_dataset(cot)) == 4
    # a command-line override reads the same
    cli = load_config(GRPOConfig, None, ["--task", "rg:chain_sum", "--task_config", "{chain_sum: {max_terms: 2}}"])
    assert cli.task_config == {"chain_sum": {"max_terms": 2}}


def test_accuracy_reward_is_reasoning_gyms_score(rg):
    from reasoning_gym.utils import extract_answer as rg_extract_answer

    cfg = load_config(GRPOConfig, None, {"task": "rg:basic_arithmetic,chain_sum,leg_counting", "num_prompts": 6,
                                         "task_config": {"basic_arithmetic": EASY}})
    rows = build_dataset(cfg)
    texts, rep = [], []
    for r in rows:
        for text in (f"So it is <answer>{r['answer']}</answer>", f"<answer>{r['answer']}9</answer>",
                     f"<answer>x = {r['answer']}</answer>", f"<answer>{r['answer']}.0</answer>", "no idea"):
            texts.append([{"role": "assistant", "content": text}])
            rep.append(r)
    columns = {k: [r[k] for r in rep] for k in rows[0] if k != "prompt"}  # as the rollout passes them
    got = score([accuracy_reward, format_reward], ["accuracy", "format"], [r["prompt"] for r in rep], texts,
                [[1]] * len(texts), columns)
    scorers = {n: rg.create_dataset(n, seed=0, size=1, **(EASY if n == "basic_arithmetic" else {}))
               for n in ("basic_arithmetic", "chain_sum", "leg_counting")}
    want = [scorers[r["task"][3:]].score_answer(rg_extract_answer(t[0]["content"]), r["entry"])
            for t, r in zip(texts, rep)]
    assert got[:, 0].tolist() == pytest.approx(want)
    assert {0.0, 1.0} <= set(want) and any(0 < w < 1 for w in want)  # right, wrong and partly right occur
    assert got[:, 1].tolist() == format_reward([], texts, [])  # the format reward is the same for every task


def test_builtin_families_are_unchanged_beside_rg_tasks():
    rows = build_dataset(load_config(GRPOConfig, None, {"task": "add_word", "num_prompts": 3}))
    assert set(rows[0]) == {"prompt", "answer", "task", "question"}
    comps = [[{"role": "assistant", "content": f"<answer>{r['answer']}</answer>"}] for r in rows]
    assert accuracy_reward([], comps, [], answer=[r["answer"] for r in rows], task=[r["task"] for r in rows]) == [1.0] * 3
    assert [t.question for t in tasks(5, seed=1)] == make_prompts("tasks", 5, seed=1)


def test_unknown_datasets_and_options_are_refused_with_what_is_allowed():
    with pytest.raises(ValueError, match=r"unknown reasoning-gym dataset \['leg_countin'\].*leg_counting"):
        make_prompts("rg:leg_countin", 4)
    with pytest.raises(ValueError, match=r"unknown reasoning-gym dataset \['no_such_task'\].*basic_arithmetic"):
        rg_tasks("rg:chain_sum,no_such_task", 4)
    with pytest.raises(ConfigError, match=r"no_such_task.*allowed"):
        load_config(GRPOConfig, None, {"task": "rg:no_such_task"})
    with pytest.raises(ConfigError, match=r"has no option\(s\) \['max_term'\]; allowed: .*'max_terms'"):
        load_config(GRPOConfig, None, {"task": "rg:chain_sum", "task_config": {"chain_sum": {"max_term": 2}}})
    with pytest.raises(ConfigError, match=r"refused options .*max_terms must be >= min_terms"):
        load_config(GRPOConfig, None, {"task": "rg:chain_sum", "task_config": {"chain_sum": {"max_terms": 0}}})
    with pytest.raises(ConfigError, match=r"options for reasoning-gym dataset\(s\) \['leg_counting'\]"):
        load_config(GRPOConfig, None, {"task": "rg:chain_sum", "task_config": {"leg_counting": {}}})
    with pytest.raises(ConfigError, match=r"task_config sets options of reasoning-gym datasets"):
        load_config(GRPOConfig, None, {"task": "add_word", "task_config": {"chain_sum": {}}})
    one = {"min_animals": 1, "max_animals": 1, "min_instances": 1, "max_instances": 1}  # one of each animal
    with pytest.raises(ValueError, match=r"gave only \d+ distinct questions"):
        rg_tasks("rg:leg_counting", 500, options={"leg_counting": one})
    with pytest.raises(ValueError, match=r"needs the row's 'entry'"):
        accuracy_reward([], ["<answer>1</answer>"], [], answer=["1"], task=["rg:chain_sum"])


def test_missing_reasoning_gym_says_how_to_install(monkeypatch):
    monkeypatch.setitem(sys.modules, "reasoning_gym", None)  # import reasoning_gym now raises ImportError
    with pytest.raises(ImportError, match=r"needs reasoning-gym: pip install 'reclaim\[tasks\]'"):
        make_prompts("rg:leg_counting", 2)


def test_sources_joined_by_plus_take_turns_and_instruct_prompts_are_distinct():
    """"a+b" gives a's and b's own prompts (each drawn as if alone) in turn; "instruct" draws
    distinct requests; an unknown part is refused by name."""
    from reclaim.data.tasks import instruct_prompts

    joined = make_prompts("instruct+rg:chain_sum+tasks", 7, seed=3)
    assert joined[0::3] == make_prompts("instruct", 3, seed=3)
    assert joined[1::3] == make_prompts("rg:chain_sum", 2, seed=3)
    assert joined[2::3] == make_prompts("tasks", 2, seed=3)
    many = instruct_prompts(400, seed=0)
    assert len(set(many)) == 400 and instruct_prompts(400, seed=0) == many
    with pytest.raises(ValueError, match="'nonsense'"):
        make_prompts("instruct+nonsense", 4)


def test_the_broad_mix_is_instruct_chat_and_every_listed_dataset_half_with_worked_steps():
    """`broad` holds its shares of instruct and chat prompts (each source's own, drawn with the
    seed) and an equal share of every BROAD_RG dataset's questions, every other one asking for
    worked steps; all distinct, shuffled, and the same for the same seed."""
    from reclaim.data.tasks import BROAD_RG, WORKED_STEPS, rg_tasks

    n = 179  # 21 instruct, 22 chat, 4 questions of each of the 34 datasets
    mix = make_prompts("broad", n, seed=4)
    assert len(mix) == n == len(set(mix)) and mix == make_prompts("broad", n, seed=4)
    assert mix != make_prompts("broad", n, seed=5)
    instruct, chat = make_prompts("instruct", round(0.115 * n), 4), make_prompts("chat", round(0.125 * n), 4)
    assert set(instruct) | set(chat) <= set(mix)
    rg = [q for q in mix if q not in set(instruct) | set(chat)]
    assert len(rg) == n - len(instruct) - len(chat)
    assert len(rg) == 4 * len(BROAD_RG) == 136
    for i, name in enumerate(BROAD_RG):  # each dataset's first 4 questions, made with seed + i
        qs = [t.question.strip() for t in rg_tasks("rg:" + name, 4, seed=4 + i)]
        assert {qs[0], qs[1] + WORKED_STEPS, qs[2], qs[3] + WORKED_STEPS} <= set(rg)
    assert sum(q.endswith(WORKED_STEPS) for q in rg) == 68
