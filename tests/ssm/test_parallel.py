"""Parallel and distributed adjoint shards give autograd's gradients (fp64, tight tolerance).

The distributed checks run this file on two gloo ranks, started as `torchrun --standalone
--nproc_per_node=2` starts them (tests/ranks.py):
every rank builds the same model, computes the autograd reference locally, runs the sharded
backward and reports its worst relative error per parameter it is responsible for.
"""

from __future__ import annotations

import copy
import json
import os
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from reclaim.ssm import parallel as P

# (layers, tokens, chunk, tied head): uneven layer blocks, chunks not dividing T, chunk 1.
CASES = [(2, 37, 5, True), (3, 40, 8, False), (4, 9, 1, True)]
# Truncated (case, windows): on 2 ranks case 0's segments are 20 and 17 tokens, case 1's 16 and
# 24; windows below, equal to and above a segment, spanning both, and >= T (exact).
TRUNCATED = [(CASES[0], (3, 17, 20, 30, 37)), (CASES[1], (5, 16, 24, 100))]


def tiny_model(n_layer: int, tie: bool = True, seed: int = 0) -> torch.nn.Module:
    from reclaim.models.mamba import MambaConfig, MambaForCausalLM

    torch.manual_seed(seed)
    cfg = MambaConfig(vocab_size=50, hidden_size=16, state_size=4, num_hidden_layers=n_layer,
                      expand=2, conv_kernel=4, time_step_rank=2, tie_word_embeddings=tie)
    model = MambaForCausalLM(cfg).double()
    with torch.no_grad():  # spread the decays so states carry information across chunks
        for layer in model.backbone.layers:
            layer.mixer.dt_proj.bias.uniform_(-4.0, 0.0)
    return model


# Time sharding of the other families (kind, tokens, chunk, windows): on 2 ranks 37 tokens in
# chunks of 5 split 20 / 17, 40 in chunks of 8 split 16 / 24; Mamba-2 windows are >= a chunk,
# below, equal to and above a segment and >= T (exact).
FAMILIES = [("mamba2", 37, 5, (5, 17, 25, 37)), ("hybrid", 40, 8, (8, 16, 30, 40)), ("bamba", 40, 8, (16, 40))]


def family_model(kind: str, seed: int = 0) -> torch.nn.Module:
    """A small random float64 Mamba-2 LM, a hybrid of Mamba-2, attention (one layer of each first)
    and MLP layers, or a Bamba one; every parameter perturbed so no gradient is trivially zero."""
    from reclaim.models.mamba2 import Mamba2Config, Mamba2ForCausalLM
    from reclaim.models.nemotron_h import NemotronHConfig, NemotronHForCausalLM

    torch.manual_seed(seed)
    ssd = dict(vocab_size=50, hidden_size=12, n_groups=3, time_step_min=0.05, time_step_max=0.5)
    if kind == "mamba2":
        model = Mamba2ForCausalLM(Mamba2Config(num_hidden_layers=3, state_size=4, num_heads=6,
                                               head_dim=4, **ssd))
    elif kind == "bamba":  # attention with RoPE at its global positions on either rank
        from reclaim.models.bamba import BambaConfig, BambaForCausalLM

        model = BambaForCausalLM(BambaConfig(vocab_size=50, hidden_size=12, intermediate_size=16, num_hidden_layers=3,
                                             attn_layer_indices=[0, 2], num_attention_heads=4, num_key_value_heads=2,
                                             mamba_n_heads=6, mamba_n_groups=3, mamba_d_state=4))
    else:
        model = NemotronHForCausalLM(NemotronHConfig(
            layers_block_type=["full_attention", "linear_attention", "mlp", "full_attention",
                               "linear_attention"],
            num_attention_heads=4, num_key_value_heads=2, head_dim=3, intermediate_size=20,
            ssm_state_size=4, mamba_num_heads=6, mamba_head_dim=3, **ssd))
    model = model.double()
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.1)
    return model


def reference(model: torch.nn.Module, ids: torch.Tensor) -> tuple[float, dict[str, torch.Tensor]]:
    """Loss and gradients from one autograd backward through the model's own forward."""
    model.zero_grad(set_to_none=True)
    out = model(ids)
    logits = getattr(out, "logits", out)
    loss = F.cross_entropy(logits[:, :-1].flatten(0, 1), ids[:, 1:].flatten())
    loss.backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters()}
    model.zero_grad(set_to_none=True)
    return loss.item(), grads


def worst_error(model, ref: dict[str, torch.Tensor], only=None) -> float:
    ids = None if only is None else {id(p) for p in only}
    errs = [((p.grad - ref[n]).abs().max() / ref[n].abs().max().clamp_min(1e-300)).item()
            for n, p in model.named_parameters() if ids is None or id(p) in ids]
    return max(errs)


def test_waves_cover_every_shard_once_after_its_dependencies() -> None:
    for n_layers, n_chunks in [(1, 1), (3, 5), (4, 2)]:
        wave_of = {}
        for w, cells in enumerate(P.waves(n_layers, n_chunks)):
            assert len({c.layer for c in cells}) == len(cells)  # one cell per layer: no grad races
            for c in cells:
                wave_of[c] = w
        assert len(wave_of) == n_layers * n_chunks
        for c, w in wave_of.items():
            for dep in (P.Cell(c.layer + 1, c.chunk), P.Cell(c.layer, c.chunk + 1)):
                assert wave_of.get(dep, -1) < w


def test_blocks_and_segments_partition() -> None:
    assert P.layer_blocks(5, 2) == [range(0, 2), range(2, 5)]
    assert P.time_segments(3, 3) == [range(0, 1), range(1, 2), range(2, 3)]
    with pytest.raises(ValueError, match="3 layers over 4 ranks"):
        P.layer_blocks(3, 4)


@pytest.mark.parametrize("n_layer,length,chunk,tie", CASES)
def test_wavefront_equals_autograd(n_layer, length, chunk, tie) -> None:
    model = tiny_model(n_layer, tie)
    ids = torch.randint(0, 50, (2, length))
    loss, ref = reference(model, ids)
    got = P.wavefront_loss_backward(model, ids, chunk=chunk, workers=2, loss_chunk=7)
    assert got == pytest.approx(loss, rel=1e-12)
    assert worst_error(model, ref) < 1e-9


def test_wavefront_truncated_equals_single_process_truncated() -> None:
    from reclaim.ssm.adjoint import adjoint_loss_backward

    model = tiny_model(3)
    ids = torch.randint(0, 50, (1, 40))
    adjoint_loss_backward(model, ids, chunk=6, window=9, loss_chunk=7)
    ref = {n: p.grad.clone() for n, p in model.named_parameters()}
    model.zero_grad(set_to_none=True)
    P.wavefront_loss_backward(model, ids, chunk=6, window=9, workers=2, loss_chunk=7)
    assert worst_error(model, ref) < 1e-9


def _worker() -> None:
    """One torchrun rank: every case, both sharding schemes, against the local autograd result
    (exact) or the single-process truncated adjoint (window)."""
    import torch.distributed as dist

    from reclaim.ssm.adjoint import adjoint_loss_backward

    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.set_num_threads(1)
    results = []
    for n_layer, length, chunk, tie in CASES:
        model = tiny_model(n_layer, tie)
        ids = torch.randint(0, 50, (2, length), generator=torch.Generator().manual_seed(length))
        loss, ref = reference(model, ids)
        for scheme, fn in (("layer", P.layer_sharded_loss_backward),
                           ("time", P.time_sharded_loss_backward)):
            model.zero_grad(set_to_none=True)
            got = fn(model, ids, chunk=chunk, loss_chunk=7)
            only = P.stage_parameters(model, rank, world) if scheme == "layer" else None
            err = worst_error(model, ref, only)
            # Calling again accumulates, as loss.backward() would: gradients double.
            fn(model, ids, chunk=chunk, loss_chunk=7)
            err2 = worst_error(model, {n: 2 * g for n, g in ref.items()}, only)
            results.append({"case": [n_layer, length, chunk, tie], "scheme": scheme, "rank": rank,
                            "loss_err": abs(got - loss) / loss, "grad_err": max(err, err2)})
        # A rank that keeps only its block holds only its stage's parameters and gets the same.
        stage = copy.deepcopy(model)
        P.free_other_stages(stage, rank, world)
        own = P.stage_parameters(stage, rank, world)
        held = sum(p.numel() for p in P._unique_parameters(stage))
        assert held == sum(p.numel() for p in own) < sum(p.numel() for p in model.parameters())
        got = P.layer_sharded_loss_backward(stage, ids, chunk=chunk, loss_chunk=7)
        results.append({"case": [n_layer, length, chunk, tie], "scheme": "layer-freed",
                        "rank": rank, "loss_err": abs(got - loss) / loss,
                        "grad_err": worst_error(stage, ref, own)})
    for (n_layer, length, chunk, tie), windows in TRUNCATED:
        model = tiny_model(n_layer, tie)
        ids = torch.randint(0, 50, (2, length), generator=torch.Generator().manual_seed(length))
        for w in windows:
            if w >= length:  # a window spanning the sequence is the exact gradient: autograd's
                loss, ref = reference(model, ids)
            else:
                loss = adjoint_loss_backward(model, ids, chunk=chunk, window=w, loss_chunk=7)
                ref = {n: p.grad.clone() for n, p in model.named_parameters()}
            for scheme, fn in (("layer", P.layer_sharded_loss_backward),
                               ("time", P.time_sharded_loss_backward)):
                model.zero_grad(set_to_none=True)
                got = fn(model, ids, chunk=chunk, window=w, loss_chunk=7)
                only = P.stage_parameters(model, rank, world) if scheme == "layer" else None
                results.append({"case": [n_layer, length, chunk, tie], "window": w,
                                "scheme": scheme, "rank": rank, "loss_err": abs(got - loss) / loss,
                                "grad_err": worst_error(model, ref, only)})
            model.zero_grad(set_to_none=True)
    for kind, length, chunk, windows in FAMILIES:
        model = family_model(kind)
        ids = torch.randint(0, 50, (2, length), generator=torch.Generator().manual_seed(length))
        for w in (None, *windows):  # exact: one process's autograd; truncated: its adjoint
            if w is None or w >= length:
                loss, ref = reference(model, ids)
            else:
                model.zero_grad(set_to_none=True)
                loss = adjoint_loss_backward(model, ids, chunk=chunk, window=w, loss_chunk=7)
                ref = {n: p.grad.clone() for n, p in model.named_parameters()}
            model.zero_grad(set_to_none=True)
            got = P.time_sharded_loss_backward(model, ids, chunk=chunk, window=w, loss_chunk=7)
            results.append({"case": [kind, length, chunk], "window": w, "scheme": "time",
                            "rank": rank, "loss_err": abs(got - loss) / loss,
                            "grad_err": worst_error(model, ref)})
            model.zero_grad(set_to_none=True)
    Path(os.environ["RECLAIM_TEST_OUT"], f"rank{rank}.json").write_text(json.dumps(results))
    dist.destroy_process_group()


@pytest.mark.launches
def test_layer_and_time_sharded_equal_one_process_on_two_gloo_ranks(tmp_path) -> None:
    from ranks import ranks  # tests/ranks.py: the script's ranks as torchrun starts them

    ranks(__file__, env={"RECLAIM_TEST_OUT": str(tmp_path)}, timeout=300)
    results = [r for rank in (0, 1)
               for r in json.loads((tmp_path / f"rank{rank}.json").read_text())]
    assert len(results) == 2 * (3 * len(CASES) + 2 * sum(len(w) for _, w in TRUNCATED)
                                + sum(1 + len(w) for *_, w in FAMILIES))
    for r in results:
        assert r["loss_err"] < 1e-12 and r["grad_err"] < 1e-9, r


if __name__ == "__main__":
    _worker()
