"""`april generate`: run one engine on a prompt file without a broker, to check it by eye or by script.

Drives the engine exactly as a worker does (same factory, tokenizer and Engine calls) and prints each
sample: prompt and response text, response token ids, behaviour log-probs, finish reason; then tokens/s.
"""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

import numpy as np

from actors.engine import Engine, GenerationOutput, GenerationRequest, SamplingParams
from actors.engines.sim_engine import SampleIdentity
from actors.factory import make_engine, make_tokenizer
from april.config import Config
from april.data import JsonlPromptSource


def generate(config: Config, prompts: Path, n: int, as_json: bool) -> None:
    cfg = config.worker
    algo = config.algo
    tokenizer = make_tokenizer(cfg)
    source = JsonlPromptSource(
        prompts, prompt_key=config.data.prompt_key, answer_key=config.data.answer_key, shuffle=False
    )
    inputs: dict[int, tuple[np.ndarray[Any, Any], str]] = {}
    requests: list[GenerationRequest] = []
    for i in range(len(source)):
        record = source.get(i)
        ids = (
            record.prompt_ids
            if record.prompt_ids.shape[0]
            else tokenizer.encode_prompt(record.text, record.metadata)
        )
        for k in range(n):
            rid = i * n + k
            inputs[rid] = (ids, record.text)
            requests.append(GenerationRequest(rid, ids, algo.max_new_tokens))

    def identify(req: GenerationRequest) -> SampleIdentity:
        return SampleIdentity.of_sample(
            req.request_id // n, req.request_id % n, int(inputs[req.request_id][0].shape[0])
        )

    sampling = SamplingParams(
        algo.temperature, algo.top_p, algo.top_k, tokenizer.eos_token_ids, config.run.seed
    )
    engine = make_engine(cfg, sampling, identify, 0)
    started = time.monotonic()
    outputs = run_to_completion(engine, requests)
    elapsed = time.monotonic() - started
    engine.close()
    tokens = 0
    for out in sorted(outputs, key=lambda o: o.request_id):
        ids, text = inputs[out.request_id]
        tokens += int(out.token_ids.shape[0])
        row = {
            "prompt_ids": ids.tolist(),
            "response_ids": out.token_ids.tolist(),
            "logprobs": [round(float(x), 6) for x in out.logprobs],
            "finish_reason": out.finish_reason.name.lower(),
            "text": tokenizer.decode(out.token_ids),
        }
        if as_json:
            print(json.dumps(row))
        else:
            print(f"--- sample {out.request_id} ({row['finish_reason']}, {len(out.token_ids)} tokens)")
            print(f"prompt:   {text!r}")
            print(f"response: {row['text']!r}")
            print(f"ids:      {row['response_ids']}")
            print(f"logprobs: {row['logprobs']}")
    if not as_json:
        rate = tokens / max(elapsed, 1e-9)
        print(f"{len(outputs)} samples, {tokens} tokens in {elapsed:.2f}s: {rate:.1f} tokens/s")


def run_to_completion(engine: Engine, requests: list[GenerationRequest]) -> list[GenerationOutput]:
    """Keep the engine full until every request finished."""
    pending = list(requests)
    done: list[GenerationOutput] = []
    while pending or engine.active:
        free = engine.slots - engine.active
        if pending and free > 0:
            engine.add(pending[:free])
            pending = pending[free:]
        done.extend(engine.step())
    return done
