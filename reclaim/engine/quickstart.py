"""What `reclaim generate`, `reclaim chat` and `reclaim demo` do: the engine on a model, streamed.

Kept apart from cli.py so the commands stay one-liners and these functions can be called (and
tested) with any model, tokenizer and output stream.
"""

from __future__ import annotations

import sys
import time
from typing import Any, Iterable, TextIO

from reclaim.engine.engine import Engine
from reclaim.engine.request import RequestOutput, SamplingParams
from reclaim.models.tokenizer import encode_chat

DEMO_QUESTIONS = [
    "What is the capital of France?",
    "Give me three tips for staying focused.",
    "Explain what a neural network is in two sentences.",
    "Write a haiku about the sea.",
    "What is 12 times 12?",
    "Name three primary colors.",
    "Why do leaves change color in autumn?",
    "Suggest a name for a pet turtle.",
]


def stream(engine: Engine, prompt: str | list[int], params: SamplingParams, out: TextIO) -> RequestOutput:
    """Run one request, writing its text to `out` as it is produced; returns the final output."""
    rid = engine.add_request(None, prompt, params)
    final = None
    while final is None:
        for o in engine.step():
            if o.request_id == rid:
                out.write(o.delta_text)
                out.flush()
                final = o if o.finished else None
    out.write("\n")
    return final


def chat_loop(engine: Engine, params: SamplingParams, lines: Iterable[str], out: TextIO,
              interactive: bool = False) -> list[dict[str, str]]:
    """Answer each input line in turn, keeping the conversation; '/reset' clears it. Returns it."""
    history: list[dict[str, str]] = []
    if interactive:
        out.write("Chat with the model; '/reset' starts over, Ctrl-D quits.\n> ")
        out.flush()
    for line in lines:
        line = line.strip()
        if line == "/reset":
            history.clear()
        elif line:
            history.append({"role": "user", "content": line})
            reply = stream(engine, encode_chat(engine.tokenizer, history), params, out)
            history.append({"role": "assistant", "content": reply.text})
        if interactive:
            out.write("> ")
            out.flush()
    return history


def demo(model: Any, tokenizer: Any, *, max_tokens: int = 64, out: TextIO | None = None,
         max_model_len: int | None = None) -> dict[str, float]:
    """A batch of chat prompts through the engine at once; prints answers and tokens/s."""
    out = out or sys.stdout
    engine = Engine(model, tokenizer, max_num_seqs=len(DEMO_QUESTIONS), max_model_len=max_model_len or 1024)
    prompts = [encode_chat(tokenizer, [{"role": "user", "content": q}]) for q in DEMO_QUESTIONS]
    t = time.perf_counter()
    outs = engine.generate(prompts, SamplingParams(temperature=0, max_tokens=max_tokens))
    secs = time.perf_counter() - t
    for q, o in zip(DEMO_QUESTIONS, outs):
        out.write(f"\n>>> {q}\n{o.text.strip()}\n[{len(o.token_ids)} tokens, {o.finish_reason}]\n")
    tokens = sum(len(o.token_ids) for o in outs)
    out.write(f"\n{len(outs)} prompts batched: {tokens} tokens in {secs:.1f} s = {tokens / secs:.1f} tokens/s\n")
    return {"prompts": len(outs), "tokens": tokens, "seconds": secs, "tokens_per_s": tokens / secs}


SPEC_QUESTION = ("A shop sells 23 apples in the morning and 17 in the afternoon. Each apple costs 3 dollars. "
                 "How much money did the shop make? Think step by step.")
SPEC_FOLLOW_UP = "Now write the same solution again as a numbered list of steps."


def speculative_demo(model: Any, tokenizer: Any, speculative: Any, *, max_tokens: int = 96,
                     out: TextIO | None = None, max_model_len: int | None = None) -> dict[str, float]:
    """A two-turn chat decoded plainly, then speculatively: the same text, each turn's speed-up
    and tau. The second turn restates the first answer: a history drafter drafts it from the
    conversation itself (nothing trained or cached beforehand)."""
    out = out or sys.stdout
    params = SamplingParams(temperature=0, max_tokens=max_tokens)
    runs: dict[str, list[tuple[Any, float]]] = {}
    stats = {}
    for name, spec in (("plain", None), ("speculative", speculative)):
        engine = Engine(model, tokenizer, max_num_seqs=1, max_model_len=max_model_len or 2048, speculative=spec)
        engine.generate([encode_chat(tokenizer, [{"role": "user", "content": "Hi"}])[:8]],
                        SamplingParams(temperature=0, max_tokens=2))  # warm-up
        messages = [{"role": "user", "content": SPEC_QUESTION}]
        for _ in range(2):
            t = time.perf_counter()
            o = engine.generate([encode_chat(tokenizer, messages)], params)[0]
            runs.setdefault(name, []).append((o, time.perf_counter() - t))
            messages += [{"role": "assistant", "content": o.text}, {"role": "user", "content": SPEC_FOLLOW_UP}]
        stats = engine.spec_stats
    same = all(a.token_ids == b.token_ids for (a, _), (b, _) in zip(runs["plain"], runs["speculative"]))
    for turn, question in enumerate((SPEC_QUESTION, SPEC_FOLLOW_UP)):
        (plain, t_plain), (fast, t_fast) = runs["plain"][turn], runs["speculative"][turn]
        out.write(f"\n>>> {question}\n{fast.text.strip()}\n")
        out.write(f"[turn {turn + 1}: plain {len(plain.token_ids) / t_plain:.1f} tokens/s, speculative "
                  f"{len(fast.token_ids) / t_fast:.1f} tokens/s = {t_plain / t_fast:.2f}x]\n")
    t_plain, t_fast = (sum(t for _, t in runs[k]) for k in ("plain", "speculative"))
    tau = (stats["accepted"] + stats["verifies"]) / max(1, stats["verifies"])
    out.write(f"\nboth turns: speculative ({speculative.method}, up to {speculative.num_speculative_tokens} "
              f"tokens a step) {t_plain / t_fast:.2f}x plain, {tau:.2f} tokens per target forward; "
              f"same text as plain: {same}\n")
    return {"speedup": t_plain / t_fast, "tau": tau, "identical": float(same),
            "turn_speedups": [runs["plain"][k][1] / runs["speculative"][k][1] for k in range(2)]}
