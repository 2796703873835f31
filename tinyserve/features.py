"""The optional features and the hooks the core calls them at, each hook from one place.

A feature (NEXTN, images, constrained output, prompt logprobs, the static steps, idle release) is one module with a
class that subclasses Feature and overrides the hooks it needs. build.py registers the ones the configuration and
the checkpoint turn on, one line each, and the core calls every hook through the engine's Features: a hook that no
registered feature overrides costs the core one empty loop, so a feature that is off costs the plain path nothing
else. A feature keeps its per-request state in a record of its own, in `req.features` under its name, and the
per-request hooks (PER_REQUEST) reach it only for the requests that hold its record: a request that asks for no
feature meets none of them.

    hook            called from               when                                     used by
    on_request      Intake.make_request       a request is made: its records           grammar, images, prompt
                                                                                        logprobs
    decode_tokens   Scheduler.schedule        a running request decodes: extra tokens  NEXTN (its drafts)
    free            Scheduler._free           a request gives back its pages           NEXTN, images
    prepare         Engine.run_step           a step is scheduled, before it runs      images (encoding)
    model_inputs    ModelRunner.pack          a batch is packed: the model's inputs    images (M-RoPE, features)
    forward         ModelRunner.forward       a target step's forward                  static steps (graphs, compiled)
    logit_masks *   ModelRunner._sample_rows  the rows are sampled                     grammar
    accept          ModelRunner._sample       decodes with extra tokens are sampled    NEXTN (verify)
    after_forward   ModelRunner.step          the step's tokens are sampled            NEXTN (drafting), images,
                                                                                        prompt logprobs
    commit *        Engine._commit            a request's tokens are kept              grammar, NEXTN, prompt logprobs
    wake            Engine._step              new requests arrive                      idle release (pools back)
    idle_timeout    Engine._serve             the engine has nothing to do             idle release
    on_idle         Engine._serve             ... for idle_timeout() seconds           idle release
    stats           Engine.stats              the status page / metrics ask            NEXTN, images, idle release
    (* per request: only for the requests that hold the feature's record)
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch

    from tinyserve.images import ProcessedImage
    from tinyserve.request import Request
    from tinyserve.runner import Packed, SeqOutput
    from tinyserve.scheduler import ScheduledSeq, Scheduler

# Called for the requests that hold the feature's record (req.features[name]) alone
PER_REQUEST = ("logit_masks", "commit")

HOOKS = ("on_request", "decode_tokens", "free", "prepare", "model_inputs", "forward", "logit_masks", "accept",
         "after_forward", "commit", "wake", "idle_timeout", "on_idle", "stats")


def _no_accept(seqs, logits, first_rows):
    raise RuntimeError("decodes with extra tokens, but no feature accepts them")


# What each hook answers when no registered feature has it
NO_FEATURE = {
    "on_request": lambda req, images: None, "decode_tokens": lambda req, sched: [], "free": lambda req: None,
    "prepare": lambda seqs: {},
    "model_inputs": lambda packed, shift=0: {}, "forward": lambda packed, inputs: None,
    "logit_masks": lambda reqs, rows: None, "accept": _no_accept,
    "after_forward": lambda seqs, packed, hidden, outputs, started: None, "commit": lambda seq, out, kept: None,
    "wake": lambda: True, "idle_timeout": lambda: None, "on_idle": lambda: None, "stats": lambda: {}}


class Feature:
    """Every hook, doing nothing: a feature overrides those it needs. `name` keys its records (req.features) and
    its stats."""
    name = ""

    def on_request(self, req: Request, images: list[ProcessedImage]) -> None:
        """A request is made: the feature's record of it (req.features[name]) if it asks for the feature; a
        RequestError (intake.py) refuses it. images: its processed images, in prompt order."""

    def decode_tokens(self, req: Request, sched: Scheduler) -> list[int]:
        """Tokens to compute after req's last one in this step, as a decode with extra tokens (their pages and a
        state slot each are the scheduler's to find; none: a plain decode). Whatever the feature takes of `sched`
        beyond that (pages ahead, `Scheduler.grow_free`) is its own."""
        return []

    def free(self, req: Request) -> None:
        """req gave back its pages and state (finished, aborted, preempted): what it held for the feature goes."""

    def prepare(self, seqs: list[ScheduledSeq]) -> dict[Request, Exception]:
        """Before a step: the requests that cannot run it, with why (they fail; the others run)."""
        return {}

    def model_inputs(self, packed: Packed, shift: int) -> dict[str, Any]:
        """The model's keyword inputs for a packed batch (Qwen3NextForCausalLM.forward). shift: 0 for the target,
        1 for the NEXTN head, whose row p embeds the token at p + 1."""
        return {}

    def forward(self, packed: Packed, inputs: dict[str, Any]) -> torch.Tensor | None:
        """The target's hidden rows for a packed batch, laid out as the eager forward's, or None: not taken."""
        return None

    def logit_masks(self, reqs: list[Request], rows: list[int]) -> tuple[list[int], torch.Tensor] | None:
        """(logit rows, int32 bitmask [rows, ceil(V / 32)]) of the requests that constrain their next token;
        reqs[i] samples at logits row rows[i]."""
        return None

    def accept(self, seqs: list[ScheduledSeq], logits: torch.Tensor, first_rows: list[int]) -> list[SeqOutput]:
        """The tokens of the decodes with extra tokens (seqs): sequence i's rows of `logits` start at first_rows[i]
        (1 + its extra tokens); a sequence keeps a prefix of its extra tokens and one token after them."""
        return []

    def after_forward(self, seqs: list[ScheduledSeq], packed: Packed, hidden: torch.Tensor,
                      outputs: list[SeqOutput], started: float) -> None:
        """After the step's sampling: its sequences, the packed batch and its hidden rows, the sampled tokens (not
        committed yet), the step's start (time.perf_counter)."""

    def commit(self, seq: ScheduledSeq, out: SeqOutput, kept: int) -> str | None:
        """The engine kept the first `kept` of out.tokens (a stop cuts the rest): a finish reason the feature imposes
        (None: none). What the request's result should hear goes into req.report."""
        return None

    def wake(self) -> bool:
        """New requests arrive: False when the feature cannot take them now (they fail; the next ones try again)."""
        return True

    def idle_timeout(self) -> float | None:
        """The engine has nothing to do: call on_idle after this many seconds of it (None: never)."""
        return None

    def on_idle(self) -> None:
        """The engine had nothing to do for idle_timeout() seconds."""

    def stats(self) -> Any:
        """What the status page and /metrics show of the feature (EngineStats.features[name]); None: nothing."""
        return None


class Features:
    """The registered features, called hook by hook. A hook that no feature has answers as NO_FEATURE says; one
    that a single feature has is that feature's method, called directly; one that several have is the method of
    the same name here, which combines their answers."""

    def __init__(self, features: list[Feature] = ()) -> None:
        self.all: list[Feature] = []
        self.by_hook: dict[str, list[Feature]] = {}
        self._bind()
        for f in features:
            self.add(f)

    def add(self, feature: Feature) -> None:
        """Register a feature (in place of one of the same name)."""
        self.all = [f for f in self.all if f.name != feature.name] + [feature]
        self._bind()

    def _bind(self) -> None:
        self.by_hook = {h: [f for f in self.all if getattr(type(f), h) is not getattr(Feature, h)] for h in HOOKS}
        for hook, features in self.by_hook.items():
            if not features:
                setattr(self, hook, NO_FEATURE[hook])
            elif len(features) == 1 and hook != "stats" and hook not in PER_REQUEST:
                setattr(self, hook, getattr(features[0], hook))
            else:
                self.__dict__.pop(hook, None)          # the combining method of the class

    def named(self, name: str) -> Feature | None:
        return next((f for f in self.all if f.name == name), None)

    def on_request(self, req: Request, images: list[ProcessedImage]) -> None:
        for f in self.by_hook["on_request"]:
            f.on_request(req, images)

    def decode_tokens(self, req: Request, sched: Scheduler) -> list[int]:
        for f in self.by_hook["decode_tokens"]:
            tokens = f.decode_tokens(req, sched)
            if tokens:
                return tokens
        return []

    def free(self, req: Request) -> None:
        for f in self.by_hook["free"]:
            f.free(req)

    def prepare(self, seqs: list[ScheduledSeq]) -> dict[Request, Exception]:
        failed: dict[Request, Exception] = {}
        for f in self.by_hook["prepare"]:
            failed.update(f.prepare(seqs))
        return failed

    def model_inputs(self, packed: Packed, shift: int = 0) -> dict[str, Any]:
        inputs: dict[str, Any] = {}
        for f in self.by_hook["model_inputs"]:
            inputs.update(f.model_inputs(packed, shift))
        return inputs

    def forward(self, packed: Packed, inputs: dict[str, Any]) -> torch.Tensor | None:
        for f in self.by_hook["forward"]:
            hidden = f.forward(packed, inputs)
            if hidden is not None:
                return hidden
        return None

    def logit_masks(self, reqs: list[Request], rows: list[int]) -> tuple[list[int], torch.Tensor] | None:
        for f in self.by_hook["logit_masks"]:
            held = [(r, row) for r, row in zip(reqs, rows) if f.name in r.features]
            if held and (masks := f.logit_masks([r for r, _ in held], [row for _, row in held])) is not None:
                return masks
        return None

    def accept(self, seqs: list[ScheduledSeq], logits: torch.Tensor, first_rows: list[int]) -> list[SeqOutput]:
        raise RuntimeError("two features accept decodes with extra tokens: " +
                           ", ".join(f.name for f in self.by_hook["accept"]))

    def after_forward(self, seqs: list[ScheduledSeq], packed: Packed, hidden: torch.Tensor,
                      outputs: list[SeqOutput], started: float) -> None:
        for f in self.by_hook["after_forward"]:
            f.after_forward(seqs, packed, hidden, outputs, started)

    def commit(self, seq: ScheduledSeq, out: SeqOutput, kept: int) -> str | None:
        reason = None
        for f in self.by_hook["commit"]:
            if f.name in seq.req.features:
                reason = f.commit(seq, out, kept) or reason
        return reason

    def wake(self) -> bool:
        return all([f.wake() for f in self.by_hook["wake"]])

    def idle_timeout(self) -> float | None:
        timeouts = [t for f in self.by_hook["idle_timeout"] if (t := f.idle_timeout()) is not None]
        return min(timeouts, default=None)

    def on_idle(self) -> None:
        for f in self.by_hook["on_idle"]:
            f.on_idle()

    def stats(self) -> dict[str, Any]:
        return {f.name: s for f in self.by_hook["stats"] if (s := f.stats()) is not None}
