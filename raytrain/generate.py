"""`raytrain generate`: text from a checkpoint or an exported model, greedy or sampled (temperature, top-k, top-p).

Decoding itself is `transformers`' generate(); this module only loads the model and tokenizer from
either source and makes sampling reproducible with a seed.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch

from raytrain.errors import UserError


@dataclass
class Generator:
    model: torch.nn.Module
    tokenizer: object
    context: int  # the model's maximum sequence length

    @torch.no_grad()
    def __call__(self, prompt: str, max_new_tokens: int = 32, greedy: bool = True, temperature: float = 1.0,
                 top_k: int = 0, top_p: float = 1.0, seed: int = 0) -> str:
        from transformers import set_seed

        enc = self.tokenizer(prompt, return_tensors="pt")
        n = enc["input_ids"].shape[1]
        if n == 0:
            raise UserError("the prompt is empty; pass --prompt with some text")
        if n + max_new_tokens > self.context:
            raise UserError(f"prompt ({n} tokens) + max_new_tokens ({max_new_tokens}) exceeds the model's context of "
                            f"{self.context} tokens; shorten the prompt or lower --max-new-tokens")
        if not greedy and temperature <= 0:
            raise UserError("--temperature must be > 0 for sampling (use --greedy for deterministic decoding)")
        set_seed(seed)
        sampling = {} if greedy else {"temperature": temperature, "top_k": top_k, "top_p": top_p}  # top_k 0: off
        eot = self.tokenizer.eos_token_id
        out = self.model.generate(**enc, do_sample=not greedy, max_new_tokens=max_new_tokens,
                                  pad_token_id=eot, eos_token_id=eot, **sampling)
        return self.tokenizer.decode(out[0, n:], skip_special_tokens=False)


def load(checkpoint: Optional[str] = None, model_dir: Optional[str] = None,
         tokenizer: Optional[str] = None) -> Generator:
    """A generator from a raytrain checkpoint (weights consolidated in memory) or a model directory."""
    if (checkpoint is None) == (model_dir is None):
        raise UserError("pass exactly one of --checkpoint URI or --model DIR")
    if checkpoint is not None:
        from raytrain.export import hf_tokenizer, load_checkpoint

        ck = load_checkpoint(checkpoint, tokenizer)
        if ck.tokenizer_uri is None:
            raise UserError(f"no tokenizer known for {ck.uri}; pass --tokenizer <tokenizer.json>")
        ck.model.config.use_cache = True
        return Generator(ck.model, hf_tokenizer(ck.tokenizer_uri, ck.cfg.model.seq_len, ck.eot_id), ck.cfg.model.seq_len)
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from raytrain.model import local_model_dir

    local = local_model_dir(model_dir)
    model = AutoModelForCausalLM.from_pretrained(local, dtype=torch.float32).eval()
    c = model.config
    context = getattr(c, "n_positions", None) or getattr(c, "max_position_embeddings", None) or 2048
    return Generator(model, AutoTokenizer.from_pretrained(local), context)
