"""Offline batch generation with the engine, in-process (no worker): GRPO-style groups of samples per prompt, with
logprobs, on the built-in tiny model and tokenizer.

    python examples/generate_batch.py [--model <HF dir or id>] [--samples 4] [--max-new-tokens 32]

On the tiny model the printed text is gibberish, and that is expected: its weights are random (every token is about
equally likely: a mean logprob near -ln(1024) = -6.9), and most of its token ids are letter pairs and triples (the
tokenizer covers the whole vocabulary: characters, chat markers, then pairs and triples). `--model` with a real
checkpoint prints real text.
"""

from __future__ import annotations

import argparse
import sys

import torch

from rollout import ContinuousBatchingConfig, SamplingParams, generate_batch
from rollout.presets import tiny_model, tiny_tokenizer

TINY_NOTE = (
    "tiny model: random weights, so the text below is gibberish (mostly letter pairs and triples, the tokens most of "
    "its 1024 ids stand for); pass --model <HF dir or id> for real text"
)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=None, help="a local Hugging Face model directory or hub id (default: tiny)")
    parser.add_argument("--samples", type=int, default=4, help="samples per prompt (default: 4)")
    parser.add_argument("--max-new-tokens", type=int, default=32, help="tokens per sample (default: 32)")
    args = parser.parse_args(argv)
    for flag, count in (("--samples", args.samples), ("--max-new-tokens", args.max_new_tokens)):
        if count < 1:
            parser.error(f"{flag} {count}: must be at least 1")
    if args.model is None:
        model, tokenizer = tiny_model(), tiny_tokenizer()
        print(TINY_NOTE)
    else:
        from rollout.service.launch.loading import load_model, load_tokenizer

        try:  # a hub id on a machine without network is one line at once, not a minute of retries
            model = load_model(args.model, None, torch.device("cpu"))
            tokenizer, _ = load_tokenizer(args.model, None)
        except (ValueError, OSError) as error:
            parser.error(str(error).splitlines()[0])
        if tokenizer is None:
            parser.error(f"--model {args.model}: no tokenizer found with it (this example prints text)")
    prompts = ["The capital of France is", "def fibonacci(n):", "Once upon a time"]
    outputs = generate_batch(
        model,
        [tokenizer(p, add_special_tokens=False)["input_ids"] for p in prompts],
        sampling=SamplingParams(do_sample=True, temperature=0.8, top_p=0.95, seed=0),
        max_new_tokens=args.max_new_tokens,
        n=args.samples,  # the prompt is prefilled once and its KV shared by the samples
        continuous_batching_config=ContinuousBatchingConfig(num_blocks=512),
    )
    for request_id, output in outputs.items():
        prompt = prompts[int(request_id.split("#")[0].removeprefix("req_"))]
        text = tokenizer.decode(output.generated_tokens, skip_special_tokens=True)
        mean_logprob = sum(output.logprobs) / max(len(output.logprobs), 1)
        print(f"{request_id:>8} [{output.finish_reason}, mean logprob {mean_logprob:.2f}] {prompt!r} -> {text!r}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
