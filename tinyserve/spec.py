"""NEXTN (MTP) speculative decoding: drafting, the verify, how deep to draft, its price, and the counters (the draft
and verify maths, lossless in distribution, are verify.py's). An optional part (`NextN`, the scheduler's, the
runner's and the engine's `nextn`), called at these places:
  - the scheduler's `drafts`: a request's drafts, verified after its decode's own token (with room for the next
    round's draft chain taken ahead when free); `drop`: drafts continue a state that a preempted request gives up;
  - the runner's `verify` (its sampling): keeps a prefix of the drafts and one token after them; then its `draft`
    after the step: the NEXTN head over the positions the step computed, the next round's drafts, the acceptance
    counts, per request (its report: "draft_rounds", "draft_tokens", "accepted_draft_tokens", which the API reads
    for usage and metrics) and engine-wide (NextNStats); a lone decode's time prices a draft (StepCost);
  - the engine's `stats`; build.py's `price` at start.
Its per-request record is `Drafts` (req.drafts).

One round for a speculating request (the runner does the tensor work; this module decides and counts):
  1. the step verifies [x0, d1..dk] (x0: the last committed token, not yet computed; d: the drafts) in the packed
     batch, next to plain decodes and prefill chunks; the GDN layers keep the state after each of the k+1 tokens;
  2. acceptance (verify.py: greedy argmax match, or rejection sampling against the draft's distribution) commits
     a+1 tokens: d1..da and a bonus / corrected token; the engine applies stops token by token inside the run;
  3. the state after the last committed input becomes the request's state (a slot swap, no copy: the scheduler's
     advance); the prefix cache takes its snapshots from the state at exactly each position inside the run;
  4. the NEXTN head runs over the committed positions with the target's hidden states (writing its own KV, one more
     attention layer in the same pages), and drafts the next round's d1..dk.

The head's KV is written at every position the model computes, for every request, drafting or not (a request at
depth 0, one that never speculates, a prefill chunk): its drafts attend over all earlier positions, so a position
left unwritten would lower the acceptance of every later round, and of every request the prefix cache serves
those pages to. Where nothing is drafted the head computes only that KV (its fc and K / V projections), a small
part of one layer.

How deep to draft (DepthControl): each request keeps an estimate of the chance that a draft token is accepted
given the ones before it were (alpha, an exponential average over its recent rounds, starting from the same average
over every request's rounds), and drafts the depth d in
0..num_steps that maximises the expected tokens per round, (1 - alpha^(d+1)) / (1 - alpha), over the round's time.
What a round costs depends on the machine and the model (a verify of d + 1 tokens and d passes of the NEXTN head,
against one decode step), so StepCost holds the measured seconds of a single-request step at each depth: timed at
start (NextN.price) and kept current by the steps that run. At depth 0 the request decodes plainly and
probes with one draft after `PROBE_EVERY` plain steps, backing off (doubling the wait, up to `PROBE_EVERY_MAX`)
while probes keep failing, so a head that never agrees costs little, and one that agrees again is found. A new
request starts from the wait the last probe of any request left, as it starts from every request's alpha: with a
head that disagrees with this traffic, short requests would otherwise spend their first steps probing.
"""
from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Callable

import torch

from tinyserve.cache import Cache
from tinyserve.kernels import PoolLayer
from tinyserve.request import Request, RequestError, Status
from tinyserve.runner import ModelRunner, SeqOutput
from tinyserve.sampling import SamplingBatch, SamplingParams
from tinyserve.scheduler import ScheduledSeq, Scheduler
from tinyserve.verify import draw_drafts, verify_drafts

if TYPE_CHECKING:
    from tinyserve.engine import Engine

log = logging.getLogger("tinyserve.spec")

PROBE_EVERY = 16           # plain decode steps between probes of a request whose depth fell to 0 ...
PROBE_EVERY_MAX = 256      # ... doubled after each failed probe, up to this
COST_PER_DRAFT = 0.25      # a draft token's cost in decode steps where StepCost has measured nothing
COST_DECAY = 0.9           # weight of the previous measurement in StepCost's averages
ALPHA_DECAY = 0.7          # weight of the previous estimate in the exponential average of the acceptance rate
ALPHA_START = 0.8          # before any round, a new request starts by drafting deep


@dataclass
class NextNStats:
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
    probing: bool = False                    # the round in flight is a probe (its verify comes a step later,
                                             # after the next next_depth: so observe() clears this, not next_depth)

    def next_depth(self, cost: "StepCost") -> int:
        """The depth of this request's next step (called once per decode step)."""
        best, best_rate = 0, 1.0 / cost.relative(0)
        a = min(self.alpha, 0.999)
        for d in range(1, self.max_depth + 1):
            rate = (1 - a ** (d + 1)) / (1 - a) / cost.relative(d)
            if rate > best_rate:
                best, best_rate = d, rate
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
        self.alpha = updated_alpha(self.alpha, drafted, accepted)
        if self.probing:
            self.probe_every = PROBE_EVERY if accepted else min(2 * self.probe_every, PROBE_EVERY_MAX)
            self.probing = False


def updated_alpha(alpha: float, drafted: int, accepted: int) -> float:
    """The acceptance estimate after a round that accepted the first `accepted` of `drafted` drafts."""
    tried = accepted + (1 if accepted < drafted else 0)         # drafts compared against the target
    return ALPHA_DECAY * alpha + (1 - ALPHA_DECAY) * accepted / tried


@dataclass
class FixedDepth:
    """A DepthControl that always drafts `depth` (NextN.price times each depth with it)."""
    depth: int
    probing: bool = False                    # it never probes

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


# ---------------------------------------------------------------------------------------------------------------
# The feature: drafting after each step, the verify, the counters

@dataclass
class Drafts:
    """One request's NEXTN record: the drafts to verify after its last output token, the distribution each sampled
    draft was drawn from ([len(tokens), V]; None for greedy requests), and how deep it drafts."""
    tokens: list[int] = field(default_factory=list)
    q: torch.Tensor | None = None
    depth: DepthControl | FixedDepth | None = None


@dataclass
class _Segment:
    """NEXTN positions pos .. pos+len(next_ids)-1 of one request, fed the target's hidden rows `rows`."""
    req: Request
    rows: list[int]
    pos: int
    next_ids: list[int]
    depth: int = 0                     # drafts to make from its last position (0: only its KV is written)
    outputs: list[int] | None = None   # the request's outputs once this step's tokens are committed


class NextN:
    """NEXTN for one engine: the [speculative] settings, the measured step prices, the counters, and drafting."""

    def __init__(self, num_steps: int, max_running: int, kv_layer: int, runner: ModelRunner | None = None,
                 running: Callable[[], int] = lambda: 1) -> None:
        self.num_steps = num_steps         # most drafts per round
        self.max_running = max_running     # nobody drafts while more requests run (0: no limit)
        self.kv_layer = kv_layer           # the NEXTN layer's index in the KV pool (after the target's attention)
        self.runner = runner
        self.running = running             # how many requests run now (the scheduler's)
        self.step_cost = StepCost()        # what a draft costs here, for the draft depth
        self.totals = NextNStats()
        self.alpha = ALPHA_START           # the acceptance estimate over every request's rounds: a new request's start
        self.probe_every = PROBE_EVERY     # the wait before a probe that the last probe left: a new request's start

    @staticmethod
    def speculates(req: Request) -> bool:
        return req.params.speculative and req.params.constraint is None

    @staticmethod
    def record(req: Request) -> Drafts:
        if req.drafts is None:
            req.drafts = Drafts()
        return req.drafts

    # ---- the scheduler's ----
    def drafts(self, req: Request, sched: Scheduler) -> list[int]:
        """req's drafts when a state slot per draft is free, with pages for the next round's chain when free too;
        otherwise none (they are dropped), and the chain's pages taken ahead when free."""
        if not req.params.speculative:
            return []
        rec = req.drafts
        if rec is not None and rec.tokens and len(rec.tokens) <= sched.state_pool.num_free:
            sched.grow_free(req, 1 + len(rec.tokens) + self.num_steps)
            return rec.tokens
        if rec is not None:
            rec.tokens, rec.q = [], None
        sched.grow_free(req, 1 + self.num_steps)          # best effort: room for the draft chain's positions
        return []

    @staticmethod
    def drop(req: Request) -> None:
        req.drafts.tokens, req.drafts.q = [], None

    # ---- the runner's: the verify, then the drafts ----
    def verify(self, seqs: list[ScheduledSeq], logits: torch.Tensor, first_rows: list[int]) -> list[SeqOutput]:
        """Verify each sequence's drafts against its 1 + len(drafts) rows of logits: row j sees
        the request's outputs plus the drafts before it (verify_drafts: lossless in distribution)."""
        runner, dev = self.runner, logits.device
        rows, params, prompts, outs, seeds, drafts, qs = [], [], [], [], [], [], []
        for s, first in zip(seqs, first_rows):
            req, rec = s.req, self.record(s.req)
            rows += range(first, first + 1 + len(s.drafts))
            for j in range(len(s.drafts) + 1):
                params.append(req.params)
                prompts.append(req.prompt_ids)
                outs.append(req.output_ids + s.drafts[:j])
                seeds.append(req.seed)
            drafts.append(s.drafts)
            qs.append(rec.q if rec.q is not None else torch.zeros(len(s.drafts), runner.vocab_size, device=dev))
        sb = SamplingBatch.build(params, prompts, outs, seeds, runner.eos_token_ids, runner.vocab_size, dev)
        any_q = any(self.record(s.req).q is not None for s in seqs)
        v = verify_drafts(logits[torch.tensor(rows, device=dev)], sb, drafts, torch.cat(qs) if any_q else None)
        return [SeqOutput(s, v.tokens[j], v.logprobs[j], v.top[j] if v.top is not None else None)
                for j, s in enumerate(seqs)]

    def draft(self, seqs: list[ScheduledSeq], batch: Any, hidden: torch.Tensor, outputs: list[SeqOutput],
              started: float) -> None:
        """After a step: the next drafts (and the head's KV), then each verify's round counted."""
        self._draft(seqs, batch.cu_seqlens, hidden, {id(o.seq): o for o in outputs})
        for o in outputs:
            if o.seq.drafts:
                self._count(o.seq.req, len(o.seq.drafts), len(o.tokens) - 1)
        if len(seqs) == 1 and seqs[0].is_decode:    # one request decoding: its time prices a draft
            self.step_cost.observe(len(seqs[0].drafts), time.perf_counter() - started)

    def _depth(self, req: Request, outputs: list[int], next_pos: int) -> int:
        """How many drafts req makes for its next round: its DepthControl's choice, cut to what max_tokens, the
        context and its pages leave room for. next_pos: its first position not computed yet."""
        runner = self.runner
        if outputs[-1] in runner.eos_token_ids or outputs[-1] in req.params.stop_token_ids:
            return 0                                   # it is about to finish
        rec = self.record(req)
        if rec.depth is None:
            rec.depth = DepthControl(self.num_steps, alpha=self.alpha, probe_every=self.probe_every)
        depth = rec.depth.next_depth(self.step_cost)
        room_pages = len(req.pages) * runner.page_size - next_pos + 1   # draft step j writes KV at next_pos + j-2
        return max(0, min(depth, req.params.max_tokens - len(outputs) - 1,
                          runner.context_length - next_pos - 1, room_pages))

    def _draft(self, seqs: list[ScheduledSeq], cu_seqlens: list[int], hidden: torch.Tensor,
               outputs: dict[int, SeqOutput]) -> None:
        """After a step: the head over the positions every request computed (its KV, see the module docstring),
        then, for the speculating ones, up to `depth` chained draft steps into their records. outputs: by id(seq),
        what it sampled."""
        allowed = self.max_running == 0 or self.running() <= self.max_running
        segments: list[_Segment] = []
        for i, s in enumerate(seqs):
            req = s.req
            if req.drafts is not None:
                self.drop(req)                         # the drafts just verified, or never scheduled
            start, end_row = cu_seqlens[i], cu_seqlens[i + 1]
            end = s.start + s.num_tokens
            if not s.samples:                          # a prefill chunk that is not the last: KV only
                segments.append(_Segment(req, list(range(start, end_row)), s.start,
                                         req.token_ids(s.start + 1, end + 1)))
                continue
            toks = outputs[id(s)].tokens
            after = req.output_ids + toks
            if s.is_decode:                            # the last accepted token, then the accepted drafts
                seg = _Segment(req, list(range(start, start + len(toks))), s.start, toks, outputs=after)
            else:                                      # the prompt's (or a recompute's) last chunk
                seg = _Segment(req, list(range(start, end_row)), s.start, req.token_ids(s.start + 1, end) + toks,
                               outputs=after)
            if allowed and self.speculates(req):
                seg.depth = self._depth(req, after, seg.pos + len(seg.rows))
            segments.append(seg)
        if not segments:
            return
        dev = hidden.device

        def head_input(segs: list[_Segment]) -> tuple[list[tuple[Request, int, int]], list[int], torch.Tensor]:
            return ([(seg.req, seg.pos, len(seg.rows)) for seg in segs], [t for seg in segs for t in seg.next_ids],
                    hidden[torch.tensor([r for seg in segs for r in seg.rows], device=dev)])

        quiet = [seg for seg in segments if seg.depth == 0]
        if quiet:                                      # nothing drafted from these: the head's KV alone
            self._head(*head_input(quiet), kv_only=True)
        # one-row segments first: they use the decode attention
        drafting = sorted((seg for seg in segments if seg.depth > 0), key=lambda g: len(g.rows) != 1)
        if not drafting:
            return
        g = self._head(*head_input(drafting))
        h = g[torch.tensor([len(seg.rows) for seg in drafting], device=dev).cumsum(0) - 1]
        live = drafting                                # those still drafting at each chain step
        qs: dict[int, list[torch.Tensor]] = {id(seg.req): [] for seg in live}
        runner = self.runner
        for step in range(max(seg.depth for seg in live)):
            recs = [self.record(seg.req) for seg in live]
            if step:                                   # a chain step: the last draft and the head's own hidden
                h = self._head([(seg.req, seg.pos + len(seg.rows) + step - 1, 1) for seg in live],
                               [rec.tokens[-1] for rec in recs], h)
            reqs = [seg.req for seg in live]
            sb = SamplingBatch.build([r.params for r in reqs], [r.prompt_ids for r in reqs],
                                     [seg.outputs + rec.tokens for seg, rec in zip(live, recs)],
                                     [r.seed for r in reqs], runner.eos_token_ids, runner.vocab_size, dev)
            tokens, q = draw_drafts(runner.model.compute_logits(h).float(), sb)
            for j, (seg, rec, t) in enumerate(zip(live, recs, tokens.tolist())):
                rec.tokens.append(t)
                if q is not None and not seg.req.params.is_greedy:
                    qs[id(seg.req)].append(q[j])
            keep = [j for j, seg in enumerate(live) if seg.depth > step + 1]
            live = [live[j] for j in keep]
            if not live:
                break
            h = h[torch.tensor(keep, device=dev)]
        for seg in drafting:
            rows = qs.get(id(seg.req))
            if rows:
                self.record(seg.req).q = torch.stack(rows)

    def _head(self, spans: list[tuple[Request, int, int]], next_ids: list[int], hidden: torch.Tensor,
              kv_only: bool = False) -> torch.Tensor | None:
        """The NEXTN head over spans (request, first position p, tokens n), embedding the tokens at p+1 .. (next_ids,
        packed in span order; at an image token that image's feature row, as vLLM) with the hidden rows at p ..
        (packed the same way): its output rows [sum n, H], or with kv_only only its KV (None). Through the static
        steps when registered and the batch fits, else eagerly; leading one-token spans use the decode attention."""
        runner = self.runner
        num_decode = 0 if kv_only else next((k for k, (_, _, n) in enumerate(spans) if n != 1), len(spans))
        batch = runner.pack(spans, next_ids, [0] * len(spans), num_decode)
        inputs = runner.model_inputs(spans, batch, shift=1)
        static, m = runner.steps, runner.model
        if static is not None and static.nextn_kv_layer is not None and not inputs and static.fits(batch):
            return static.run(batch, "head_kv" if kv_only else "draft", hidden)
        args = (m.embed(batch.input_ids, inputs.get("embeds")), hidden, batch, PoolLayer(runner.kv_pool.buffer,
                self.kv_layer), m.cos_sin(batch.positions, inputs.get("rope_positions")))
        return m.mtp.write_kv(*args) if kv_only else m.mtp(*args)

    def _count(self, req: Request, drafted: int, accepted: int) -> None:
        """A verify's round: the acceptance estimates and the counters, the request's among them (its report)."""
        self.observe(req, drafted, accepted)
        report = req.report
        report["draft_rounds"] = report.get("draft_rounds", 0) + 1
        report["draft_tokens"] = report.get("draft_tokens", 0) + drafted
        report["accepted_draft_tokens"] = report.get("accepted_draft_tokens", 0) + accepted

    # ---- the engine's ----
    def observe(self, req: Request, drafted: int, accepted: int) -> None:
        """A round of req verified `drafted` drafts (at least one) and accepted the first `accepted` of them."""
        self.totals.observe(drafted, accepted)
        self.alpha = updated_alpha(self.alpha, drafted, accepted)
        depth = self.record(req).depth
        if depth is not None:
            probe = depth.probing
            depth.observe(drafted, accepted)
            if probe:
                self.probe_every = depth.probe_every

    def stats(self) -> NextNStats:
        return self.totals

    # ---- pricing, at start ----
    def forget_draft_prices(self) -> None:
        """Forget what rounds with drafts cost (their verify and head passes ran eagerly until their compiled
        graphs were made, after start: compiled.py): the rounds that run price them again."""
        cost = self.step_cost
        cost.seconds[1:] = [0.0] * len(cost.seconds[1:])
        log.info("NEXTN: the draft depths are priced again by the steps that run (their graphs are ready)")

    def price(self, engine: Engine, steps: int = 3) -> None:
        """Time single-request decode steps at each draft depth on this machine and model (the StepCost that
        chooses how deep requests draft), with a throw-away request through the engine's scheduler with the prefix
        cache swapped out (nothing of it is kept), before serving."""
        prompt = [(7 * i + 3) % engine.model.cfg.vocab_size for i in range(64)]
        k = self.num_steps
        try:
            req = engine.intake.make_request(prompt, SamplingParams(max_tokens=(k + 1) * (steps + 2) * (k + 2),
                                                                    temperature=0, ignore_eos=True), "price-drafts")
        except RequestError as e:                  # a tiny context or pool: price drafts as they run
            log.info("NEXTN: draft depths not timed at start (%s)", e)
            return
        sched = engine.scheduler
        cache, sched.cache = sched.cache, Cache(engine.state_pool)
        try:
            sched.add(req)
            while not req.output_ids:              # the prompt
                engine.run_step(sched)
            cost = self.step_cost
            for depth in range(k + 1):
                self.record(req).depth = FixedDepth(depth)
                for i in range(steps + 2):
                    if req.status != Status.RUNNING:
                        break
                    engine.run_step(sched)
                    # a step verifies the drafts the one before made: the second at a new depth is the first to
                    # verify that many, and a first call (a graph's, a GEMM shape's set-up) is not steady: not part
                    # of the price
                    if i == 1 and len(cost.seconds) > depth:
                        cost.seconds[depth] = 0.0
            if req.status != Status.FINISHED:
                sched.abort(req)
        finally:
            sched.cache = cache
        self.totals, self.alpha = NextNStats(), ALPHA_START   # the throw-away prompt says nothing of real traffic
        log.info("NEXTN: a decode step with 0..%d drafts takes %s ms here", k,
                 ", ".join(f"{t * 1000:.1f}" for t in cost.seconds))
