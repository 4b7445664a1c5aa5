"""vLLM's side of `reclaim bench engine --against vllm`, run as a script by vLLM's own Python.

It imports vLLM and the standard library only (vLLM lives in a virtualenv of its own: its CPU
build pins its torch), reads a job from the JSON file named by argv[1] and writes the result to
argv[2]:

    job: {"model": dir, "dtype": "float32", "max_model_len": int, "max_num_seqs": int,
          "seed": int, "workloads": [{"name": str, "alone": bool, "decode_timed": bool (optional),
          "prompts": [[token ids]], "max_tokens": [int]}]}
    result: {"vllm_version": str, "workloads": {name: {"seconds": float,
             "outputs": [[token ids]], "decode_seconds": [float] (decode_timed only)}}}

Greedy, EOS ignored, every request asks for exactly its max_tokens. "alone": each prompt its
own generate call, one after another (batch 1); otherwise all prompts in one call, the engine
batching up to max_num_seqs at a time. "decode_timed": each prompt alone through the engine's
step loop, timed from its first token to its last. One warm-up call first, untimed.
"""

import json
import sys
import time


def main(job_path: str, out_path: str) -> None:
    with open(job_path) as f:
        job = json.load(f)
    from vllm import LLM, SamplingParams

    llm = LLM(model=job["model"], dtype=job["dtype"], max_model_len=job["max_model_len"],
              max_num_seqs=job["max_num_seqs"], seed=job["seed"])

    def run(prompts, max_tokens):
        params = [SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True) for n in max_tokens]
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
        return [list(o.outputs[0].token_ids) for o in outs]

    def decode_timed(i, prompt, n):
        engine = llm.llm_engine
        rid = f"decode-timed-{i}"
        engine.add_request(rid, {"prompt_token_ids": prompt},
                           SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True))
        first = None
        while True:
            for o in engine.step():
                if o.request_id == rid and first is None and o.outputs[0].token_ids:
                    first = time.perf_counter()
                if o.request_id == rid and o.finished:
                    return list(o.outputs[0].token_ids), time.perf_counter() - first

    first = job["workloads"][0]["prompts"][0]
    run([first, first], [4, 4])  # warm-up: first-call allocations, kernel selection
    result = {}
    for w in job["workloads"]:
        t = time.perf_counter()
        if w.get("decode_timed"):
            timed = [decode_timed(i, p, n) for i, (p, n) in enumerate(zip(w["prompts"], w["max_tokens"]))]
            result[w["name"]] = {"outputs": [o for o, _ in timed], "decode_seconds": [s for _, s in timed]}
        elif w["alone"]:
            result[w["name"]] = {"outputs": [run([p], [n])[0] for p, n in zip(w["prompts"], w["max_tokens"])]}
        else:
            result[w["name"]] = {"outputs": run(w["prompts"], w["max_tokens"])}
        result[w["name"]]["seconds"] = time.perf_counter() - t
        print(f"vllm {w['name']}: {result[w['name']]['seconds']:.2f} s", file=sys.stderr, flush=True)
    import vllm

    with open(out_path, "w") as f:
        json.dump({"vllm_version": vllm.__version__, "workloads": result}, f)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
