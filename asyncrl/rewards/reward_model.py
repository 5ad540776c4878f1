"""Model-based reward endpoints that score with a model of their own: a scalar Bradley–Terry reward
model, and a process reward model (PRM) giving line-level token rewards. (The generative judges:
`asyncrl.rewards.judge`.) A forward pass cannot be interrupted: a stopped call (`asyncrl.rewards.calls`)
ends at the next sample, its samples scored kept and the others failed with the reason.
"""

from __future__ import annotations

import numpy as np
import torch

from asyncrl.algo.shaping import prm_dense_rewards
from asyncrl.config import ProcessRewardEndpoint, ScalarRewardEndpoint
from asyncrl.messages.structs import Reward, RewardRequest
from asyncrl.rewards.calls import current_call
from asyncrl.rewards.verifier import failed, not_applicable


class _HeadRewardModel:
    """A transformers model with a one-label head read from `endpoint.model_path`, its tokenizer,
    and the endpoint's version; a new endpoint of the same model is taken in place (`reconfigure`),
    another model needs a new scorer."""

    def __init__(self, endpoint: ScalarRewardEndpoint | ProcessRewardEndpoint, auto_class: str):
        import transformers

        self.endpoint = endpoint
        self.tokenizer = transformers.AutoTokenizer.from_pretrained(endpoint.model_path)
        self.model = getattr(transformers, auto_class).from_pretrained(endpoint.model_path, num_labels=1).eval()

    @property
    def version(self) -> str:
        return self.endpoint.version

    def reconfigure(self, endpoint: ScalarRewardEndpoint | ProcessRewardEndpoint) -> bool:
        if endpoint.model_path != self.endpoint.model_path:
            return False
        self.endpoint = endpoint
        return True


class ScalarRewardModel(_HeadRewardModel):
    """Bradley–Terry reward model: a sequence-classification head with one label; the score is the
    logit at the last token (optionally squashed with a sigmoid)."""

    name = "bt_rm"

    MAX_TOKENS = 2048

    def __init__(self, endpoint: ScalarRewardEndpoint):
        super().__init__(endpoint, "AutoModelForSequenceClassification")
        if self.model.config.pad_token_id is None:
            self.model.config.pad_token_id = self.tokenizer.pad_token_id or 0

    @torch.no_grad()
    def score(self, requests: list[RewardRequest]) -> list[Reward]:
        out = []
        call = current_call()
        for r in requests:
            if call.stopped:
                out.append(failed(r, self.name, self.version, call.reason))
                continue
            try:
                ids = self.tokenizer.encode(r.prompt_text + "\n" + r.response_text, add_special_tokens=False)
                ids = torch.tensor([ids[-self.MAX_TOKENS:] or [self.model.config.pad_token_id]])
                logit = float(self.model(input_ids=ids).logits[0, 0])
                score = float(torch.sigmoid(torch.tensor(logit))) if self.endpoint.sigmoid else logit
                out.append(Reward(prompt_id=r.prompt_id, sample_idx=r.sample_idx, score=score, source=self.name,
                                  source_version=self.version, details={"logit": logit}))
            except Exception as exc:
                out.append(failed(r, self.name, self.version, exc))
        return out


class ProcessRewardModel(_HeadRewardModel):
    """Line-level process rewards on the policy's own tokens: a token-classification model with one
    label scores the state at each line end; comment lines are neutral; scores are normalised by the
    number of scored lines (`prm_dense_rewards` with λ = 1; the hybrid router applies the λ switch)."""

    name = "prm"

    MAX_TOKENS = 4096

    def __init__(self, endpoint: ProcessRewardEndpoint):
        super().__init__(endpoint, "AutoModelForTokenClassification")

    def line_structure(self, token_ids: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
        """(line-end mask, neutral mask) over response tokens: a line ends at a token containing a
        newline (or at the last token); a line whose text starts with '#' is neutral."""
        n = len(token_ids)
        ends, neutral = torch.zeros(n, dtype=torch.bool), torch.zeros(n, dtype=torch.bool)
        pieces = self.tokenizer.batch_decode([[t] for t in token_ids])  # one call, not one per token
        line_start = 0
        for i in range(n):
            if "\n" in pieces[i] or i == n - 1:
                ends[i] = True
                neutral[i] = self.tokenizer.decode(token_ids[line_start : i + 1]).strip().startswith("#")
                line_start = i + 1
        return ends, neutral

    @torch.no_grad()
    def score(self, requests: list[RewardRequest]) -> list[Reward]:
        out = []
        call = current_call()
        for r in requests:
            if call.stopped:
                out.append(failed(r, self.name, self.version, call.reason))
                continue
            try:
                if r.response_token_ids is None or not len(r.response_token_ids):
                    out.append(not_applicable(r, self.name, self.version, "no response tokens to score"))
                    continue
                response = [int(t) for t in r.response_token_ids]
                if max(response) >= self.model.config.vocab_size:
                    raise ValueError("response token ids exceed the PRM's vocabulary (tokenizers differ)")
                prompt = self.tokenizer.encode(r.prompt_text, add_special_tokens=False)
                ids = (prompt + response)[-self.MAX_TOKENS:]
                scores = self.model(input_ids=torch.tensor([ids])).logits[0, :, 0].float()
                response_scores = torch.zeros(len(response))
                kept = min(len(response), len(ids))
                response_scores[len(response) - kept:] = scores[len(ids) - kept:]
                ends, neutral = self.line_structure(response)
                dense = prm_dense_rewards(response_scores, ends, neutral, passed=False, lam_fail=1.0, lam_pass=1.0)
                out.append(Reward(prompt_id=r.prompt_id, sample_idx=r.sample_idx, score=0.0, source=self.name,
                                  source_version=self.version, token_rewards=dense.numpy().astype(np.float32),
                                  details={"lines": int((ends & ~neutral).sum())}))
            except Exception as exc:
                out.append(failed(r, self.name, self.version, exc))
        return out
