"""`april generate`: run one engine on a prompt file without a broker, to check it by eye or by script.

Drives the engine exactly as a worker does (same factory, tokenizer and Engine calls) and prints each
sample: prompt and response text, response token ids, behaviour log-probs, finish reason, and its reward
(`worker.reward`, run as a worker runs it) when the prompt has an answer; then tokens/s and the accuracy
(fraction of scored samples with reward > 0, as the broker's evaluations count it). Prompts need no
answer: without one a sample simply has no reward, and the command says so once, on stderr.
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np

from actors.engine import GenerationRequest, SamplingParams, run_to_completion
from actors.engines.sim_engine import SampleIdentity
from actors.factory import check_worker, make_engine, make_tokenizer
from actors.reward_runner import RewardRunner
from april.config import Config
from april.data import FilePromptSource


def generate(config: Config, prompts: Path, n: int, as_json: bool) -> None:
    cfg = config.worker
    algo = config.algo
    check_worker(cfg)
    tokenizer = make_tokenizer(cfg)
    source = FilePromptSource(
        prompts,
        prompt_key=config.data.prompt_key,
        answer_key=config.data.answer_key,
        answer_format=config.data.answer_format,
        shuffle=False,
        require_answer=False,  # generating needs no answer; a prompt without one is not scored
        continue_final_message=config.data.continue_final_message,
    )
    records = [source.get(i) for i in range(len(source))]
    inputs: dict[int, tuple[np.ndarray[Any, Any], str]] = {}
    requests: list[GenerationRequest] = []
    for i, record in enumerate(records):
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
    unanswered = sum("answer" not in r.metadata for r in records)
    if unanswered:  # said once: generating needs no answer, scoring does
        field = f"answer field {config.data.answer_key!r}"
        print(
            f"april generate: no prompt in {prompts} has an {field}: no reward, no accuracy"
            if unanswered == len(records)
            else f"april generate: {unanswered} of {len(records)} prompts in {prompts} have no {field}: "
            "their samples get no reward and are not in the accuracy",
            file=sys.stderr,
        )
    texts = {out.request_id: tokenizer.decode(out.token_ids) for out in outputs}
    answers = {rid: records[rid // n].metadata.get("answer") for rid in texts}
    scores = score(config, texts, answers, [r.metadata for r in records], n)
    tokens = 0
    for out in sorted(outputs, key=lambda o: o.request_id):
        ids, text = inputs[out.request_id]
        tokens += int(out.token_ids.shape[0])
        row: dict[str, Any] = {
            "prompt_ids": ids.tolist(),
            "response_ids": out.token_ids.tolist(),
            "logprobs": [round(float(x), 6) for x in out.logprobs],
            "finish_reason": out.finish_reason.name.lower(),
            "text": texts[out.request_id],
        }
        if out.request_id in scores:
            row["reward"], error = scores[out.request_id]
            if error:
                row["reward_error"] = error
        if as_json:
            print(json.dumps(row))
        else:
            print(f"--- sample {out.request_id} ({row['finish_reason']}, {len(out.token_ids)} tokens)")
            print(f"prompt:   {text!r}")
            print(f"response: {row['text']!r}")
            print(f"ids:      {row['response_ids']}")
            print(f"logprobs: {row['logprobs']}")
            if "reward" in row:
                print(f"reward:   {row['reward']}" + (f" ({error})" if error else ""))
    if not as_json:
        rate = tokens / max(elapsed, 1e-9)
        scored = [reward for reward, _ in scores.values()]
        accuracy = (
            f"; accuracy {sum(1 for r in scored if r is not None and r > 0) / len(scored):.3f} over "
            f"{len(scored)} scored samples"
            if scored
            else ""
        )
        print(f"{len(outputs)} samples, {tokens} tokens in {elapsed:.2f}s: {rate:.1f} tokens/s{accuracy}")


def score(
    config: Config,
    texts: dict[int, str],
    answers: dict[int, str | None],
    metadata: list[dict[str, str]],
    n: int,
) -> dict[int, tuple[float | None, str]]:
    """request id -> (reward, error) for the samples whose prompt has an answer, scored by worker.reward
    in its killable child process as a worker scores them; a failed reward is (None, why)."""
    scored = {rid: answer for rid, answer in answers.items() if answer is not None}
    if not scored:
        return {}
    results: dict[int, tuple[float | None, str]] = {}
    with RewardRunner(config.worker.reward, config.worker.reward_timeout_s) as rewards:
        for rid, answer in scored.items():
            rewards.submit(rid, texts[rid], answer, metadata[rid // n])
        while len(results) < len(scored):  # every submitted sample gets exactly one result
            for result in rewards.poll(wait_s=1.0):
                results[result.key] = (result.reward, result.error)
    return results
