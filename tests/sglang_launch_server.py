"""A stand-in for `python -m sglang.launch_server` where no GPU is: the same argv, parsed by SGLang's own
parser, served by the fake rebuilt from SGLang's source (tests/sglang_server.py).

Run by the SGLang virtualenv's python (APRIL_SGLANG_PYTHON: SGLang 0.5.23 over a CPU torch, and uvicorn):
`python tests/sglang_launch_server.py [--eos-per-mille N] [--token-delay-s S] -- SGLANG FLAGS` (without
`--`, every argument is SGLang's), e.g. as `april up`'s `worker.sglang_launch`. SGLang's own (paths inside
the wheel, `sglang/srt/` omitted): the parser (server_args.py: prepare_server_args, as sglang/launch_server.py
calls it: a flag it does not take exits 2 with argparse's usage), the version, the environment flags.
Rebuilt: the model's config read as utils/hf_transformers/config.py: HfModelConfigParser.parse reads it
(AutoConfig; no model, no server), its context length (utils/hf_transformers/common.py:
get_context_length) and the refusal of a longer --context-length (configs/model_config.py:
_derive_context_length; importing that module needs torchvision), the ready line (entrypoints/http_server.py:
_wait_and_warmup), and the exit, code 0, on SIGTERM once no request is left (managers/tokenizer_manager.py:
sigterm_watchdog). Not SGLang: a toy model over the config's vocabulary and EOS id; --skip-tokenizer-init
is required (token ids only); GPU flags (--tp-size, --mem-fraction-static) parse and change nothing.
"""

from __future__ import annotations

import argparse
import logging
import os
import signal
import sys
import threading
import time
from typing import Any

from sglang_runtime import ToyModel
from sglang_server import FakeSGLangServer

log = logging.getLogger("sglang-stand-in")

CONTEXT_LENGTH_KEYS = (  # utils/hf_transformers/common.py: CONTEXT_LENGTH_KEYS, in its order
    "max_sequence_length",
    "seq_length",
    "max_seq_len",
    "model_max_length",
    "max_position_embeddings",
)
DRAIN_POLL_S = 0.1


def split_argv(argv: list[str]) -> tuple[argparse.Namespace, list[str]]:
    """The stand-in's own options (before a `--`) and SGLang's arguments."""
    own = argparse.ArgumentParser(prog="sglang_launch_server.py")
    own.add_argument("--eos-per-mille", type=int, default=0, help="toy model: EOS share of argmax tokens")
    own.add_argument("--token-delay-s", type=float, default=0.002, help="toy model: seconds a decode step")
    if "--" not in argv:
        return own.parse_args([]), argv
    cut = argv.index("--")
    return own.parse_args(argv[:cut]), argv[cut + 1 :]


def context_length(hf_config: Any) -> int:
    """utils/hf_transformers/common.py: get_context_length (rope scaling multiplies, except llama3's)."""
    rope = getattr(hf_config, "rope_scaling", None)
    factor = 1
    if rope and "original_max_position_embeddings" not in rope and rope.get("rope_type") != "llama3":
        factor = rope.get("factor", 1)
    for key in CONTEXT_LENGTH_KEYS:
        value = getattr(hf_config, key, None)
        if value is not None:
            return int(factor * value)
    return 2048


def server_config(args: Any, own: argparse.Namespace, version: str) -> dict[str, Any]:
    """FakeSGLangServer's keyword arguments for parsed `args` (a ServerArgs, not resolved)."""
    from sglang.srt.environ import envs
    from transformers import AutoConfig

    if not args.skip_tokenizer_init:
        raise SystemExit("sglang stand-in: serves token ids only; pass --skip-tokenizer-init")
    hf = AutoConfig.from_pretrained(
        args.model_path, trust_remote_code=args.trust_remote_code, revision=args.revision
    )
    text = hf.get_text_config()
    derived = context_length(text)
    context = derived if args.context_length is None else args.context_length
    if context > derived and not envs.SGLANG_ALLOW_OVERWRITE_LONGER_CONTEXT_LEN.get():
        raise ValueError(  # configs/model_config.py: _derive_context_length's message, shortened
            f"User-specified context_length ({context}) is greater than the derived context_length "
            f"({derived}). To allow overriding this maximum, set the env var "
            "SGLANG_ALLOW_OVERWRITE_LONGER_CONTEXT_LEN=1"
        )
    eos = text.eos_token_id if text.eos_token_id is not None else getattr(hf, "eos_token_id", None)
    eos = eos[0] if isinstance(eos, list) else eos
    eos_id = {} if eos is None else {"eos_token_id": int(eos)}
    model = ToyModel(vocab_size=int(text.vocab_size), eos_per_mille=own.eos_per_mille, **eos_id)
    config: dict[str, Any] = {
        "version": version,
        "model_path": args.model_path,
        "model_dir": args.model_path,  # its tensors held under SGLang's names: what updates replace
        "weight_version": args.weight_version,
        "context_length": context,
        "skip_tokenizer_init": True,
        "enable_deterministic_inference": args.enable_deterministic_inference,
        "return_original_logprob": envs.SGLANG_RETURN_ORIGINAL_LOGPROB.get(),
        "token_delay_s": own.token_delay_s,
        "model": model,
    }
    if args.max_running_requests is not None:
        config["max_running_requests"] = args.max_running_requests
    if args.max_total_tokens is not None:
        config["kv_capacity"] = args.max_total_tokens
    if args.random_seed is not None:
        config["random_seed"] = args.random_seed
    return config


def serve(server: FakeSGLangServer) -> int:
    """Serve until SIGTERM or SIGINT, then let the requests left finish and exit 0; 1 if the fake died."""
    stop = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda signum, frame: stop.set())
    server.start()
    log.info("The server is fired up and ready to roll!")
    while not stop.wait(0.2):
        if not server.running:
            log.error("the server stopped on its own")
            return 1
    log.warning("SIGTERM received. Draining requests and shutting down...")
    while server.running and server.runtime is not None and server.runtime.rid_to_state:
        time.sleep(DRAIN_POLL_S)
    server.stop()
    return 0


def main(argv: list[str]) -> int:
    own, sglang_argv = split_argv(argv)
    from sglang.srt.server_args import prepare_server_args
    from sglang.version import __version__

    args = prepare_server_args(sglang_argv)  # argparse: exit 2 with the usage on a flag SGLang refuses
    os.environ.setdefault("HF_HUB_OFFLINE", "1")  # a model path that is not a directory fails here at once
    config = server_config(args, own, __version__)
    log.info("stand-in for sglang %s: %s on %s:%s", __version__, args.model_path, args.host, args.port)
    return serve(FakeSGLangServer(host=args.host, port=args.port, **config))


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
