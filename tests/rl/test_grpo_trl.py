"""GRPO against TRL's own code. The loss and its gradient: TRL's GRPOTrainer._compute_loss runs on
a transformers twin of the tiny policy (same weights), on the same batch, for each loss_type, with
and without the KL term and with old-policy log-probs that make clipping active. The advantages:
TRL's _generate_and_score_completions scores fixed completions, for each scale_rewards."""

from __future__ import annotations

import pytest
import torch
from rl_helpers import make_tokenizer, tiny_target

from reclaim.rl.logps import completion_logps, completion_mask

from reclaim.rl.loss import grpo_loss

trl = pytest.importorskip("trl")
transformers = pytest.importorskip("transformers")

# Groups of num_generations=2 share a prompt, as in GRPO: ours runs each prompt once (rl/logps.py).
PROMPTS = [[5, 6, 7, 8], [5, 6, 7, 8], [9, 10], [9, 10]]
COMPLETIONS = [[20, 21, 22], [23, 24, 25, 26, 27], [28], [29, 30, 31, 32]]
MAX_COMPLETION_LENGTH, GA, TEMPERATURE = 6, 2, 0.8
CHUNK = 3  # log-probs three completion positions at a time, as GRPO runs them (logits_chunk_size)


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    from datasets import Dataset

    tok = make_tokenizer()
    tok.pad_token = "<|endoftext|>"
    ours = tiny_target(len(tok))
    fields = {k: v for k, v in ours.config.to_hf().items() if k != "architectures"}
    hf = transformers.AutoModelForCausalLM.from_config(transformers.AutoConfig.for_model(**fields))
    missing, unexpected = hf.load_state_dict(ours.state_dict(), strict=False)
    assert not unexpected and all("rotary" in k for k in missing)
    path = tmp_path_factory.mktemp("hf") / "tiny"  # TRL loads its policy, and the reference for beta > 0, from here
    hf.save_pretrained(path)
    return ours, str(path), tok, Dataset.from_dict({"prompt": ["a b"] * 8})


def _trl_trainer(setup, tmp_path, reward_funcs=None, **kw):
    _, hf, tok, data = setup
    args = trl.GRPOConfig(output_dir=str(tmp_path), per_device_train_batch_size=4, num_generations=2,
                          max_completion_length=MAX_COMPLETION_LENGTH, gradient_accumulation_steps=GA,
                          temperature=TEMPERATURE, report_to="none", use_cpu=True, bf16=kw.pop("bf16", False),
                          gradient_checkpointing=False, **kw)
    zero = [lambda completions, **k: [0.0] * len(completions)]
    trainer = trl.GRPOTrainer(model=hf, reward_funcs=reward_funcs or zero,
                              args=args, train_dataset=data, processing_class=tok)
    trainer.current_gradient_accumulation_steps = GA
    trainer.model.train()
    return trainer


def _trl_inputs(pad: int, advantages, num_items, old=None, ref=None):
    """TRL's batch layout: prompts left-padded, completions right-padded, with masks."""
    p_len, c_len = max(map(len, PROMPTS)), max(map(len, COMPLETIONS))
    prompt_ids = torch.tensor([[pad] * (p_len - len(p)) + p for p in PROMPTS])
    prompt_mask = torch.tensor([[0] * (p_len - len(p)) + [1] * len(p) for p in PROMPTS])
    completion_ids = torch.tensor([c + [pad] * (c_len - len(c)) for c in COMPLETIONS])
    inputs = {"prompt_ids": prompt_ids, "prompt_mask": prompt_mask, "completion_ids": completion_ids,
              "completion_mask": completion_mask(COMPLETIONS).long(), "advantages": advantages,
              "num_items_in_batch": torch.tensor(num_items)}
    if old is not None:
        inputs["old_per_token_logps"] = old
    if ref is not None:
        inputs["ref_per_token_logps"] = ref
    return inputs


@pytest.mark.parametrize("loss_type", ["grpo", "bnpo", "dr_grpo", "dapo"])
@pytest.mark.parametrize("case", ["on_policy", "clipped_with_kl", "clipped_with_plain_kl"])
def test_loss_and_gradient_equal_trls(setup, tmp_path, loss_type, case, one_thread):
    ours, _, tok, _ = setup
    beta, eps, eps_high = (0.0, 0.2, None) if case == "on_policy" else (0.05, 0.1, 0.25)
    corrected = case != "clipped_with_plain_kl"  # TRL's default multiplies the KL term by the ratio
    trainer = _trl_trainer(setup, tmp_path, loss_type=loss_type, beta=beta, epsilon=eps, epsilon_high=eps_high,
                           use_bias_correction_kl=corrected)
    mask = completion_mask(COMPLETIONS)
    advantages = torch.tensor([1.2, -0.7, 0.4, -1.5])
    num_items = 2 * float(mask.sum())  # dapo: the whole step's tokens (this micro-batch is half of it)
    old = ref = None
    if beta:  # old-policy and reference log-probs off by up to +-0.5 nats
        with torch.no_grad():
            base, _ = completion_logps(ours, PROMPTS, COMPLETIONS, TEMPERATURE, chunk_size=CHUNK)
        g = torch.Generator().manual_seed(0)
        old = (base + (torch.rand(base.shape, generator=g) - 0.5)) * mask
        ref = (base + (torch.rand(base.shape, generator=g) - 0.5)) * mask

    ours.zero_grad(set_to_none=True)
    ours.train()
    logps, _ = completion_logps(ours, PROMPTS, COMPLETIONS, TEMPERATURE, chunk_size=CHUNK)
    loss, sums = grpo_loss(logps, advantages, mask, loss_type=loss_type, epsilon_low=eps,
                           epsilon_high=eps if eps_high is None else eps_high, beta=beta, old_logps=old,
                           ref_logps=ref, use_bias_correction_kl=corrected,
                           max_completion_length=MAX_COMPLETION_LENGTH, num_items_in_batch=num_items,
                           gradient_accumulation_steps=GA)
    loss.backward()

    model = trainer.model
    model.zero_grad(set_to_none=True)
    want = trainer._compute_loss(model, _trl_inputs(tok.pad_token_id, advantages, num_items, old, ref))
    want.backward()

    torch.testing.assert_close(loss, want.float(), atol=1e-6, rtol=1e-5)
    if beta:
        assert 0 < sums["clip_region"].item() < sums["tokens"].item()  # clipping is active on some tokens
        assert trainer._metrics["train"]["clip_ratio/region_mean"][-1] == pytest.approx(
            (sums["clip_region"] / sums["tokens"]).item())
        assert trainer._metrics["train"]["kl"][-1] == pytest.approx((sums["kl"] / sums["tokens"]).item(), rel=1e-5)
    theirs = dict(model.named_parameters())
    for name, p in ours.named_parameters():
        torch.testing.assert_close(p.grad, theirs[name].grad, atol=1e-6, rtol=1e-4, msg=name)


@pytest.mark.parametrize("scale_rewards", ["group", "batch", "none"])
def test_advantages_equal_trls(setup, tmp_path, scale_rewards, one_thread):
    """TRL scores fixed completions (its generation replaced) with two weighted reward functions,
    one of which leaves some completions unscored (None); the advantages it trains on equal ours."""
    from reclaim.rl.loss import group_advantages

    nan = float("nan")  # the reward functions below return None there
    table = torch.tensor([[1.0, 0.5], [0.0, nan], [2.0, 1.0], [2.0, 1.0], [0.0, 0.0], [1.0, nan],
                          [nan, nan], [3.0, 0.0]])

    def reward(j):
        def fn(prompts, completions, completion_ids, **kw):
            vals = [table[c[0] - 40, j].item() for c in completion_ids]
            return [None if v != v else v for v in vals]
        fn.__name__ = f"r{j}"
        return fn

    trainer = _trl_trainer(setup, tmp_path, reward_funcs=[reward(0), reward(1)], loss_type="dapo",
                           scale_rewards=scale_rewards, reward_weights=[1.0, 0.5])
    trainer._generate_single_turn = lambda prompt_ids, *a, **k: ([[40 + i, 41] for i in range(len(prompt_ids))], None)
    out = trainer._generate_and_score_completions([{"prompt": f"a b {i // 2}"} for i in range(8)])
    ours, _, _ = group_advantages(table, torch.tensor([1.0, 0.5]), 2, scale_rewards)
    torch.testing.assert_close(ours, out["advantages"].float(), atol=1e-6, rtol=1e-5)


def test_bf16_mixed_precision_equals_trls(setup, tmp_path, one_thread):
    """bf16: True runs the training forward under bfloat16 autocast as TRL's bf16 does: the loss
    and gradient equal TRL's with bf16 within bf16 rounding, and differ from the float32 ones."""
    from reclaim.rl.grpo import precision

    ours = setup[0]
    trainer = _trl_trainer(setup, tmp_path, loss_type="bnpo", bf16=True)
    mask = completion_mask(COMPLETIONS)
    advantages = torch.tensor([1.2, -0.7, 0.4, -1.5])
    grads, losses = {}, {}
    for bf16 in (True, False):
        ours.zero_grad(set_to_none=True)
        ours.train()
        with precision(bf16, ours):
            logps, _ = completion_logps(ours, PROMPTS, COMPLETIONS, TEMPERATURE, chunk_size=CHUNK)
        loss, _ = grpo_loss(logps, advantages, mask, loss_type="bnpo", epsilon_low=0.2, epsilon_high=0.2,
                            gradient_accumulation_steps=GA)
        loss.backward()
        losses[bf16], grads[bf16] = loss.detach(), {k: p.grad.clone() for k, p in ours.named_parameters()}
    model = trainer.model
    model.zero_grad(set_to_none=True)
    want = trainer._compute_loss(model, _trl_inputs(setup[2].pad_token_id, advantages, 0.0))
    want.backward()
    theirs = {k: p.grad for k, p in model.named_parameters()}
    torch.testing.assert_close(losses[True], want.float(), atol=1e-6, rtol=1e-5)

    def distance(ours_grads):  # relative, over all parameters together
        diff = sum(float((ours_grads[k] - theirs[k]).pow(2).sum()) for k in theirs)
        return (diff / sum(float(g.pow(2).sum()) for g in theirs.values())) ** 0.5

    assert all(g.dtype == torch.float32 for g in grads[True].values())
    # Measured: 1.0% from TRL's bf16 gradient, 2.6% for the float32 one.
    assert distance(grads[True]) < 0.02
    assert distance(grads[True]) < 0.5 * distance(grads[False])
