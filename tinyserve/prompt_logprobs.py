"""Prompt logprobs (SamplingParams.prompt_logprobs: vLLM's prompt_logprobs, the completions API's echo with
logprobs): each prompt token's logprob under the model, and the top-n at its position, from the prefill's own rows.

An optional part (`PromptLogprobs`), called at two places: the intake's `attach` (such a request computes its whole
prompt: Request.reuse_cache is False; its record, req.prompt_logprobs, is the list so far) and the runner's `read`
after a step (the rows of the prefill chunks of a request that asks go through the LM head PROMPT_LOGPROB_ROWS at a
time, so a long chunk never holds [chunk, V] logits). Once the list is whole it goes to the request's report, which
the result hears with the first tokens (RequestStream.report), and a recompute may reuse the cache again.
"""
from __future__ import annotations

import torch

from tinyserve.request import Request
from tinyserve.models.qwen3_next import ForwardBatch
from tinyserve.scheduler import ScheduledSeq
from tinyserve.top_k_top_p import top_n

PROMPT_LOGPROB_ROWS = 128      # prompt rows per LM-head pass ([rows, vocab] float32 at a time)

# One prompt token's logprob under the model, and the top-n (id, logprob) at its position
PromptLogprob = tuple[float, list[tuple[int, float]]]


class PromptLogprobs:
    def __init__(self, model) -> None:
        self.model = model                    # its LM head: compute_logits

    @staticmethod
    def attach(req: Request) -> None:
        req.prompt_logprobs = []                # the prompt's logprobs so far
        req.reuse_cache = False                 # its rows are read from the forward: the whole prompt is computed

    def read(self, seqs: list[ScheduledSeq], batch: ForwardBatch, hidden: torch.Tensor) -> None:
        for i, s in enumerate(seqs):
            if not s.is_decode and s.req.prompt_logprobs is not None:
                self._prompt_rows(s, batch.cu_seqlens[i], hidden)

    def _prompt_rows(self, s: ScheduledSeq, first_row: int, hidden: torch.Tensor) -> None:
        """The logprobs of the prompt tokens a prefill chunk's rows predict: row q predicts prompt token q + 1,
        under the raw model distribution (as sampled tokens' logprobs), with its top-n."""
        req = s.req
        done = req.prompt_logprobs
        end = min(s.start + s.num_tokens, len(req.prompt_ids) - 1)
        assert len(done) >= end or len(done) >= s.start, \
            "a request computing its prompt's logprobs resumes from no cached prefix"
        n_top = req.params.prompt_logprobs
        for q in range(len(done), end, PROMPT_LOGPROB_ROWS):
            q_end = min(q + PROMPT_LOGPROB_ROWS, end)
            row = first_row + q - s.start
            logp = torch.log_softmax(self.model.compute_logits(hidden[row:row + q_end - q]).float(), dim=-1)
            targets = torch.tensor(req.prompt_ids[q + 1:q_end + 1], device=hidden.device)
            chosen = logp.gather(1, targets[:, None]).squeeze(1).tolist()
            if n_top:
                top_lp, top_ids = top_n(logp, min(n_top, logp.shape[1]))
                tops = [list(zip(ids, lps)) for ids, lps in zip(top_ids.tolist(), top_lp.tolist())]
            else:
                tops = [[] for _ in chosen]
            done += zip(chosen, tops)
        if len(done) == len(req.prompt_ids) - 1:
            req.reuse_cache = True                  # all in: a recompute after preemption may resume
            req.report["prompt_logprobs"] = done    # heard with the first tokens
