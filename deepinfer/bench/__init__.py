"""``deepinfer bench``'s command line: a load generator for any OpenAI-compatible URL (deepinfer,
llama-server, vLLM, ...). Only argparse here, so ``deepinfer --help`` stays light; the run's
modules (httpx, numpy, tqdm, matplotlib) are imported once the command is chosen."""

from __future__ import annotations

import argparse
import os

# the defaults of the flags left out: a smoke run's, or a measurement's
QUICK = {"num_prompts": "8", "input_len": "32", "output_len": "8", "concurrency": "1,4"}
FULL = {"num_prompts": "200", "input_len": "256", "output_len": "128"}


def add_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--base-url", required=True, help="the server's OpenAI base URL, ending in /v1")
    parser.add_argument(
        "--api-key", default=os.environ.get("OPENAI_API_KEY", ""), help="(env OPENAI_API_KEY)"
    )
    parser.add_argument("--model", default="", help="the model to ask for (default: the first /models lists)")
    parser.add_argument("--workload", choices=("synthetic", "agent", "code-edit"), default="synthetic")
    load = parser.add_mutually_exclusive_group()
    load.add_argument("--concurrency", help="sessions in flight, one run per level: N[,N...]")
    load.add_argument("--request-rate", help="Poisson arrivals per second, one run per rate: R[,R...]")
    parser.add_argument("--num-prompts", type=int, help=f"requests per run (default {FULL['num_prompts']})")
    lengths = "N (fixed) or LOW:HIGH (uniform)"
    parser.add_argument("--input-len", help=f"prompt words per request or turn: {lengths} (default 256)")
    parser.add_argument("--output-len", help=f"max_tokens per request: {lengths} (default 128)")
    parser.add_argument("--turns", type=int, default=4, help="agent: turns per conversation")
    parser.add_argument(
        "--prediction", action="store_true", help="code-edit: send the edited snippet as a Predicted Output"
    )
    parser.add_argument(
        "--ignore-eos",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="ask for exactly max_tokens (deepinfer, vLLM and llama-server honour it)",
    )
    parser.add_argument("--temperature", type=float, default=0.0)
    parser.add_argument("--seed", type=int, default=0, help="the prompts' and the arrivals' seed")
    parser.add_argument("--out", default="bench-results", help="folder for the reports")
    parser.add_argument("--timeout-s", type=float, default=600.0, help="per request")
    parser.add_argument(
        "--quick", action="store_true", help="a smoke run: 8 short requests at concurrency 1 and 4"
    )
    prices = parser.add_argument_group("economics (USD)")
    prices.add_argument(
        "--price-input-per-m", type=float, default=0.28, help="per million uncached input tokens"
    )
    prices.add_argument(
        "--price-cached-input-per-m",
        type=float,
        help="per million cache-hit input tokens (default: input / 50)",
    )
    prices.add_argument("--price-output-per-m", type=float, default=0.42, help="per million output tokens")
    prices.add_argument("--num-devices", type=int, default=1, help="devices serving the URL")
    prices.add_argument("--rental-price-per-hour", type=float, default=7.0, help="per device")


def main(args: argparse.Namespace) -> None:
    from deepinfer.bench.run import run

    run(args)
