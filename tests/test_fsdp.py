"""FSDP2 applied from outside the model (reclaim/fsdp.py).

Two gloo ranks, each accumulating its half of four micro-batches under `accumulating` (one
reduce-scatter per step), with gradient checkpointing and tied embeddings, give the gradients,
the clipped norm and the gathered full weights of one process accumulating all four (float64:
the ranks' partial sums are added in another order, so the tolerance is 1e-12 relative, far
above float64 rounding, 1e-16, and far below any real difference; float32, which FSDP2 reduces
by another path, 1e-5). `shard_bytes`, the arithmetic
`reclaim plan` uses, equals what `fully_shard` holds per rank at world size 8 on PyTorch's fake
process group, for the bundled Qwen2.5-7B shape on the meta device.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).parent / "rl"))
from rl_helpers import rank_main, tiny_target, torchrun  # noqa: E402

from reclaim.fsdp import decoder_layers, shard_bytes  # noqa: E402

MODELS = Path(__file__).parents[1] / "reclaim" / "configs" / "models"


def _batches() -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return [torch.randint(0, 300, (2, 9), generator=g) for _ in range(4)]


def _loss(model, x: torch.Tensor) -> torch.Tensor:
    return model(x).logits.double().logsumexp(-1).sum()


DTYPES = {"float64": (torch.float64, 1e-12), "float32": (torch.float32, 1e-5)}  # dtype, relative tolerance


def _worker(out: Path) -> None:
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    from reclaim.fsdp import FullWeights, accumulating, clip_grad_norm_, parallelize

    dist.init_process_group("gloo")
    rank, size = dist.get_rank(), dist.get_world_size()
    torch.set_num_threads(1)
    results = {}
    for name, (dtype, _) in DTYPES.items():  # float32 reduces by another path in FSDP2 than float64
        model = tiny_target(300, tie_word_embeddings=True).to(dtype)
        parallelize(model, init_device_mesh("cpu", (size,)), gradient_checkpointing=True)
        mine = _batches()[rank::size]
        for k, x in enumerate(mine):
            with accumulating(model, last=k == len(mine) - 1):
                _loss(model, x).backward()
        norm = clip_grad_norm_(model.parameters(), 1.0)
        weights = {k: v.clone() for k, v in FullWeights(model).items()}  # every rank gathers
        grads = {k.replace("_checkpoint_wrapped_module.", ""): p.grad.full_tensor()
                 for k, p in model.named_parameters()}
        results[name] = {"norm": norm, "weights": weights, "grads": grads}
    if rank == 0:
        torch.save(results, out)
    dist.destroy_process_group()


@pytest.mark.launches
def test_two_fsdp_ranks_give_one_process_gradients(tmp_path) -> None:
    out = tmp_path / "rank0.pt"
    torchrun(__file__, str(out), timeout=300)
    for dtype_name, (dtype, tol) in DTYPES.items():
        got = torch.load(out)[dtype_name]
        model = tiny_target(300, tie_word_embeddings=True).to(dtype)
        for x in _batches():
            _loss(model, x).backward()
        norm = float(torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0))
        assert got["norm"] == pytest.approx(norm, rel=tol) and norm > 1.0  # it clipped
        for name, p in model.named_parameters():
            assert (p.grad - got["grads"][name]).abs().max() <= tol * p.grad.abs().max(), (dtype_name, name)
        assert set(got["weights"]) == set(model.state_dict())  # the names the engine's update_weights takes
        for name, w in model.state_dict().items():
            assert torch.equal(w, got["weights"][name]), (dtype_name, name)


def test_shard_bytes_equal_fully_shard_at_world_size_8() -> None:
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.testing._internal.distributed.fake_pg import FakeStore

    from reclaim.fsdp import parallelize
    from reclaim.models.llama import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig.from_hf(json.loads((MODELS / "qwen2.5-7b.json").read_text()))
    for rank in (0, 7):
        dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=8)
        try:
            with torch.device("meta"):
                model = LlamaForCausalLM(cfg)
            shapes = [(tuple(p.shape), p.element_size()) for p in model.parameters()]
            parallelize(model, init_device_mesh("cpu", (8,)), bf16=True)
            local = sum(p.to_local().numel() * p.to_local().element_size() for p in model.parameters())
        finally:
            dist.destroy_process_group()
        assert shard_bytes(shapes, 8, rank) == local
    assert local == 3_807_808_256  # 7.62e9 float32 parameters / 8


def test_bundled_model_shapes_load() -> None:
    from reclaim.models.llama import LlamaConfig

    params = {}
    for name in ("qwen2.5-7b", "qwen2.5-32b", "llama-3.1-8b"):
        cfg = LlamaConfig.from_hf(json.loads((MODELS / f"{name}.json").read_text()))
        h, kv = cfg.hidden_size, cfg.num_key_value_heads * cfg.head_dim
        layer = 2 * h * h + 2 * h * kv + 3 * h * cfg.intermediate_size + 2 * h
        bias = (h + 2 * kv) if cfg.qkv_bias else 0
        params[name] = cfg.num_hidden_layers * (layer + bias) + 2 * cfg.vocab_size * h + h
    assert params == {"qwen2.5-7b": 7_615_616_512, "qwen2.5-32b": 32_763_876_352, "llama-3.1-8b": 8_030_261_248}


def test_fsdp_refuses_a_model_without_decoder_layers() -> None:
    with pytest.raises(ValueError, match="Linear has neither: use parallelism 'ddp'"):
        decoder_layers(torch.nn.Linear(2, 2))


if __name__ == "__main__":
    rank_main(_worker, sys.argv[1])
