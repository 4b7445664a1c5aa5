"""The speculative policy: what a step costs (`StepCosts`), which arm pays at a batch size
(`SpecGate`: plain or a drafting method, measured), and how deep each request drafts
(`DepthController`: its own acceptance against the measured cost of a draft token).
"""

from __future__ import annotations

from typing import Any

import torch


def expected_tokens(alpha: float, k: int) -> float:
    """Tokens a verification commits on average when each draft token is accepted with
    probability alpha, independently, up to the first rejection: 1 + alpha + ... + alpha^k."""
    return float(k + 1) if alpha >= 1 else (1 - alpha ** (k + 1)) / (1 - alpha)


class StepCosts:
    """What a decode step costs, measured on the engine's own steps: seconds as a line in its
    sequences B, verified draft tokens X and sequences that verified a draft V,
    s = a + b * B + c * X + d * V, fit by least squares over decayed sums (the last few hundred
    steps count). d is what verifying costs a sequence beyond its tokens (its tree mask, the
    acceptance rule, rolling its cache back); while the steps seen do not tell it from c (every
    draft as long), the line without it is fit. While every step ran at one batch size (a full
    batch decoding), a and b cannot be told apart: a + b * B is fit as one constant (b = 0), exact
    at the batch size seen. While the steps do not determine even that, `token_cost` answers None
    and the caller keeps its prior."""

    def __init__(self, decay: float = 0.99, min_steps: int = 8) -> None:
        self.decay, self.min_steps = decay, min_steps
        self._xtx = torch.zeros(4, 4, dtype=torch.float64)
        self._xty = torch.zeros(4, dtype=torch.float64)
        self.steps = 0
        self._fit: tuple[float, float, float, float] | None = None
        self._solved_at = -1  # steps seen when fit() last solved (determined or not)

    def observe(self, batch: int, drafted: int, seconds: float, verified: int | None = None) -> None:
        """One decode-only step: `batch` sequences, `drafted` draft tokens verified with them by
        `verified` of the sequences (default: all of them if any token was drafted)."""
        verified = (batch if drafted else 0) if verified is None else verified
        x = torch.tensor([1.0, batch, drafted, verified], dtype=torch.float64)
        self._xtx = self.decay * self._xtx + torch.outer(x, x)
        self._xty = self.decay * self._xty + x * seconds
        self.steps += 1

    def fit(self) -> tuple[float, float, float, float] | None:
        """(a, b, c, d) in seconds (b or d = 0 where the steps seen do not tell it apart), or
        None while they do not determine a and c (solved once per new step: every speculating
        sequence asks each step)."""
        if self._solved_at != self.steps and self.steps >= self.min_steps:
            self._solved_at, self._fit = self.steps, None
            for cols in ([0, 1, 2, 3], [0, 1, 2], [0, 2, 3], [0, 2]):
                idx = torch.tensor(cols)
                xtx, xty = self._xtx[idx][:, idx], self._xty[idx]
                scale = xtx.diagonal().sqrt().clamp_min(1e-12)
                m = xtx / torch.outer(scale, scale)  # unit diagonal: a fair condition number
                if torch.linalg.cond(m) < 1e6:
                    coef = [0.0] * 4
                    for i, value in zip(cols, (torch.linalg.solve(m, xty / scale) / scale).tolist()):
                        coef[i] = value
                    self._fit = tuple(coef)
                    break
        return self._fit

    def _share(self, batch: int, coef: int) -> float | None:
        """Fit coefficient `coef` (seconds) in plain steps of one of `batch` sequences (its
        1/batch share of a plain step): seconds * batch / (a + b * batch); None if unknown."""
        fit = self.fit()
        if fit is None:
            return None
        plain = fit[0] + fit[1] * batch
        return max(fit[coef], 0.0) * batch / plain if plain > 0 else None

    def token_cost(self, batch: int) -> float | None:
        """One more draft token of one of `batch` sequences, in plain steps of that sequence."""
        return self._share(batch, 2)

    def verify_cost(self, batch: int) -> float | None:
        """Verifying a draft at all, beyond its tokens, for one of `batch` sequences, in plain
        steps of that sequence."""
        return self._share(batch, 3)


class SpecGate:
    """Which way of decoding pays at a batch size, judged by what each yields: per batch size, a
    decayed mean of tokens committed per second over the decode steps of each arm ("plain", or
    a drafter's mode). The best arm runs (speculative arms not measured yet first); one step in
    `probe_every` goes to another arm in turn, so a change (a drafter that starts hitting, a
    batch that empties) is noticed. What TLT's bandit does per batch bucket, inside the engine."""

    def __init__(self, arms: tuple[str, ...] = ("plain", "spec"), probe_every: int = 16, decay: float = 0.8) -> None:
        if "plain" not in arms or len(arms) < 2:
            raise ValueError(f"gate arms {arms}: need 'plain' and at least one speculative arm")
        self.arms, self.probe_every, self.decay = arms, probe_every, decay
        self._rate: dict[tuple[int, str], float] = {}  # (batch, arm) -> tokens/s
        self._steps: dict[int, int] = {}

    def choose(self, batch: int) -> str:
        """The arm this step runs at `batch` running sequences."""
        n = self._steps[batch] = self._steps.get(batch, 0) + 1

        def rate(arm: str) -> float:
            got = self._rate.get((batch, arm))
            return got if got is not None else (float("-inf") if arm == "plain" else float("inf"))
        best = max(self.arms, key=rate)
        if n % self.probe_every:
            return best
        others = [a for a in self.arms if a != best]
        return others[(n // self.probe_every) % len(others)]

    def update(self, batch: int, arm: str, tokens: int, seconds: float) -> None:
        """A decode-only step's outcome: `tokens` committed in `seconds` by `arm`."""
        if seconds <= 0:
            return
        key, rate = (batch, arm), tokens / seconds
        old = self._rate.get(key)
        self._rate[key] = rate if old is None else self.decay * old + (1 - self.decay) * rate


class DepthController:
    """Each running request's draft depth from its own acceptance: the k in 0..max_depth that
    maximises expected tokens per step cost, E(k) / (1 + overhead + k * token_cost) (k = 0:
    plain decoding, cost 1). token_cost and overhead are measured (`costs`, a StepCosts the
    engine feeds) at the batch size the step runs at, the priors until measured: verifying costs more
    of a step as the batch grows, so depths shrink with it. The acceptance estimate counts
    accepted tokens and first rejections (the geometric model's maximum likelihood), decayed so
    it follows the text, with half a prior acceptance and half a prior rejection. A request
    decoding plainly is probed with a one-token draft every `probe_every` steps, so a drafter
    that starts hitting is noticed."""

    def __init__(self, max_depth: int, overhead: float, token_cost: float, *, decay: float = 0.9,
                 probe_every: int = 8, costs: StepCosts | None = None) -> None:
        self.max_depth, self.overhead, self.token_cost = max_depth, overhead, token_cost
        self.decay, self.probe_every, self.costs = decay, probe_every, costs
        self._stats: dict[str, list[float]] = {}  # request id -> [accepted, rejections, plain steps]

    def alpha(self, request_id: str) -> float:
        a, r, _ = self._stats.get(request_id, (0.0, 0.0, 0))
        return (a + 0.5) / (a + r + 1)

    def cost_per_token(self, batch: int = 1) -> float:
        """A draft token's cost in plain steps at `batch` sequences: measured, else the prior."""
        measured = self.costs.token_cost(batch) if self.costs is not None else None
        return self.token_cost if measured is None else measured

    def overhead_per_verify(self, batch: int = 1) -> float:
        """Verifying a draft at all, in plain steps at `batch` sequences: measured, else the prior."""
        measured = self.costs.verify_cost(batch) if self.costs is not None else None
        return self.overhead if measured is None else measured

    def best_depth(self, alpha: float, batch: int = 1) -> int:
        """The depth with the most expected tokens per unit of cost (0 when none beats plain)."""
        per_token, overhead = self.cost_per_token(batch), self.overhead_per_verify(batch)

        def rate(k: int) -> float:
            return expected_tokens(alpha, k) / (1 + (overhead + k * per_token if k else 0))
        return max(range(self.max_depth + 1), key=lambda k: (rate(k), -k))

    def depth(self, request_id: str, batch: int = 1) -> int:
        """This step's depth for the request at `batch` running sequences (counts plain steps
        towards the next probe)."""
        k = self.best_depth(self.alpha(request_id), batch)
        if k:
            return k
        st = self._stats.setdefault(request_id, [0.0, 0.0, 0])
        st[2] += 1
        if st[2] >= self.probe_every:
            st[2] = 0
            return 1
        return 0

    def update(self, request_id: str, drafted: int, accepted: int) -> None:
        """A verification's outcome: `accepted` of `drafted` chain tokens (or tree path length)."""
        st = self._stats.setdefault(request_id, [0.0, 0.0, 0])
        st[0] = self.decay * st[0] + accepted
        st[1] = self.decay * st[1] + (1 if accepted < drafted else 0)

    def release(self, request_id: str) -> None:
        self._stats.pop(request_id, None)


class SpecPolicy:
    """When and how deep the engine speculates, from what its own steps cost: the gate picks the
    arm per batch size (plain or a drafting method; a hybrid proposer's modes each an arm), and
    with dynamic depth the depth controller gives each request its own depth. The measured costs
    and each set of arms' gate stay across config changes. `stats` counts plain decodes chosen
    (the engine's spec_stats)."""

    def __init__(self, stats: dict[str, Any]) -> None:
        self.stats = stats
        self.costs = StepCosts()  # decode steps' seconds by batch and draft tokens
        self._gates: dict[tuple[str, ...], SpecGate] = {}
        self.configure(None, ("plain", "spec"))

    def configure(self, config: Any, arms: tuple[str, ...]) -> None:
        """Speculate per `config` (a SpeculativeConfig, None: never), choosing among `arms`."""
        self.config = config
        self.gate = self._gates.setdefault(arms, SpecGate(arms))
        self.depths = None
        if config is not None and config.dynamic_depth:
            self.depths = DepthController(config.num_speculative_tokens, config.draft_overhead,
                                          config.draft_token_cost,
                                          costs=self.costs if config.measured_costs else None)

    def arm(self, batch: int) -> str:
        """What this step runs at `batch` running sequences: 'plain', or the method (mode) to draft
        with. The history drafter decides per draft itself, from its measured acceptance and the
        measured cost of a draft token; fixed depth always drafts."""
        spec = self.config
        if spec is None or batch > spec.max_batch:
            return "plain"
        if self.depths is None or spec.method == "suffix":
            return spec.method
        arm = self.gate.choose(batch)
        if arm == "plain":
            self.stats["plain_decodes"] += batch
        return arm

    def can_speculate(self, params: Any) -> bool:
        """Requests whose logits are processed speculate in chains only (each draft position's
        logits processed as if the draft tokens before it were committed), and a grammar must
        be able to roll back the draft tokens it was advanced over."""
        if not params.processes_logits:
            return True
        return not self.config.tree and (params.constraint is None or hasattr(params.constraint, "rollback"))

    def lookahead(self, request_id: str, params: Any, batch: int) -> int:
        """Draft tokens to make room for after this decode: the config's, or with dynamic depth
        the request's own (a chain that deep; a tree whole or not at all; 0: decode plainly)."""
        spec = self.config
        if not self.can_speculate(params):
            return 0
        if self.depths is None or spec.history:  # a history draft's size follows its own confidence
            return spec.lookahead
        k = self.depths.depth(request_id, batch)
        if k == 0:
            self.stats["plain_decodes"] += 1
        return spec.lookahead if spec.tree and k else k

    def draft_costs(self, batch: int) -> tuple[float, float]:
        """(a draft token's cost, verifying a draft at all) at `batch`, in plain decode steps."""
        if self.depths is not None:
            return self.depths.cost_per_token(batch), self.depths.overhead_per_verify(batch)
        return self.config.draft_token_cost, self.config.draft_overhead

    def verified(self, request_id: str, depth: int, accepted: int) -> None:
        """A request's draft `depth` deep kept `accepted` draft tokens."""
        if self.depths is not None:
            self.depths.update(request_id, depth, accepted)

    def observe_step(self, batch: int, arm: str, drafted: int, verified: int, committed: int,
                     seconds: float) -> None:
        """A decode-only step's cost and yield: the costs and the gate learn from it."""
        if self.depths is None:
            return
        self.costs.observe(batch, drafted, seconds, verified)
        self.gate.update(batch, arm if drafted > 0 else "plain", committed, seconds)

    def release(self, request_id: str) -> None:
        if self.depths is not None:
            self.depths.release(request_id)
