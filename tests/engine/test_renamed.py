"""Names changed for one vocabulary (`*Proposer` in the engine, `*Drafter` for the modules) keep
working for one release with a DeprecationWarning: `Engine(drafter=...)` and `Engine.drafter`
(now `proposer`), `reclaim.drafter.online.OnlineDrafter` (now `OnlineDrafterTrainer`)."""

import pytest

from reclaim.engine.engine import Engine
from reclaim.engine.history import SuffixProposer
from reclaim.engine.request import SamplingParams
from reclaim.engine.speculative import SpeculativeConfig

SUFFIX = SpeculativeConfig(method="suffix", max_batch=8, num_speculative_tokens=4)


def test_the_old_drafter_keyword_and_attribute_still_give_the_proposer(tiny):
    target, _ = tiny
    proposer = SuffixProposer()
    with pytest.warns(DeprecationWarning, match=r"Engine\(drafter=...\) is deprecated; pass proposer="):
        old = Engine(target, num_blocks=64, block_size=4, speculative=SUFFIX, drafter=proposer)
    assert old.proposer is proposer
    with pytest.warns(DeprecationWarning, match="Engine.drafter is deprecated; use Engine.proposer"):
        assert old.drafter is proposer
    new = Engine(target, num_blocks=64, block_size=4, speculative=SUFFIX, proposer=SuffixProposer())
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    prompt = [[5, 6, 7, 5, 6, 7, 5, 6]]
    assert old.generate(prompt, params)[0].token_ids == new.generate(prompt, params)[0].token_ids


def test_the_online_drafter_trainer_keeps_its_old_name():
    import reclaim.drafter.online as online

    with pytest.warns(DeprecationWarning, match="OnlineDrafter is deprecated; use OnlineDrafterTrainer"):
        assert online.OnlineDrafter is online.OnlineDrafterTrainer
    with pytest.raises(AttributeError, match="no attribute 'OnlineDrafterr'"):
        online.OnlineDrafterr
