"""The online-learning part of `reclaim demo`: the model learns a made-up fact from feedback while
it serves, every training step reusing the prompt's prefill.

Each round serves a question (its prefill recorded with autograd: `serve --learn`'s recorder), sends
the correction as feedback (the call POST /v1/feedback makes) and runs a training step between
engine steps, as the server does (`Colocated.after_step`); the step reuses the record. Before
training, the gradient of a reused record is checked against recomputing the prompt. Shown: the
answer before and after, and the log-probability of the correction under the trained question and
under a held-out paraphrase. The model's weights are restored at the end.

    from reclaim.online.demo import demo_online
    demo_online(model, tokenizer)   # ~15 s for SmolLM2-135M on a 2-core CPU
"""

from __future__ import annotations

import sys
import tempfile
import time
from typing import Any, TextIO

import torch

QUESTION = "What is the secret code of the Zorblax vault?"
HELD_OUT = "Tell me the code that opens the Zorblax vault."
CORRECTION = "The secret code of the Zorblax vault is 7-4-1-9."


def correction_logprob(model: torch.nn.Module, prompt: list[int], answer: list[int]) -> float:
    """Mean log-probability per token of `answer` after `prompt` (one no-grad forward)."""
    from reclaim.online.recorder import recompute_loss

    with torch.no_grad():
        loss, n = recompute_loss(model, [prompt], [answer])
    return -float(loss) / n


def demo_online(model: torch.nn.Module, tokenizer: Any, out: TextIO | None = None, *, rounds: int = 4,
                max_tokens: int = 20, learning_rate: float = 1e-4) -> dict[str, Any]:
    """Serve, correct, train (reusing the prefill) for `rounds` rounds; returns the figures shown.
    Trains `model` in place and restores its weights before returning."""
    from reclaim.engine.engine import Engine
    from reclaim.engine.request import SamplingParams
    from reclaim.models.tokenizer import encode_chat
    from reclaim.online.colocate import Colocated, key_of_request
    from reclaim.online.learner import OnlineLearner
    from reclaim.online.recorder import reuse_gradient_errors
    from reclaim.online.trainer import CostModel, OnlineTrainConfig

    out = out or sys.stdout
    t_start = time.perf_counter()
    was_training = model.training
    saved = {k: v.detach().clone() for k, v in model.state_dict().items()}
    grad_flags = [p.requires_grad for p in model.parameters()]
    for p in model.parameters():
        p.requires_grad_(True)
    tmp = tempfile.TemporaryDirectory(prefix="reclaim-demo-online-")
    learner = colocated = None
    try:
        prompt = encode_chat(tokenizer, [{"role": "user", "content": QUESTION}])
        held_out = encode_chat(tokenizer, [{"role": "user", "content": HELD_OUT}])
        # the correction ends the answer (EOS), so the trained model learns to stop after it
        text = CORRECTION + (tokenizer.eos_token or "")
        tokenize = lambda s: list(tokenizer.encode(s, add_special_tokens=False))  # noqa: E731
        answer = tokenize(text)
        before = {"trained": correction_logprob(model, prompt, answer),
                  "held_out": correction_logprob(model, held_out, answer)}
        check = {"grad_rel_err": reuse_gradient_errors(model, prompt, answer, {"exact": {}})["exact"]}
        out.write(f"gradient of a sample reusing the recorded prefill vs recomputing the prompt: "
                  f"relative error {check['grad_rel_err']:.1e} (fp32)\n")
        cfg = OnlineTrainConfig(output_dir=tmp.name, per_device_train_batch_size=1,
                                learning_rate=learning_rate, record="requested", save_steps=0)
        # the prompt is short next to the answer here: reuse always, to show the record path
        learner = OnlineLearner(model, cfg, tokenize=tokenize, cost=CostModel.fixed("reuse"))
        engine = Engine(model, tokenizer, max_num_seqs=4, max_model_len=512)
        colocated = Colocated(learner, engine)
        params = SamplingParams(temperature=0, max_tokens=max_tokens)

        def serve(ids: list[int], rid: str, record: bool) -> Any:
            engine.add_request(f"{rid}-0", ids, params, record=record)
            while engine.has_unfinished():
                outs = engine.step()
                colocated.log_finished(outs)
                done = [o for o in outs if o.finished]
                if done:
                    return done[0]
            raise RuntimeError(f"request {rid} ended without output")

        first = serve(prompt, "demo0", record=False)
        out.write(f">>> {QUESTION}\n{first.text.strip()}   [weights version {first.weights_version}]\n")
        out.write(f"feedback, correction: {CORRECTION!r}\n")
        steps = []
        for i in range(rounds):
            served = serve(prompt, f"demo{i + 1}", record=True)  # prefill recorded with autograd
            learner.feedback(key_of_request(served.request_id), 1, text)  # POST /v1/feedback's call
            entry = colocated.train_now()  # the engine is idle: a training step runs now
            d = entry["decisions"][0]
            steps.append({"step": entry["step"], "loss": entry["loss"], "action": d["action"],
                          "reason": d["reason"], "seconds": entry["seconds"]})
            out.write(f"  round {i + 1}: served v{served.weights_version}, trained step {entry['step']} "
                      f"({d['action']}: {d['reason']}), loss {entry['loss']:.3f}, {entry['seconds']:.2f} s\n")
        last = serve(prompt, "demo-after", record=False)
        other = serve(held_out, "demo-held-out", record=False)
        after = {"trained": correction_logprob(model, prompt, answer),
                 "held_out": correction_logprob(model, held_out, answer)}
        out.write(f">>> {QUESTION}\n{last.text.strip()}   [weights version {last.weights_version}]\n")
        out.write(f">>> {HELD_OUT}  (held out)\n{other.text.strip()}\n")
        out.write(f"log-probability per token of the correction: {before['trained']:.2f} -> "
                  f"{after['trained']:.2f} on the question, {before['held_out']:.2f} -> "
                  f"{after['held_out']:.2f} on the held-out paraphrase\n")
        seconds = time.perf_counter() - t_start
        return {"answer_before": first.text, "answer_after": last.text, "held_out_after": other.text,
                "logprob_before": before, "logprob_after": after, "steps": steps, **check,
                "reused_steps": sum(s["action"] == "reuse" for s in steps), "seconds": seconds}
    finally:
        if colocated is not None:
            colocated.close()
        if learner is not None:
            learner.log.close()
        tmp.cleanup()
        with torch.no_grad():
            model.load_state_dict(saved)
        for p, flag in zip(model.parameters(), grad_flags):
            p.requires_grad_(flag)
            p.grad = None
        model.train(was_training)
