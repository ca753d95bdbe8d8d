"""A transformers fp32 forward pass as the reference for vLLM's log-probs."""

from __future__ import annotations

from collections.abc import Mapping

import numpy as np


def load_reference(model_path: str, weights: Mapping | None = None):
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32)
    if weights is not None:
        missing, unexpected = model.load_state_dict(dict(weights), strict=False)
        assert not unexpected and set(missing) <= {"lm_head.weight"}, (missing, unexpected)
        model.tie_weights()
    return model.eval()


def rescore(model, prompt_ids, output_ids) -> np.ndarray:
    """log p(output_ids[t] | prompt + output_ids[:t]) for every t."""
    import torch

    prompt, output = list(map(int, prompt_ids)), list(map(int, output_ids))
    with torch.no_grad():
        logits = model(torch.tensor([prompt + output])).logits[0].float()
    logprobs = torch.log_softmax(logits, dim=-1)
    positions = torch.arange(len(prompt) - 1, len(prompt) + len(output) - 1)
    return logprobs[positions, torch.tensor(output)].numpy()


def greedy(model, prompt_ids, n: int) -> list[int]:
    import torch

    ids = list(map(int, prompt_ids))
    with torch.no_grad():
        for _ in range(n):
            ids.append(int(model(torch.tensor([ids])).logits[0, -1].argmax()))
    return ids[len(prompt_ids) :]
