"""lm-evaluation-harness itself (`local-completions`, loglikelihood) on a tiny multiple-choice
task written here, against a live server: the run completes with a score, and the harness's
per-choice loglikelihoods equal a full forward's log_softmax."""

from __future__ import annotations

import json

import pytest
import torch

pytestmark = pytest.mark.slow

QUESTIONS = [
    ("The quick brown", [" fox", " dog", " cat"], 0),
    ("Hello, world! How are", [" you", " we", " they"], 0),
    ("Numbers: 0 1 2", [" 3", " 7", " 100"], 0),
    ("Unicode: café,", [" naïve", " coffee"], 0),
]


@torch.no_grad()
def loglikelihood(model, context: list[int], continuation: list[int]) -> float:
    ids = context + continuation
    logp = torch.log_softmax(model(torch.tensor([ids])).logits[0, :-1].double(), -1)
    return sum(float(logp[len(context) - 1 + i, t]) for i, t in enumerate(continuation))


def test_lm_eval_multiple_choice_task(server, tmp_path):
    lm_eval = pytest.importorskip("lm_eval")
    from lm_eval.tasks import TaskManager

    tok_dir = tmp_path / "tokenizer"
    server.tokenizer.save_pretrained(tok_dir)
    data = tmp_path / "data.jsonl"
    data.write_text("".join(json.dumps({"question": q, "choices": c, "answer": a}) + "\n"
                            for q, c, a in QUESTIONS))
    tasks = tmp_path / "tasks"
    tasks.mkdir()
    (tasks / "tiny_mc.yaml").write_text(f"""task: tiny_mc
dataset_path: json
dataset_kwargs:
  data_files:
    test: {data}
test_split: test
output_type: multiple_choice
doc_to_text: "{{{{question}}}}"
doc_to_choice: "{{{{choices}}}}"
doc_to_target: answer
target_delimiter: ""
metric_list:
  - metric: acc
""")
    results = lm_eval.simple_evaluate(
        model="local-completions",
        model_args=f"model=tiny-llama,base_url={server.url}/v1/completions,"
                   f"tokenizer_backend=huggingface,tokenizer={tok_dir},tokenized_requests=True,"
                   f"num_concurrent=1,max_retries=1",
        tasks=["tiny_mc"], task_manager=TaskManager(include_path=str(tasks)),
        log_samples=True, batch_size=4)
    acc = results["results"]["tiny_mc"]["acc,none"]
    assert 0.0 <= acc <= 1.0
    tok = server.tokenizer
    compared = 0
    for sample in results["samples"]["tiny_mc"]:
        question, choices, _ = QUESTIONS[sample["doc_id"]]
        for choice, (got, _greedy) in zip(choices, [r[0] for r in sample["resps"]]):
            want = loglikelihood(server.model, tok.encode(question), tok.encode(choice))
            assert got == pytest.approx(want, abs=1e-3)
            compared += 1
    assert compared == sum(len(c) for _, c, _ in QUESTIONS)
