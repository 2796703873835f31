"""NEXTN (MTP) speculative decoding: the per-request draft state, how deep to draft, and the counters.

One round for a speculating request (the runner does the tensor work; this module decides and counts):
  1. the step verifies [x0, d1..dk] (x0: the last committed token, not yet computed; d: the drafts) in the packed
     batch, next to plain decodes and prefill chunks; the GDN layers keep the state after each of the k+1 tokens;
  2. acceptance (sampling.py: greedy argmax match, or rejection sampling against the draft's distribution) commits
     a+1 tokens: d1..da and a bonus / corrected token; the engine applies stops token by token inside the run;
  3. the state after the last committed input becomes the request's state (a slot swap, no copy); the prefix
     cache takes its snapshots from the state at exactly each position inside the run;
  4. the NEXTN head runs over the committed positions with the target's hidden states (writing its own KV, one more
     attention layer in the same pages), and drafts the next round's d1..dk.

How deep to draft (DepthControl): each request keeps an estimate of the chance that a draft token is accepted
given the ones before it were (alpha, an exponential average over its recent rounds), and drafts the depth d in
0..num_steps that maximises the expected tokens per round, (1 - alpha^(d+1)) / (1 - alpha), over the round's time.
What a round costs depends on the machine and the model (a verify of d + 1 tokens and d passes of the NEXTN head,
against one decode step), so StepCost holds the measured seconds of a single-request step at each depth: timed at
start (Engine.price_drafts) and kept current by the steps that run. At depth 0 the request decodes plainly and
probes with one draft after `PROBE_EVERY` plain steps, backing off (doubling the wait, up to `PROBE_EVERY_MAX`)
while probes keep failing, so a head that never agrees costs almost nothing.
"""
from __future__ import annotations

from dataclasses import dataclass, field

PROBE_EVERY = 16           # plain decode steps between probes of a request whose depth fell to 0 ...
PROBE_EVERY_MAX = 256      # ... doubled after each failed probe, up to this
COST_PER_DRAFT = 0.25      # a draft token's cost in decode steps where StepCost has measured nothing
COST_DECAY = 0.9           # weight of the previous measurement in StepCost's averages
ALPHA_DECAY = 0.7          # weight of the previous estimate in the exponential average of the acceptance rate
ALPHA_START = 0.8          # a new request starts by drafting deep (its estimate is refined from its first round)


@dataclass
class SpecStats:
    """Engine-wide counters, with vLLM's definitions (mean accept length = 1 + accepted / drafts)."""
    num_drafts: int = 0                      # verify rounds
    num_draft_tokens: int = 0                # draft tokens verified
    num_accepted_tokens: int = 0             # draft tokens accepted
    accepted_per_pos: list[int] = field(default_factory=list)   # [i]: rounds whose draft i+1 was accepted

    def observe(self, drafted: int, accepted: int) -> None:
        self.num_drafts += 1
        self.num_draft_tokens += drafted
        self.num_accepted_tokens += accepted
        if len(self.accepted_per_pos) < drafted:
            self.accepted_per_pos += [0] * (drafted - len(self.accepted_per_pos))
        for i in range(accepted):
            self.accepted_per_pos[i] += 1

    @property
    def mean_accept_length(self) -> float:
        return 1.0 + self.num_accepted_tokens / self.num_drafts if self.num_drafts else 0.0


@dataclass
class DepthControl:
    """One request's draft depth (see the module docstring)."""
    max_depth: int
    alpha: float = ALPHA_START
    plain_steps: int = 0                     # plain decode steps since the depth fell to 0
    probe_every: int = PROBE_EVERY
    probing: bool = False

    def next_depth(self, cost: "StepCost") -> int:
        """The depth of this request's next step (called once per decode step)."""
        best, best_rate = 0, 1.0 / cost.relative(0)
        a = min(self.alpha, 0.999)
        for d in range(1, self.max_depth + 1):
            rate = (1 - a ** (d + 1)) / (1 - a) / cost.relative(d)
            if rate > best_rate:
                best, best_rate = d, rate
        self.probing = False
        if best == 0:
            self.plain_steps += 1
            if self.plain_steps >= self.probe_every:
                self.plain_steps, self.probing = 0, True
                return 1
        return best

    def observe(self, drafted: int, accepted: int) -> None:
        """A round verified `drafted` drafts and accepted the first `accepted` of them."""
        if drafted == 0:
            return
        tried = accepted + (1 if accepted < drafted else 0)     # drafts compared against the target
        self.alpha = ALPHA_DECAY * self.alpha + (1 - ALPHA_DECAY) * accepted / tried
        if self.probing:
            self.probe_every = PROBE_EVERY if accepted else min(2 * self.probe_every, PROBE_EVERY_MAX)


@dataclass
class FixedDepth:
    """A DepthControl that always drafts `depth` (Engine.price_drafts times each depth with it)."""
    depth: int

    def next_depth(self, cost: "StepCost") -> int:
        return self.depth

    def observe(self, drafted: int, accepted: int) -> None:
        pass


@dataclass
class StepCost:
    """Seconds of a single-request decode step by the number of drafts it verified (its drafting of the next round
    included): measured at start and averaged over the steps that run. `relative(d)` is a round at depth d in
    plain decode steps; a depth not measured yet is priced by the nearest measured one, COST_PER_DRAFT a draft."""
    seconds: list[float] = field(default_factory=list)     # [d]: 0.0 = not measured

    def observe(self, drafts: int, seconds: float) -> None:
        if len(self.seconds) <= drafts:
            self.seconds += [0.0] * (drafts + 1 - len(self.seconds))
        old = self.seconds[drafts]
        self.seconds[drafts] = seconds if not old else COST_DECAY * old + (1 - COST_DECAY) * seconds

    def relative(self, d: int) -> float:
        measured = [(k, t) for k, t in enumerate(self.seconds) if t]
        if not measured:
            return 1.0 + COST_PER_DRAFT * d
        plain = self.seconds[0] if self.seconds[0] else None
        k, t = min(measured, key=lambda kt: abs(kt[0] - d))
        if plain is None:                                  # only rounds with drafts measured: price from those
            plain = t / (1.0 + COST_PER_DRAFT * k)
        t_d = t * (1.0 + COST_PER_DRAFT * d) / (1.0 + COST_PER_DRAFT * k) if k != d else t
        return t_d / plain


@dataclass(frozen=True)
class NextNSetup:
    """What the runner needs to draft: from [speculative] and the model."""
    num_steps: int                 # most drafts per round
    max_running: int               # nobody drafts while more requests run (0: no limit)
    kv_layer: int                  # the NEXTN layer's index in the KV pool (after the target's attention layers)

    def allows(self, num_running: int) -> bool:
        return self.max_running == 0 or num_running <= self.max_running
